"""Straggler nodes: nodes whose ranks run persistently slower than the job's other nodes.

A synchronous job runs at the pace of its slowest rank, and the wall time of
a step is the same on every rank (the fast ones wait in the all-reduce). So a
rank is scored on the time it spends in its own work: the ``ctx.section``\\ s
it marks, except those that wait on peers. Its **score** is the median work
time of the ranks on the job's *other* nodes over its own, capped at 1:

- 1.0: as fast as its peers; 0.5: it takes twice as long. NVIDIA's resiliency
  extension calls this the "relative" score and flags ranks under 0.75.
- The reference is the median over the job's other nodes of each node's median
  rank: it leaves out the rank's own node, so a node whose eight ranks all slow
  down together does not raise its own reference, and a two-node job still has one.
- Each rank's work time is already a median over its last 9 steps
  (``supervision/step_clock.py``): a noisy step moves nothing.

A node's score is its worst rank's. A node is a **straggler** once the evidence
against it has reached ``EVIDENCE`` over at least ``CONFIRM_REPORTS`` of its own
reports and ``CONFIRM_STEPS`` job steps. The evidence is a one-sided CUSUM of
its shortfall: each report adds ``threshold - score`` (a report above the line
takes away as much as it is above, down to 0), so a deep dip is flagged fast, a
shallow one only if it lasts, and a slow node's one report that looks healthy
(the medians of a shared machine) delays its flag by that report's worth, not
from the start. It stops being one after its score has stayed above
``threshold + RECOVER_MARGIN`` for ``CONFIRM_STEPS`` and ``CONFIRM_REPORTS``. With no
sections reported there is nothing to score (a step's wall time cannot tell a
straggler from its waiting peers), and nothing is ever flagged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from unbroken.state.records import StepTiming, Worker

CONFIRM_STEPS = 5
"""Job steps a score must stay under the threshold (or above it plus the margin) to flag (or clear) a node."""
CONFIRM_REPORTS = 3
"""The node's *own* reports (its agent's, about a second apart) since its evidence last stood at 0 that a flag
needs, and the reports in a row above the threshold plus the margin that clear it. Its own: the other nodes'
reports move its reference too, but two observations a tenth of a second apart, one from each agent, are one
measurement, not two. Three, not two: on this 2-core machine a healthy node's score dipped to 0.63-0.67 for two
reports in a row while a CPU hog and three agents shared the cores (tests/fixtures/straggler-traces), and two such
reports flagged it."""
EVIDENCE = 0.15
"""The shortfall (a CUSUM of ``threshold - score``) that flags a node: a node at half speed (0.5 against
0.75) or at 1.5x (0.67) is flagged on its third report, one that hovers just under the line (0.74) only
after 15 s of it. A CPU scheduler's imbalance on a shared machine dips a score for a second or two and is
paid back by the healthy reports after it; a slow GPU or a noisy neighbour stays."""
RECOVER_MARGIN = 0.1
SECTION_NAMED_BELOW = 0.8
"""A section is named as the slow one only where the rank's score in it is under this (it takes 1.25x its peers'
time or more): a section within a quarter of its peers' is within a shared machine's noise, and naming it would
send the user to the wrong part of the step."""
MIN_MEASURED_STEPS = 5
"""A worker's timing counts once its ranks have measured this many steps after their warm-up."""


@dataclass(frozen=True)
class NodeScore:
    node: str
    score: float
    rank: int
    """The node's slowest rank."""
    section: str | None
    """That rank's slowest scored section relative to its peers (None: no per-section figures, or no section slower
    than its peers': the time is spread over them)."""
    section_score: float | None = None
    reported_step: int | None = None
    """The last step of the node's own report (its worker's): a new one is a new measurement of the node."""


def scores(workers: list[Worker]) -> dict[str, NodeScore]:
    """Each node's score, for the nodes of ``workers`` (one attempt) whose ranks report scored sections.

    O(nodes log nodes) per job: each agent sends its node's summary (the median rank's work and
    sections, the slowest rank's), so 2,048 nodes of 8 ranks score in milliseconds."""
    timed: dict[str, StepTiming] = {}
    reported: dict[str, int | None] = {}
    for w in workers:
        timing = w.step_timing
        if w.phase.is_terminal or timing is None or timing.steps < MIN_MEASURED_STEPS:
            continue
        if timing.work_s and timing.slowest is not None and timing.slowest.work_s:
            timed.setdefault(w.node, timing)
            reported.setdefault(w.node, w.last_step)
    if len(timed) < 2:
        return {}
    nodes = sorted(timed)
    references = leave_one_out_medians([timed[n].work_s or 0.0 for n in nodes])
    sections = _section_references(timed, nodes)
    out: dict[str, NodeScore] = {}
    for node, reference in zip(nodes, references, strict=True):
        slowest = timed[node].slowest
        assert slowest is not None and slowest.work_s  # filtered above
        # The section named is the one the rank is slowest in against its peers, and only one clearly slower
        # (SECTION_NAMED_BELOW): each section's time is its own median, so a slowdown that lands in a different
        # section each step (a node stopped for part of every 50 ms) can lift the work's median while no section's
        # moves. CI named 'forward' "at 1" then, and 'data' at 0.967 beside a node at 0.738: no section is named now.
        worst: tuple[str | None, float | None] = (None, None)
        for name, seconds in slowest.sections.items():
            peers = sections.get(name, {}).get(node)
            if peers is not None and seconds > 0 and peers / seconds < SECTION_NAMED_BELOW \
                    and (worst[1] is None or peers / seconds < worst[1]):
                worst = (name, peers / seconds)
        out[node] = NodeScore(node, round(min(1.0, reference / slowest.work_s), 3), slowest.rank, worst[0],
                              None if worst[1] is None else round(worst[1], 3), reported.get(node))
    return out


def _section_references(timed: dict[str, StepTiming], nodes: list[str]) -> dict[str, dict[str, float]]:
    """For each section: node -> the median over the other nodes of their median rank's time in it."""
    names = {name for timing in timed.values() for name in timing.sections}
    out: dict[str, dict[str, float]] = {}
    for name in names:
        having = [(n, seconds) for n in nodes if (seconds := timed[n].sections.get(name))]
        if len(having) >= 2:
            out[name] = dict(zip((n for n, _ in having), leave_one_out_medians([t for _, t in having]), strict=True))
    return out


def leave_one_out_medians(values: list[float]) -> list[float]:
    """For each value, the median of all the others: one sort, then O(1) each (at least two values)."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranked = [values[i] for i in order]
    position = {index: rank for rank, index in enumerate(order)}
    rest = len(values) - 1

    def kth(k: int, removed: int) -> float:  # the k-th smallest of the others
        return ranked[k if k < removed else k + 1]

    out = []
    for i in range(len(values)):
        removed = position[i]
        if rest % 2:
            out.append(kth(rest // 2, removed))
        else:
            out.append((kth(rest // 2 - 1, removed) + kth(rest // 2, removed)) / 2)
    return out


@dataclass
class _Track:
    low_since: int | None = None
    """The job step at which the evidence last rose from 0."""
    low_reports: int = 0
    """The node's reports since then."""
    evidence: float = 0.0
    """The CUSUM of ``threshold - score`` over those reports (never under 0)."""
    high_since: int | None = None
    high_reports: int = 0
    seen_at: int | None = None
    """The node's own last reported step when last looked at (a pass with no new report of it changes nothing)."""
    flagged: bool = False
    shadowed: bool = False


@dataclass(frozen=True)
class Change:
    node: str
    straggler: bool
    """True: it became one; False: it recovered."""
    score: NodeScore


@dataclass
class StragglerWatch:
    """Hysteresis over the scores of each (job, attempt)'s nodes. In memory: a new controller
    starts unflagged and flags again after ``CONFIRM_STEPS``."""

    _tracks: dict[tuple[str, int], dict[str, _Track]] = field(default_factory=dict)

    def observe(self, job: str, attempt: int, step: int | None, node_scores: dict[str, NodeScore], threshold: float) -> list[Change]:
        """The nodes that became stragglers, or stopped being ones, at job step ``step``."""
        for key in [k for k in self._tracks if k[0] == job and k[1] != attempt]:
            del self._tracks[key]  # a new attempt is measured afresh
        if step is None:
            return []
        tracks = self._tracks.setdefault((job, attempt), {})
        changes = []
        for node, score in node_scores.items():
            track = tracks.setdefault(node, _Track())
            measured = score.reported_step if score.reported_step is not None else step
            if measured == track.seen_at:
                continue  # no new report of this node since the last pass
            track.seen_at = measured
            # Enter once the evidence (a CUSUM of the shortfall) is enough; leave only while continuously above
            # the threshold plus the margin.
            low = score.score < threshold
            high = score.score >= min(0.99, threshold + RECOVER_MARGIN)
            track.evidence = max(0.0, track.evidence + threshold - score.score)
            track.low_since, track.low_reports = (track.low_since if track.low_since is not None else step,
                                                  track.low_reports + 1) if track.evidence > 0 else (None, 0)
            track.high_since, track.high_reports = (track.high_since if track.high_since is not None else step,
                                                    track.high_reports + 1) if high else (None, 0)
            if (low and not track.flagged and step - (track.low_since or step) >= CONFIRM_STEPS and track.low_reports >= CONFIRM_REPORTS
                    and track.evidence >= EVIDENCE):
                track.flagged = True
                changes.append(Change(node, True, score))
            elif high and track.flagged and step - (track.high_since or step) >= CONFIRM_STEPS and track.high_reports >= CONFIRM_REPORTS:
                track.flagged = False
                changes.append(Change(node, False, score))
        return changes

    def stragglers(self, job: str, attempt: int) -> list[str]:
        return sorted(node for node, track in self._tracks.get((job, attempt), {}).items() if track.flagged)

    def shadowed(self, job: str, attempt: int, node: str) -> bool:
        """True the first time ``replace`` would have acted on this straggler (its shadow Event is written once)."""
        track = self._tracks.get((job, attempt), {}).get(node)
        if track is None or track.shadowed:
            return False
        track.shadowed = True
        return True

    def forget(self, job: str) -> None:
        for key in [k for k in self._tracks if k[0] == job]:
            del self._tracks[key]


def describe(score: NodeScore) -> str:
    section = f", slowest section '{score.section}' at {score.section_score:g}" if score.section else ""
    return f"rank {score.rank} scores {score.score:g}{section}"


def worth_replacing(score: float, running_s: float, restart_cost_s: float) -> bool:
    """Replace when the time the straggler will cost over the job's remaining run exceeds a restart's cost.

    The job runs at ``score`` of its healthy speed, so it loses ``1 - score`` of every second. Its
    remaining time is unknown; the time it has run so far is the estimate (a job is as likely to be
    in the first half of its life as the second)."""
    return running_s * (1.0 - score) > restart_cost_s
