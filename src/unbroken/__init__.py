"""unbroken: keep distributed PyTorch training alive through failures.

A training script needs only::

    import unbroken
    ctx = unbroken.init()
    restored = ctx.checkpoint.restore()
    ...
    ctx.progress(step, loss=loss)
    ctx.checkpoint.save(step, state)
"""

from unbroken.train import Context, init

__all__ = ["Context", "init", "__version__"]
__version__ = "0.1.0"
