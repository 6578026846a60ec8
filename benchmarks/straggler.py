"""Stragglers: how fast a slowed node is named, how often a healthy one is, and what acting on it buys.

The same 2-node x 1-rank MLP job (``--compute-matmuls``: fixed CPU work per
step in a ``compute`` section) runs healthy for ``HEALTHY_S``; then one of its
nodes is slowed by a factor (1.5x, 2x, 3x: its processes are stopped for
``1 - 1/factor`` of every 50 ms, ``unbroken chaos slow-node``) and stays slow.
Side by side in one run:

* ``unbroken (replace)``: ``straggler_policy: replace`` on a 3-node cluster
  (one node spare): the straggler is taken out and the job moves to the spare;
* ``unbroken (report)``: ``straggler_policy: report``: the Event, nothing else;
* ``torchrun``: two plain torchrun agents, the same job and the same slowdown;
  nothing detects anything.

Measured: steps and seconds from the slowdown to the ``StragglerDetected``
Event, and throughput (steps/s, rank 0's step log) while healthy, during the
first ``WINDOW_S`` after the slowdown, and in the window ``AFTER_S`` later
(``throughput_ratio_after``: that over healthy). A healthy run of
``--healthy-minutes`` beside a process that keeps a core busy counts false
``StragglerDetected`` Events (``false_positives``).

    .venv/bin/python benchmarks/straggler.py [--json] [--quick] [--factors 1.5,2,3] [--healthy-minutes 20]

``--quick``: the 1.5x case and a 5-minute healthy run only. ``--trace FILE``: every
new score of every node of the unbroken runs as JSON lines (``run``, ``ts``, ``attempt``, ``node``, ``score``, ``reported_step``), to replay a detection rule against
(``tests/unit/test_straggler_traces.py`` replays recorded ones).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from unbroken.controller import jobs, stragglers
from unbroken.plumbing import procs
from unbroken.runtime import fault_injection
from unbroken.config.cluster import ClusterConfig
from unbroken.config.job import JobSpec
from unbroken.plumbing.layout import ClusterLayout
from unbroken.runtime import Runtime, local_cluster
from unbroken.plumbing.waiting import WaitTimeout, wait_until

COMPUTE_S = 0.075
"""CPU work a step, alone on a core: about 100 ms steps with the job's other sections and its all-reduce on this
2-core machine, a short training step. Detection is counted in steps and comes with the agents' reports (about a
second apart), so the step's length sets the figure: the benchmark calibrates the work to it (``calibrate``) where it
once fixed 150 matmuls, which gave ~100 ms steps here on 2026-11-26 and 57 ms on 2026-11-28."""
HEALTHY_S = 60.0
"""Healthy running before the slowdown: the throughput reference, and the job's age when replace weighs it."""
WINDOW_S = 20.0
AFTER_S = 60.0
"""The "after" window starts this long after the slowdown (the goal: >= 95 % of healthy within 60 s)."""
WARMUP_STEPS = 20


@dataclass
class Result:
    system: str
    factor: float
    detect_steps: int | None
    detect_s: float | None
    false_positives: int | None
    throughput_ratio_after: float | None
    healthy_steps_per_s: float | None = None
    during_steps_per_s: float | None = None
    after_steps_per_s: float | None = None
    note: str = ""


def calibrate(seconds: float = COMPUTE_S) -> int:
    """The 256x256 matmuls (``--compute-matmuls``) one core does in ``seconds``, timed here on one thread."""
    import torch

    from unbroken.workloads.mlp import simulated_compute

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workload runs
    try:
        simulated_compute(20)  # warm
        best = min(_timed(lambda: simulated_compute(100)) for _ in range(5))
    finally:
        torch.set_num_threads(threads)
    return max(10, round(seconds / (best / 100)))


def _timed(work: Callable[[], None]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def workload(progress_log: Path, matmuls: int) -> list[str]:
    return ["-m", "unbroken.workloads.mlp", "--steps", "1000000", "--checkpoint-every", "100", "--step-time", "0",
            "--compute-matmuls", str(matmuls), "--progress-log", str(progress_log)]


def steps_log(path: Path) -> list[tuple[float, int]]:
    """(time, step) of rank 0's steps, across attempts (a resumed attempt repeats steps: the latest wins)."""
    out: list[tuple[float, int]] = []
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) >= 2:
            out.append((float(parts[1]), int(parts[0])))
    return out


def rate(log: list[tuple[float, int]], start: float, end: float) -> float | None:
    """Steps of new progress per second in [start, end): the newest step reached by ``end`` minus the newest by ``start``."""
    before = [s for t, s in log if t < start]
    within = [s for t, s in log if t < end]
    if not before or not within or end <= start:
        return None
    return round((max(within) - max(before)) / (end - start), 3)


def step_at(log: list[tuple[float, int]], at: float) -> int | None:
    steps = [s for t, s in log if t <= at]
    return max(steps) if steps else None


def wait(predicate: Callable[[], object], timeout: float) -> object | None:
    try:
        return wait_until(predicate, timeout, "the scenario's next stage", interval=0.2)
    except WaitTimeout:
        return None


def measure(system: str, factor: float, log_path: Path, slow: Callable[[], float], detected: Callable[[], float | None]) -> Result:
    """The common timeline: warm up, run healthy, slow, watch; ``slow()`` returns when the slowdown began."""
    if wait(lambda: len(steps_log(log_path)) >= WARMUP_STEPS, 180) is None:
        return Result(system, factor, None, None, None, None, note="the job never started stepping")
    healthy_from = time.time()
    time.sleep(HEALTHY_S)  # the scenario's healthy phase (a benchmark's timeline, not a synchronisation)
    slowed_at = slow()
    end = slowed_at + AFTER_S + WINDOW_S
    detect_at = None
    while time.time() < end:
        detect_at = detect_at or detected()
        time.sleep(0.5)
    log = steps_log(log_path)
    healthy = rate(log, healthy_from, slowed_at)
    during = rate(log, slowed_at, slowed_at + WINDOW_S)
    after = rate(log, slowed_at + AFTER_S, end)
    detect_steps = None
    if detect_at is not None and (a := step_at(log, detect_at)) is not None and (b := step_at(log, slowed_at)) is not None:
        detect_steps = a - b
    return Result(system, factor, detect_steps, None if detect_at is None else round(detect_at - slowed_at, 2), None,
                  None if healthy is None or after is None else round(after / healthy, 3), healthy, during, after,
                  note="" if detect_at is not None or system == "torchrun" else "never detected")


# -- unbroken ------------------------------------------------------------------------------


class ScoreTrace:
    """Samples the scores the controller computes (``stragglers.scores`` of the attempt's workers) every
    0.1 s and appends each node's new one to a JSON-lines file, with rank 0's step then (``step``: what the
    benchmark counts detection in); ``slowed`` marks the slowdown."""

    def __init__(self, path: Path | None, run: str, runtime: Runtime, log_path: Path) -> None:
        self.path, self.run, self.runtime, self.log_path = path, run, runtime, log_path
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        if path is not None:
            self._thread.start()

    def _write(self, record: dict[str, object]) -> None:
        assert self.path is not None
        with self.path.open("a") as out:
            out.write(json.dumps({"run": self.run, **record}) + "\n")

    def _sample(self) -> None:
        seen: dict[tuple[int, str], int | None] = {}
        while not self._done.wait(0.1):
            job = self.runtime.cluster.get_job("bench")
            if job is None:
                continue
            for node, score in stragglers.scores(self.runtime.backend.observe_attempt("bench", job.attempt)).items():
                if (job.attempt, node) in seen and seen[(job.attempt, node)] == score.reported_step:
                    continue
                seen[(job.attempt, node)] = score.reported_step
                now = time.time()
                self._write({"ts": now, "attempt": job.attempt, "node": node, "score": score.score,
                             "reported_step": score.reported_step, "step": step_at(steps_log(self.log_path), now)})

    def slowed(self, node: str, at: float, step: int | None) -> None:
        if self.path is not None:
            self._write({"slowed": node, "ts": at, "step": step})

    def close(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()


def event_time(runtime: Runtime, reason: str) -> float | None:
    return next((e.ts for e in runtime.cluster.list_events(object_kind="Job", object_name="bench") if e.reason == reason), None)


def start_unbroken(root: Path, name: str, policy: str, nodes: int, matmuls: int) -> tuple[Runtime, ClusterLayout, Path]:
    layout = ClusterLayout.at(Path(tempfile.mkdtemp(prefix=f"straggler-{name}-", dir=root)))
    runtime, _ = local_cluster.up(layout, ClusterConfig.with_nodes(nodes, name="bench"))
    local_cluster.wait_ready(runtime, 120)
    log_path = layout.root / "steps.log"
    spec = JobSpec.model_validate({
        "name": "bench", "nodes": 2, "procs_per_node": 1, "command": workload(log_path, matmuls),
        "resilience": {"auto_resume": True, "max_retry": 3, "straggler_policy": policy},
        "checkpoint": {"memory": {"keep": 2, "replicas": 1}},
    })
    jobs.submit(runtime.cluster, spec, note="benchmarks/straggler.py")
    return runtime, layout, log_path


def run_unbroken(root: Path, policy: str, factor: float, matmuls: int, trace_path: Path | None) -> Result:
    system = f"unbroken ({policy})"
    runtime, layout, log_path = start_unbroken(root, f"{policy}-{factor:g}", policy, 3, matmuls)
    trace = ScoreTrace(trace_path, f"{policy} x{factor:g}", runtime, log_path)
    try:
        def slow() -> float:
            victim = next(w.node for w in runtime.backend.observe_attempt("bench", 0) if w.node_rank == 1)
            fault_injection.slow_node(runtime, victim, factor)
            at = time.time()
            trace.slowed(victim, at, step_at(steps_log(log_path), at))
            return at

        result = measure(system, factor, log_path, slow, lambda: event_time(runtime, "StragglerDetected"))
        found = next((e.message for e in runtime.cluster.list_events(object_kind="Job", object_name="bench")
                      if e.reason == "StragglerDetected"), None)
        if found is not None:
            result.note = found.split(" is a straggler: ")[-1].split(" against ")[0]  # the score it was named with
        replaced = event_time(runtime, "StragglerReplaced")
        if replaced is not None:
            result.note = (result.note + f" replaced; attempt {runtime.cluster.get_job('bench').attempt}").strip()
        return result
    finally:
        trace.close()
        for node in ("node-1", "node-2", "node-3"):
            fault_injection.stop_slowing(runtime, node, quiet=True)
        local_cluster.down(layout)


def run_healthy(root: Path, minutes: float, matmuls: int, trace_path: Path | None) -> Result:
    """The healthy job beside a process that keeps a core busy: every StragglerDetected is false."""
    runtime, layout, log_path = start_unbroken(root, "healthy", "report", 2, matmuls)
    trace = ScoreTrace(trace_path, "healthy", runtime, log_path)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        wait(lambda: len(steps_log(log_path)) >= WARMUP_STEPS, 180)
        started = time.time()
        time.sleep(minutes * 60)  # the run's length: a benchmark's timeline, not a synchronisation
        false = [e for e in runtime.cluster.list_events(object_kind="Job", object_name="bench") if e.reason == "StragglerDetected"]
        log = steps_log(log_path)
        return Result("unbroken (report)", 1.0, None, None, len(false), None, rate(log, started, time.time()),
                      note=f"{minutes:g} min healthy beside a CPU hog; " + ("; ".join(e.message for e in false[:3]) or "no Event"))
    finally:
        trace.close()
        hog.kill()
        hog.wait()
        local_cluster.down(layout)


# -- plain torchrun --------------------------------------------------------------------------


def run_torchrun(root: Path, factor: float, matmuls: int) -> Result:
    work = Path(tempfile.mkdtemp(prefix=f"straggler-torchrun-{factor:g}-", dir=root))
    log_path = work / "steps.log"
    port = _free_port()
    groups = []
    for node_rank in range(2):
        env = {**os.environ, "UNBROKEN_CHECKPOINT_DIR": str(work / "ckpt"), "UNBROKEN_NODE": f"tr-node-{node_rank}"}
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "straggler",
                "--rdzv-conf", f"is_host={1 if node_rank == 0 else 0}", *workload(log_path, matmuls)]
        with open(work / f"node{node_rank}.log", "wb") as out:
            groups.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True))
    done = threading.Event()
    slower: threading.Thread | None = None
    try:
        def slow() -> float:
            nonlocal slower
            began = threading.Event()
            slower = threading.Thread(target=procs.duty_cycle, args=(lambda: [p.pid for p in procs.tree(groups[1].pid)], factor,
                                                                     fault_injection.SLOW_PERIOD_S, done), kwargs={"started": began.set})
            slower.start()
            began.wait(10)
            return time.time()

        return measure("torchrun", factor, log_path, slow, lambda: None)
    finally:
        done.set()
        if slower is not None:
            slower.join()
        for group in groups:
            procs.kill_now(procs.tree(group.pid))
        for group in groups:
            group.wait()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help='print {"results": [...]} instead of the table')
    parser.add_argument("--quick", action="store_true", help="the 1.5x case and a 5-minute healthy run only")
    parser.add_argument("--factors", default="1.5,2,3", help="slowdowns to inject")
    parser.add_argument("--healthy-minutes", type=float, default=20.0, help="length of the false-positive run (0: skip it)")
    parser.add_argument("--compute-matmuls", type=int, default=0,
                        help="the workload's matmuls a step (default: calibrated to ~75 ms of one core's work)")
    parser.add_argument("--trace", type=Path, help="append every node score of the unbroken runs to this JSON-lines file")
    parser.add_argument("--systems", default="replace,report,torchrun", help="which of replace, report, torchrun to run")
    args = parser.parse_args()
    factors = [1.5] if args.quick else [float(f) for f in args.factors.split(",")]
    minutes = 5.0 if args.quick else args.healthy_minutes
    systems = args.systems.split(",")
    matmuls = args.compute_matmuls or calibrate()
    print(f"# {matmuls} matmuls a step (~{COMPUTE_S * 1000:.0f} ms of one core's work)", file=sys.stderr, flush=True)
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="unbroken-straggler-") as tmp:
        root = Path(tmp)
        for factor in factors:
            for system in systems:
                result = run_torchrun(root, factor, matmuls) if system == "torchrun" else run_unbroken(root, system, factor, matmuls, args.trace)
                results.append(result)
                print(f"# {result.system:<18} x{factor:g}: detect {result.detect_steps} steps / {result.detect_s} s, "
                      f"after/healthy {result.throughput_ratio_after} {result.note}", file=sys.stderr, flush=True)
        if minutes > 0:
            results.append(run_healthy(root, minutes, matmuls, args.trace))
            print(f"# healthy: {results[-1].false_positives} false positives", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"matmuls": matmuls, "healthy_s": HEALTHY_S, "after_s": AFTER_S, "window_s": WINDOW_S,
                          "results": [asdict(r) for r in results]}))
        return 0
    fmt = lambda v: "-" if v is None else str(v)  # noqa: E731
    print("| system | slowdown | detect (steps) | detect (s) | false positives | healthy (steps/s) | first 20 s (steps/s) | "
          "60-80 s after (steps/s) | after / healthy | note |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r.system} | {'none' if r.factor == 1.0 else f'x{r.factor:g}'} | {fmt(r.detect_steps)} | {fmt(r.detect_s)} | "
              f"{fmt(r.false_positives)} | {fmt(r.healthy_steps_per_s)} | {fmt(r.during_steps_per_s)} | {fmt(r.after_steps_per_s)} | "
              f"{fmt(r.throughput_ratio_after)} | {r.note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
