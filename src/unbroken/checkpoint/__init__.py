"""Checkpoints. This release has the file checkpointer (``checkpoint.file``); the tiered
one plugs in behind the same ``Checkpointer`` protocol. Importing this package does
not import torch."""

from unbroken.checkpoint.api import Checkpointer, Restored

__all__ = ["Checkpointer", "Restored"]
