"""Fold rank messages into per-worker progress rows.

Ranks send a datagram per step; the store gets at most one write per worker
per flush. ``last_progress_at`` is the *oldest* of the ranks' latest reports,
so one stopped rank makes the whole worker look stuck, which is the truth:
its peers are blocked in a collective waiting for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from unbroken.channel import MessageKind, RankMessage
from unbroken.state.records import RankInfo


@dataclass
class _RankProgress:
    local_rank: int
    pid: int
    step: int | None = None
    ts: float | None = None


@dataclass
class WorkerProgress:
    ranks: dict[int, _RankProgress] = field(default_factory=dict)
    first_step: int | None = None
    first_progress_at: float | None = None
    restored_step: int | None = None
    dirty: bool = False

    def apply(self, msg: RankMessage) -> None:
        rank = self.ranks.get(msg.rank)
        if rank is None or rank.pid != msg.pid:
            rank = self.ranks[msg.rank] = _RankProgress(local_rank=msg.local_rank, pid=msg.pid)
        if msg.kind is MessageKind.PROGRESS and msg.step is not None:
            rank.step, rank.ts = msg.step, msg.ts
            if self.first_progress_at is None or msg.ts < self.first_progress_at:
                self.first_progress_at, self.first_step = msg.ts, msg.step
        elif msg.kind is MessageKind.RESTORED and msg.step is not None:
            self.restored_step = msg.step
        self.dirty = True

    def changes(self) -> dict[str, Any]:
        """Columns of the worker row to write for the current state."""
        reporting = [r for r in self.ranks.values() if r.ts is not None]
        changes: dict[str, Any] = {
            "ranks": tuple(sorted((RankInfo(rank=k, local_rank=r.local_rank, pid=r.pid) for k, r in self.ranks.items()),
                                  key=lambda info: info.rank)),
        }
        if reporting:
            changes["last_step"] = min(r.step for r in reporting if r.step is not None)
            changes["last_progress_at"] = min(r.ts for r in reporting if r.ts is not None)
            changes["first_step"] = self.first_step
            changes["first_progress_at"] = self.first_progress_at
        if self.restored_step is not None:
            changes["restored_step"] = self.restored_step
        return changes


class ProgressBook:
    """Per (job, attempt) progress of the workers on this node."""

    def __init__(self) -> None:
        self._workers: dict[tuple[str, int], WorkerProgress] = {}

    def apply(self, messages: list[RankMessage]) -> None:
        for msg in messages:
            self._workers.setdefault((msg.job, msg.attempt), WorkerProgress()).apply(msg)

    def take_dirty(self, keys: set[tuple[str, int]] | None = None) -> dict[tuple[str, int], dict[str, Any]]:
        """Row changes for workers with news since the last take (only ``keys``, if given)."""
        out = {}
        for key, progress in self._workers.items():
            if progress.dirty and (keys is None or key in keys):
                out[key] = progress.changes()
                progress.dirty = False
        return out

    def forget(self, job: str, attempt: int) -> None:
        self._workers.pop((job, attempt), None)
