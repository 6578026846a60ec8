"""Fold rank messages into per-worker progress, reported with the node's lease renewal.

Ranks send a datagram per step; the store gets what changed since the last
renewal, at most once a second per node, whatever the step rate.
``last_progress_at`` is the *oldest* of the ranks' latest reports, so one
stopped rank makes the whole worker look stuck, which is the truth: its peers
are blocked in a collective waiting for it.

Thread-safe: the lease loop takes what changed while the worker loop takes a
finished worker's last report.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from unbroken.supervision.step_clock import RankClock, worker_timing
from unbroken.rank.channel import SUSPECT_PREFIX, MessageKind, RankMessage
from unbroken.plumbing.metrics import AgentMetrics
from unbroken.state.records import Divergence, RankInfo, WorkerProgress


_TIERS = frozenset({"memory", "file"})
_SOURCES = frozenset({"memory", "replica", "peer", "persistent", "file"})


@dataclass
class _RankProgress:
    local_rank: int
    pid: int
    step: int | None = None
    ts: float | None = None
    stalled: float = 0.0
    """Seconds this rank's saves blocked its training loop."""
    saved: int | None = None
    finished_at: float | None = None
    """When the rank said it is done (``MessageKind.FINISHED``): from then on it is exiting, not training."""
    clock: RankClock = field(default_factory=RankClock)


@dataclass
class _Progress:
    ranks: dict[int, _RankProgress] = field(default_factory=dict)
    first_step: int | None = None
    first_progress_at: float | None = None
    restored_step: int | None = None
    divergence: Divergence | None = None
    """The first divergence a rank of the worker reported (every rank of a group reports the same verdict)."""
    dirty: bool = False

    def apply(self, msg: RankMessage) -> None:
        rank = self.ranks.get(msg.rank)
        if rank is None or rank.pid != msg.pid:
            rank = self.ranks[msg.rank] = _RankProgress(local_rank=msg.local_rank, pid=msg.pid)
        if msg.kind is MessageKind.PROGRESS and msg.step is not None:
            rank.step, rank.ts = msg.step, msg.ts
            if rank.clock.went_back(msg.step):
                rank.clock = RankClock()
            rank.clock.observe(msg.step, msg.ts, msg.metrics)
            if self.first_progress_at is None or msg.ts < self.first_progress_at:
                self.first_progress_at, self.first_step = msg.ts, msg.step
        elif msg.kind is MessageKind.RESTORED and msg.step is not None:
            self.restored_step = msg.step
        elif msg.kind is MessageKind.SAVED:
            rank.stalled += float(msg.metrics.get("stall_seconds", 0.0))
            rank.saved = msg.step
        elif msg.kind is MessageKind.FINISHED:
            rank.finished_at = msg.ts
        elif msg.kind is MessageKind.DIVERGED and msg.step is not None and self.divergence is None:
            self.divergence = _divergence(msg)
        self.dirty = True

    def report(self, job: str, attempt: int) -> WorkerProgress:
        reporting = [r for r in self.ranks.values() if r.ts is not None and r.step is not None]
        # A rank that said it finished is exiting: its silence since is not the worker's (a peer still winding down, or
        # still training, is timed by its own reports).
        training = [r for r in reporting if r.finished_at is None] or reporting
        finished = [r.finished_at for r in self.ranks.values() if r.finished_at is not None]
        ranks = tuple(sorted((RankInfo(rank=k, local_rank=r.local_rank, pid=r.pid) for k, r in self.ranks.items()),
                             key=lambda info: info.rank))
        return WorkerProgress(
            job=job, attempt=attempt, ranks=ranks,
            first_step=self.first_step if reporting else None,
            first_progress_at=self.first_progress_at if reporting else None,
            last_step=min(r.step for r in reporting if r.step is not None) if reporting else None,
            last_progress_at=min(r.ts for r in training if r.ts is not None) if training else None,
            restored_step=self.restored_step,
            checkpoint_stall_s=max((r.stalled for r in self.ranks.values()), default=0.0) or None,
            saved_step=_oldest([r.saved for r in self.ranks.values()]),
            step_timing=worker_timing({k: r.clock for k, r in self.ranks.items()}),
            divergence=self.divergence,
            finished_at=max(finished) if finished and len(finished) == len(self.ranks) else None,
        )


def _divergence(msg: RankMessage) -> Divergence:
    assert msg.step is not None
    suspects = sorted(int(key.removeprefix(SUSPECT_PREFIX)) for key in msg.metrics
                      if key.startswith(SUSPECT_PREFIX) and key.removeprefix(SUSPECT_PREFIX).isdigit())
    return Divergence(step=msg.step, agreed_step=int(msg.metrics.get("agreed_step", -1)), suspects=tuple(suspects),
                      majority=bool(msg.metrics.get("majority", 0.0)), tensor=msg.detail or None)


def _oldest(saved: list[int | None]) -> int | None:
    """The step every rank has saved: the oldest of their latest, None until each has saved one."""
    steps = [s for s in saved if s is not None]
    return min(steps) if steps and len(steps) == len(saved) else None


class ProgressBook:
    """Per (job, attempt) progress of the workers on this node; saves and restores also go to ``metrics``."""

    def __init__(self, metrics: AgentMetrics | None = None) -> None:
        self._workers: dict[tuple[str, int], _Progress] = {}
        self._lock = threading.Lock()
        self.metrics = metrics

    def apply(self, messages: list[RankMessage]) -> None:
        with self._lock:
            for msg in messages:
                self._workers.setdefault((msg.job, msg.attempt), _Progress()).apply(msg)
                if self.metrics is not None:
                    self._measure(self.metrics, msg)

    @staticmethod
    def _measure(metrics: AgentMetrics, msg: RankMessage) -> None:
        # Labels only from known words: a datagram is anyone's to send, a metric's series are not.
        if msg.kind is MessageKind.SAVED:
            tier = msg.detail if msg.detail in _TIERS else "other"
            metrics.save_stall.labels(tier).observe(float(msg.metrics.get("stall_seconds", 0.0)))
        elif msg.kind is MessageKind.RESTORED and "seconds" in msg.metrics:
            source = msg.detail if msg.detail in _SOURCES else "other"
            metrics.restore.labels(source).observe(float(msg.metrics["seconds"]))

    def take_dirty(self) -> list[WorkerProgress]:
        """Reports of the workers with news since the last take."""
        with self._lock:
            out = []
            for (job, attempt), progress in self._workers.items():
                if progress.dirty:
                    out.append(progress.report(job, attempt))
                    progress.dirty = False
            return out

    def current(self) -> list[WorkerProgress]:
        """Every job's latest attempt on this node, news or not; older attempts are forgotten (their
        ranks are gone). For a store that rewrites the whole report each renewal (a Lease annotation),
        where a stopped rank must keep showing its last step, not vanish."""
        with self._lock:
            latest: dict[str, int] = {}
            for job, attempt in self._workers:
                latest[job] = max(attempt, latest.get(job, attempt))
            for key in [k for k in self._workers if k[1] != latest[k[0]]]:
                del self._workers[key]
            return [progress.report(job, attempt) for (job, attempt), progress in sorted(self._workers.items())]

    def stepped(self, job: str, attempt: int) -> bool:
        """A rank of the worker has reported a training step (its startup is over)."""
        with self._lock:
            progress = self._workers.get((job, attempt))
            # not report(): this runs on the agent's worker loop, and a report computes the step timing
            return progress is not None and progress.first_step is not None and any(
                r.ts is not None and r.step is not None for r in progress.ranks.values())

    def finished_at(self, job: str, attempt: int, ranks: int) -> float | None:
        """When the last of the worker's ``ranks`` ranks said it finished, or None while one has not."""
        with self._lock:
            progress = self._workers.get((job, attempt))
            if progress is None:
                return None
            done = [r.finished_at for r in progress.ranks.values() if r.finished_at is not None]
            return max(done) if len(done) >= ranks else None

    def take(self, job: str, attempt: int) -> WorkerProgress | None:
        """The worker's report and its end in this book (it finished)."""
        with self._lock:
            progress = self._workers.pop((job, attempt), None)
            return None if progress is None else progress.report(job, attempt)
