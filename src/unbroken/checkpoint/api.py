"""What a training script calls: ``save(step, state)`` and ``restore()``.

A small protocol so the tiered checkpointer (memory + replicas + persistent)
can replace the file one without the training script changing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Restored:
    step: int
    state: dict[str, Any]
    source: str
    """Where it came from (a path or a tier name), for the log line a person reads."""


class Checkpointer(Protocol):
    def save(self, step: int, state: dict[str, Any]) -> None:
        """Every rank calls it with its own state; returns once the state is durable."""

    def restore(self) -> Restored | None:
        """The newest step that every rank can read, or None for a fresh start."""
