"""What the benchmarks share: finding a rank's process, a free port, polling a stage with a timeout,
quantiles, and the goodput model (a fault schedule's faults, rank 0's step timeline, and the goodput,
badput and recovery read from it). Every benchmark script imports from here, never from another
script, so no two scripts import each other."""

from __future__ import annotations

import re
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unbroken.plumbing import procs
from unbroken.plumbing.waiting import WaitTimeout, wait_until

FAULT_KINDS = ("kill-worker", "hang-worker", "kill-node", "xid79")
"""The faults a goodput run injects, in turn."""

RESUMED = re.compile(r"resumed at step \d+ from .* in ([0-9.]+) s")


def poll(predicate, timeout: float, interval: float = 0.05):
    """The predicate's value once it holds, None if it never did (the row says what happened)."""
    try:
        return wait_until(predicate, timeout, "the scenario's next stage", interval=interval)
    except WaitTimeout:
        return None


def rank_pid(torchrun_pid: int, local_rank: int) -> int:
    def find():
        for proc in procs.tree(torchrun_pid)[1:]:
            try:
                if proc.environ().get("LOCAL_RANK") == str(local_rank):
                    return proc.pid
            except Exception:  # noqa: BLE001 - racing process exits
                continue
        return None
    pid = poll(find, 30)
    if pid is None:
        raise RuntimeError("rank process not found")
    return pid


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def quantiles(values: list) -> tuple[float | None, float | None]:
    """p50 (the median) and p95 (nearest rank) of what was measured; None where nothing was."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None, None
    return round(statistics.median(values), 2), round(values[min(len(values) - 1, int(0.95 * len(values)))], 2)


@dataclass(frozen=True)
class Fault:
    at: float
    """Seconds after the start."""
    kind: str


# -- reading a step timeline -----------------------------------------------------------


@dataclass
class Outcome:
    system: str
    goodput: float
    badput: dict[str, float]
    faults: list[dict[str, Any]] = field(default_factory=list)

    def recovery_quantiles(self) -> tuple[float | None, float | None]:
        return quantiles([f["recover_s"] for f in self.faults])

    def to_dict(self) -> dict[str, Any]:
        p50, p95 = self.recovery_quantiles()
        per_kind = {kind: [f["recover_s"] for f in self.faults if f["kind"] == kind] for kind in FAULT_KINDS}
        return {"system": self.system, "goodput": round(self.goodput, 4), "badput": {k: round(v, 1) for k, v in self.badput.items()},
                "faults": len(self.faults), "recover_p50_s": p50, "recover_p95_s": p95, "fault_log": self.faults,
                "recover_by_kind": {k: [None if v is None else round(v, 2) for v in vs] for k, vs in per_kind.items() if vs}}


Step = tuple[int, float, int, int]
"""A line of rank 0's timeline: step, unix time, pid, attempt (0 where the launcher has no attempts)."""


def analyse(system: str, timeline: list[Step], started: float, ended: float,
            injected: list[tuple[float, str, str | None]], *, default_step_s: float = 0.05) -> Outcome:
    """Goodput, badput and per-fault recovery from rank 0's (step, time, pid) lines."""
    wall = ended - started
    intervals = [b[1] - a[1] for a, b in zip(timeline, timeline[1:], strict=False) if b[2] == a[2] and b[0] == a[0] + 1]
    step_s = statistics.median(intervals) if intervals else default_step_s
    final_step = timeline[-1][0] if timeline else 0
    badput = {"startup": (timeline[0][1] - started) if timeline else wall, "recovery": 0.0, "lost_steps": 0.0,
              "hang_wait": 0.0, "down": 0.0}
    faults = []
    for index, (at, kind, error) in enumerate(injected):
        if error is not None:  # nothing to hit (the job was down already): no recovery to measure
            faults.append({"kind": kind, "at_s": round(at - started, 1), "recover_s": None, "lost_steps": None, "note": error})
            continue
        before = [t for t in timeline if t[1] <= at]
        until = next((later for later, _, failed in injected[index + 1 :] if failed is None), ended)
        pid = before[-1][2] if before else None
        after = _first_resumed_step(timeline, at, step_s)
        if after is not None and after[1] <= until:
            lost = max(0, (before[-1][0] if before else 0) - (after[0] - 1))
            badput["recovery"] += after[1] - at
            badput["lost_steps"] += lost * step_s
            faults.append({"kind": kind, "at_s": round(at - started, 1), "recover_s": round(after[1] - at, 2), "lost_steps": lost})
            continue
        # not recovered before the next fault (or the end): stuck if a hang, else not running
        progressed = [t for t in timeline if at < t[1] <= until and t[2] == pid]
        stuck_from = progressed[-1][1] if progressed else at
        badput["hang_wait" if kind == "hang-worker" else "down"] += until - stuck_from
        faults.append({"kind": kind, "at_s": round(at - started, 1), "recover_s": None, "lost_steps": None})
    return Outcome(system, min(1.0, final_step * step_s / wall), badput, faults)


def _first_resumed_step(timeline: list[Step], at: float, step_s: float) -> Step | None:
    """The first step after ``at`` that does not continue the one before it: a new rank-0 process, a new
    attempt (an in-process restart keeps rank 0's process, and may resume at the very next step), a step
    that is not the next one, or one after a pause no step takes (10 step times)."""
    for previous, current in zip(timeline, timeline[1:], strict=False):
        if current[1] <= at:
            continue
        if current[2] != previous[2] or current[3] != previous[3] or current[0] != previous[0] + 1 \
                or current[1] - previous[1] > 10 * step_s:
            return current
    return None


def read_timeline(path: Path) -> list[Step]:
    lines = []
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = line.split()
        if len(parts) == 4:
            lines.append((int(parts[0]), float(parts[1]), int(parts[2]), int(parts[3])))
    return lines


def run_faults(faults: list[Fault], started: float, minutes: float, inject: Callable[[Fault], None], timeline: Path,
               between: Callable[[], None] = lambda: None) -> list[tuple[float, str, str | None]]:
    """Inject each fault at its time after the job's first step, calling ``between`` every 0.2 s (a
    supervisor's pass) until ``minutes`` after ``started``; returns (time, kind, why it could not be injected or None)."""

    def first_step() -> float | None:
        lines = read_timeline(timeline)
        return lines[0][1] if lines else None

    injected = []
    pending = list(faults)
    end = started + minutes * 60
    clock: float | None = None  # the fault clock starts at the job's first step: every system is hit at the same point
    while time.time() < end:
        if clock is None and first_step() is not None:
            clock = time.time()
        if pending and clock is not None and time.time() >= clock + pending[0].at:
            fault = pending.pop(0)
            try:
                inject(fault)
                injected.append((time.time(), fault.kind, None))
            except Exception as exc:  # noqa: BLE001 - a fault that cannot land (no rank running) is reported, not fatal
                injected.append((time.time(), fault.kind, f"not injected: {exc}"))
        between()
        time.sleep(0.2)  # the benchmark's own clock tick, not a wait for a condition
    return injected
