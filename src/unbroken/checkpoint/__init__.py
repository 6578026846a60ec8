"""Checkpoints: the ``Checkpointer`` protocol (``api``) a rank's ``ctx.checkpoint`` implements, the
rank's side (``rank/``), the node's side (``node/``) and the format both write (``format/``).
Importing this package does not import torch."""

from unbroken.checkpoint.api import Checkpointer, Restored

__all__ = ["Checkpointer", "Restored"]
