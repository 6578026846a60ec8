"""The fence between an overlapped save and the next change of the saved state.

``TieredCheckpointer.save`` returns as soon as the copy into shared memory is
scheduled; the copy runs while the script does its next forward and backward,
which read the parameters and optimizer state but do not change them. The
first thing that does change them is ``optimizer.step()``: one global
optimizer step pre-hook (``torch.optim.Optimizer.register_optimizer_step_pre_hook``,
which sees every optimizer, including ones made after it) waits there for the
copies of every live checkpointer of the process. A script that changes the
saved state some other way (a manual update of a parameter, BatchNorm running
statistics in a forward in train mode, a scheduler writing into the state it
saved) calls ``ctx.checkpoint.fence()`` first.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook


class Fenced(Protocol):
    def fence(self) -> None:
        """Return once the last save's bytes are all copied."""


_live: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()
_hook: Any = None


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for checkpointer in list(_live):
        checkpointer.fence()


def watch(checkpointer: Fenced) -> None:
    """Fence ``checkpointer`` before every optimizer step from now on (while it lives)."""
    global _hook
    with _lock:
        _live.add(checkpointer)
        if _hook is None:
            _hook = register_optimizer_step_pre_hook(_before_step)


def forget(checkpointer: Fenced) -> None:
    with _lock:
        _live.discard(checkpointer)
