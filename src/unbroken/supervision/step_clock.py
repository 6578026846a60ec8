"""The one step clock: the times between a rank's steps (``StepIntervals``), and what the node agent
builds on it for its reports (``RankClock``, ``worker_timing``); ``unbroken run``'s hang watch
(``kubernetes/pod_launcher/hang.py``) keeps a ``StepIntervals`` of its pod's ranks.

Step times of one worker's ranks, from the progress datagrams they already send.

Per rank: the wall time between consecutive steps over the last ``WINDOW`` steps, and the
time in each ``ctx.section`` (sent with ``ctx.progress``) over the last ``SCORE_WINDOW``.
The first ``WARMUP_STEPS`` of every process are left out: the first steps
compile, warm caches and set up the all-reduce's connections, and would make a
healthy rank look slow and a hang timeout too generous.

Medians, not means: a shared machine's noise (another process taking the core
for 200 ms) lands on one step of twenty and moves a median by nothing. The
agent keeps ``WINDOW`` floats per rank and section; a report is computed once
per lease renewal, not per step.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from unbroken.rank.channel import SECTION_PREFIX
from unbroken.state.records import RankTiming, StepTiming

WINDOW = 20
"""Steps the median step time (what hang timeouts follow) is taken over: long enough to shrug off a
noisy step."""
SCORE_WINDOW = 9
"""Steps the median *work* and section times (what straggler scores compare) are taken over: a node
that slows down shows in its score after 5 steps (it took 11 with ``WINDOW``: most of the 46-50 steps a
1.5x slowdown took to be named), and up to 4 noisy steps of 9 still move nothing."""
WARMUP_STEPS = 3
"""Steps of each process not measured (compilation, first all-reduce, cold caches)."""
MAX_SECTIONS = 16
"""Section names kept per rank: a datagram is anyone's to send, the agent's memory is not."""


class StepIntervals:
    """Seconds per step between consecutive steps: the median of the last ``window``, the longest gap
    ever added, and how many were added."""

    def __init__(self, window: int = WINDOW) -> None:
        self.recent: deque[float] = deque(maxlen=window)
        self.longest = 0.0
        self.count = 0

    def add(self, per_step: float, gap: float | None = None) -> None:
        """One interval: ``per_step`` seconds a step, over a ``gap`` (default: one step's) between two reports."""
        self.recent.append(per_step)
        self.longest = max(self.longest, per_step if gap is None else gap)
        self.count += 1

    def median(self) -> float | None:
        return statistics.median(self.recent) if self.recent else None


@dataclass
class RankClock:
    """One rank process's recent step times."""

    last_step: int | None = None
    last_ts: float | None = None
    reports: int = 0
    intervals: StepIntervals = field(default_factory=StepIntervals)
    work: deque[float] = field(default_factory=lambda: deque(maxlen=SCORE_WINDOW))
    sections: dict[str, deque[float]] = field(default_factory=dict)

    def observe(self, step: int, ts: float, metrics: dict[str, float]) -> None:
        """A progress report of ``step`` at ``ts`` with its sections' seconds since the previous one."""
        if self.last_step is not None and self.last_ts is not None and step > self.last_step:
            self.reports += 1
            if self.reports > WARMUP_STEPS:
                steps = step - self.last_step
                gap = max(0.0, ts - self.last_ts)
                self.intervals.add(gap / steps, gap)
                self._observe_sections(metrics, steps)
        if self.last_step is None or step >= self.last_step:
            self.last_step, self.last_ts = step, ts

    def went_back(self, step: int) -> bool:
        """``step`` is older than this rank's last (it restored an older checkpoint): measure afresh."""
        return self.last_step is not None and step < self.last_step

    def _observe_sections(self, metrics: dict[str, float], steps: int) -> None:
        scored = {key[len(SECTION_PREFIX):]: seconds for key, seconds in metrics.items() if key.startswith(SECTION_PREFIX)}
        if not scored:
            return
        self.work.append(sum(scored.values()) / steps)
        for name, seconds in scored.items():
            window = self.sections.get(name)
            if window is None:
                if len(self.sections) >= MAX_SECTIONS:
                    continue
                window = self.sections[name] = deque(maxlen=SCORE_WINDOW)
            window.append(seconds / steps)

    def timing(self, rank: int) -> RankTiming:
        return RankTiming(rank=rank, work_s=statistics.median(self.work) if self.work else None,
                          sections={name: statistics.median(w) for name, w in self.sections.items() if w})


def worker_timing(clocks: dict[int, RankClock]) -> StepTiming | None:
    """The worker's timing from its ranks' clocks: the slowest rank's median step, the longest gap of
    any, the median rank's work and sections, and the slowest rank's; None until every rank that
    reports has measured a step. O(ranks x sections) once per report, a few hundred bytes out."""
    measured = {rank: clock for rank, clock in clocks.items() if clock.intervals.count}
    if not measured or len(measured) < len([c for c in clocks.values() if c.last_step is not None]):
        return None
    ranks = [clock.timing(rank) for rank, clock in sorted(measured.items())]
    working = [r for r in ranks if r.work_s is not None]
    names = {name for r in working for name in r.sections}
    return StepTiming(
        steps=min(clock.intervals.count for clock in measured.values()),
        median_s=max(clock.intervals.median() or 0.0 for clock in measured.values()),
        longest_s=max(clock.intervals.longest for clock in measured.values()),
        work_s=statistics.median(r.work_s for r in working if r.work_s is not None) if working else None,
        sections={name: statistics.median(r.sections[name] for r in working if name in r.sections) for name in sorted(names)},
        slowest=max(working, key=lambda r: r.work_s or 0.0) if working else None,
    )
