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


@dataclass(frozen=True)
class SaveReport:
    """One save as the training loop felt it: what the agent turns into metrics and badput."""

    step: int
    tier: str
    """``memory`` (the tiered checkpointer's stage) or ``file``."""
    stall_seconds: float
    """How long ``save`` blocked the training loop."""
    bytes: int


@dataclass(frozen=True)
class RestoreReport:
    step: int
    source: str
    """Where the rank's shard came from: ``memory``, ``replica``, ``peer``, ``persistent`` or ``file``."""
    seconds: float


class CheckpointObserver(Protocol):
    """Told of every save and restore; ``unbroken.init()`` passes one that reports to the node agent."""

    def saved(self, report: SaveReport) -> None: ...
    def restored(self, report: RestoreReport) -> None: ...


class Checkpointer(Protocol):
    def save(self, step: int, state: dict[str, Any]) -> None:
        """Every rank calls it with its own state. The file checkpointer returns once the state is
        durable; the tiered one once its copy is scheduled (see ``fence``)."""

    def fence(self) -> None:
        """Return once the last save no longer reads the state it was given. ``optimizer.step()``
        fences by itself; call it before changing saved state any other way."""

    def restore(self, device: Any = None) -> Restored | None:
        """The newest step that every rank can read, or None for a fresh start. ``device`` (``"cuda"``): where
        the state's tensors go; the tiered checkpointer streams them there through pinned memory."""

    def prepare(self, state: dict[str, Any]) -> None:
        """Get ready to save ``state`` (its size known, buffers allocated) so the first save costs what the others do."""

    def agreed(self, step: int) -> None:
        """The replicas agreed on ``step``'s state (``ctx.watch_replicas``): until a later step is agreed, retention
        keeps the newest checkpoint at or before it, the one a disagreement rolls back to, however many are saved
        meanwhile. Never called without ``watch_replicas``: retention is then the plain newest ``keep``."""

    def distrust_after(self, step: int, why: str) -> None:
        """The replicas stopped agreeing after ``step`` (silent data corruption): what this rank saved after it must
        never be restored. The file checkpointer quarantines those folders itself; the tiered one leaves it to the
        controller, which marks the steps in the catalog (the rows are shared by every node)."""

    def close(self) -> None:
        """Finish the save in flight and let go of what the checkpointer holds (an in-process
        restart makes a new one for the next attempt)."""
