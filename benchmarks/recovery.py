"""Recovery time per fault kind: unbroken vs plain torchrun, side by side in one run.

For each fault (a rank SIGKILLed, a rank SIGSTOPped, a whole node powered off)
the same 2-node x 2-rank MLP job runs, the fault is injected once the job is
past a checkpoint, and we measure:

* detect:   fault -> the failure is known (unbroken: JobRestarting event;
            torchrun: not observable, left blank)
* recover:  fault -> first training step after the resume
* lost:     steps recomputed (last step before the fault - step resumed from)

* restore:  the slowest rank's ``ctx.checkpoint.restore()`` (part of startup)

unbroken runs once per checkpointer (``--checkpoints file,tiered``): the
foundation's file checkpointer (one torch.save file per rank, fsynced) and the
tiered one (shared memory, one replica, no persistent tier here). A ``+warm``
suffix (``file+warm``) runs the job with ``resilience.warm_spares: 1`` and
injects the fault once every node of the job (and the idle third node) holds a
ready spare: the restart then skips importing torch in torchrun and every rank.
A ``+inproc`` suffix (``file+warm+inproc``) adds ``resilience.in_process_restart``:
the ranks on the node that did not fail stay in their processes and rejoin.
``--repeat N`` runs every scenario N times and adds p50/p95 rows. ``--state-mb``
adds that much per-rank state to every checkpoint so that save and restore
cost something (the MLP itself is ~0.3 MB per rank).

Plain torchrun is the competitor: two torchrun agents (c10d rendezvous,
``--max-restarts 1``) on the same machine; it restarts its rank processes in
place after a crash, has no hang detection, and cannot replace a lost node.

    .venv/bin/python benchmarks/recovery.py [--json] [--state-mb 256] [--checkpoints file,tiered]

``--backend kubernetes`` runs the same faults on a PyTorchJob on the real control plane with the process
kubelet, training-operator alone beside unbroken (benchmarks/recovery_kubernetes.py says what each does):

    .venv/bin/python benchmarks/recovery.py --backend kubernetes [--systems training-operator,unbroken] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from harness import RESUMED, free_port, poll, quantiles, rank_pid
from unbroken.controller import jobs, report
from unbroken.plumbing import procs
from unbroken.runtime import fault_injection
from unbroken.supervision.warm_spare import READY_MARK
from unbroken.runtime import local_cluster
from unbroken.config.cluster import ClusterConfig
from unbroken.config.job import JobSpec
from unbroken.plumbing.layout import ClusterLayout

STEPS = 100_000  # never reached: each scenario ends at the first step after resume
CHECKPOINT_EVERY = 20
STEP_TIME = 0.05
FAULT_AT_STEP = 65
HANG_TIMEOUT = 5.0
HANG_TIMEOUT_SET: float | None = HANG_TIMEOUT  # --hang-timeout auto: None (unbroken sets it from the job's step times)
GIVE_UP_AFTER = 60.0


@dataclass
class Result:
    system: str
    fault: str
    detect_s: float | None
    recover_s: float | None
    steps_lost: int | None
    note: str = ""
    reschedule_s: float | None = None
    """detection -> next attempt placed (old workers stopped, nodes chosen)"""
    startup_s: float | None = None
    """placed -> first step: torchrun + ranks start, rendezvous, restore"""
    restore_s: float | None = None
    """the slowest rank's restore() in the resumed attempt"""


STATE_MB = 0.0  # set from --state-mb


def workload_args() -> list[str]:
    return ["-m", "unbroken.workloads.mlp", "--steps", str(STEPS), "--checkpoint-every", str(CHECKPOINT_EVERY),
            "--step-time", str(STEP_TIME), "--state-mb", str(STATE_MB)]


def slowest_restore(log_dirs: list[Path]) -> float | None:
    """The longest ``restore()`` any rank of the resumed attempt reported in its stdout."""
    times = [float(m.group(1)) for d in log_dirs for f in d.rglob("stdout.log") for m in RESUMED.finditer(_read(f))]
    return round(max(times), 3) if times else None


# -- unbroken -------------------------------------------------------------------------


def run_unbroken(fault: str, root: Path, variant: str) -> Result:
    system = f"unbroken ({variant})"
    checkpoint, *extras = variant.split("+")
    warm, in_process = "warm" in extras, "inproc" in extras
    layout = ClusterLayout.at(Path(tempfile.mkdtemp(prefix=f"unbroken-{fault}-{checkpoint}-", dir=root)))
    runtime, _ = local_cluster.up(layout, ClusterConfig.with_nodes(3, name="bench"))
    store, backend = runtime.cluster, runtime.backend
    try:
        local_cluster.wait_ready(runtime, 120)
        spec = JobSpec.model_validate({
            "name": "bench", "nodes": 2, "procs_per_node": 2, "command": workload_args(),
            "resilience": {"auto_resume": True, "max_retry": 3, "hang_timeout": HANG_TIMEOUT_SET, "warm_spares": 1 if warm else 0,
                           "in_process_restart": in_process},
            "checkpoint": {"memory": {"keep": 2, "replicas": 1}} if checkpoint == "tiered" else {},
        })
        jobs.submit(store, spec, note="benchmarks/recovery.py")

        def step() -> int:
            return jobs.current_step(backend.observe_attempt("bench", 0))

        if not poll(lambda: step() >= FAULT_AT_STEP, 180):
            return Result(system, fault, None, None, None, "job never reached the fault step")
        if warm and not poll(lambda: _spares_ready(layout), 120):
            return Result(system, fault, None, None, None, "the warm spares never became ready")
        if fault == "kill-node":
            victim = next(w.node for w in backend.observe_attempt("bench", 0) if w.node_rank == 1)
            fault_injection.kill_node(runtime, victim)
        else:
            target = fault_injection.pick_rank(runtime, "bench", rank=3)
            sig = signal.SIGKILL if fault == "kill-worker" else signal.SIGSTOP
            fault_injection.signal_rank(runtime, target, sig, "ChaosKillWorker" if fault == "kill-worker" else "ChaosHangWorker")

        def resumed():
            job = store.get_job("bench")
            workers = backend.observe_attempt("bench", 1)
            return job.attempt >= 1 and any(w.first_progress_at for w in workers)

        if not poll(resumed, GIVE_UP_AFTER):
            return Result(system, fault, None, None, None, f"no resume within {GIVE_UP_AFTER:g} s")
        # The summary reads where attempt 1 resumed from, which its workers report with their
        # progress: only once the controller has said JobResumed is it surely in the store.
        if not poll(lambda: any(e.reason == "JobResumed" for e in store.list_events(object_kind="Job", object_name="bench")), 30):
            return Result(system, fault, None, None, None, "no JobResumed event within 30 s")
        job = store.get_job("bench")
        summary = report.summarize(job, backend.worker_history("bench"), store.list_events(object_kind="Job", object_name="bench"))
        note = f"resumed on {','.join(summary.attempts[1].nodes)}"
        if not summary.recoveries:
            return Result(system, fault, None, None, summary.steps_lost, note + "; timeline incomplete")
        r = summary.recoveries[0]
        restore = slowest_restore([Path(w.log_dir) for w in backend.observe_attempt("bench", 1) if w.log_dir])
        return Result(system, fault, round(r.detected_at - r.fault_at, 2), round(r.total_s, 2), summary.steps_lost, note,
                      round(r.scheduled_at - r.detected_at, 2), round(r.first_step_at - r.scheduled_at, 2), restore)
    finally:
        local_cluster.down(layout)


# -- plain torchrun -------------------------------------------------------------------


def run_torchrun(fault: str, root: Path) -> Result:
    work = root / f"torchrun-{fault}"
    work.mkdir(parents=True)
    port = free_port()
    groups = []
    for node_rank in range(2):
        log = open(work / f"node{node_rank}.log", "wb")
        env = {**os.environ, "UNBROKEN_CHECKPOINT_DIR": str(work / "ckpt"), "PYTHONUNBUFFERED": "1",
               "UNBROKEN_NODE": f"tr-node-{node_rank}"}
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"bench-{fault}",
                "--rdzv-conf", f"is_host={1 if node_rank == 0 else 0}", "--max-restarts", "1",
                "--monitor-interval", "0.2", "--tee", "3", *workload_args()]
        groups.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
    try:
        def past_fault_step() -> bool:
            steps = [int(p.parent.name.removeprefix("step-")) for p in (work / "ckpt").glob("step-*/manifest.json")]
            return max(steps, default=0) >= FAULT_AT_STEP - FAULT_AT_STEP % CHECKPOINT_EVERY

        if not poll(past_fault_step, 180):
            return Result("torchrun", fault, None, None, None, "never reached the fault step")
        faulted_at = time.time()
        if fault == "kill-node":
            procs.kill_now(procs.tree(groups[1].pid))
        else:
            rank3 = rank_pid(groups[1].pid, local_rank=1)
            os.kill(rank3, signal.SIGKILL if fault == "kill-worker" else signal.SIGSTOP)
        first = poll(lambda: _first_step_after(work, faulted_at), GIVE_UP_AFTER)
        if first is None:
            codes = [g.poll() for g in groups]
            why = {"hang-worker": "no hang detection: the job stays stuck",
                   "kill-node": "no spare node to resume on: the job fails"}.get(
                       fault, "in-place restart (--max-restarts 1) did not reach a step")
            return Result("torchrun", fault, None, None, None, f"{why}; torchrun exit codes {codes}")
        step_resumed, at = first
        # torchrun reports no progress, so the step reached at the fault is unknown: no "lost" figure.
        return Result("torchrun", fault, None, round(at - faulted_at, 2), None,
                      f"restarted in place on the same nodes from step {step_resumed - 1}")
    finally:
        for group in groups:
            procs.kill_now(procs.tree(group.pid))
        for group in groups:
            group.wait()


def _spares_ready(layout: ClusterLayout) -> bool:
    return all(READY_MARK in _read(layout.node_dir(node) / "spares-bench.log") for node in ("node-1", "node-2", "node-3"))


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _first_step_after(work: Path, since: float):
    for log in work.glob("node*.log"):
        for match in re.finditer(r"first step (\d+) at ([\d.]+)", _read(log)):
            if float(match.group(2)) > since:
                return int(match.group(1)), float(match.group(2))
    return None


def main() -> int:
    global STATE_MB, CHECKPOINT_EVERY, HANG_TIMEOUT_SET
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--faults", default="kill-worker,hang-worker,kill-node")
    parser.add_argument("--checkpoints", default="file,tiered",
                        help="unbroken's variants to compare: a checkpointer (file, tiered), +warm for warm spares, "
                             "+inproc for in-process restarts")
    parser.add_argument("--repeat", type=int, default=1, help="runs of every scenario; more than one adds p50/p95 rows")
    parser.add_argument("--state-mb", type=float, default=0.0, help="extra per-rank checkpoint state (MB)")
    parser.add_argument("--checkpoint-every", type=int, default=CHECKPOINT_EVERY,
                        help="steps between the workload's saves (1: every step, to the memory tier with 'tiered')")
    parser.add_argument("--no-torchrun", action="store_true", help="skip the plain torchrun runs")
    parser.add_argument("--hang-timeout", default=str(HANG_TIMEOUT),
                        help="the unbroken job's hang_timeout in seconds, or 'auto': none set (from its step times)")
    parser.add_argument("--backend", choices=("local", "kubernetes"), default="local",
                        help="kubernetes: a PyTorchJob on the real control plane with the process kubelet, "
                             "training-operator alone beside unbroken (benchmarks/recovery_kubernetes.py)")
    parser.add_argument("--systems", default="training-operator,unbroken", help="--backend kubernetes: which systems")
    args = parser.parse_args()
    if args.backend == "kubernetes":
        return kubernetes_main(args)
    HANG_TIMEOUT_SET = None if args.hang_timeout == "auto" else float(args.hang_timeout)
    STATE_MB, CHECKPOINT_EVERY = args.state_mb, args.checkpoint_every
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-") as tmp:
        for fault in args.faults.split(","):
            runs = [lambda f, r, c=c: run_unbroken(f, r, c) for c in args.checkpoints.split(",")]
            if not args.no_torchrun:
                runs.append(run_torchrun)
            for _ in range(args.repeat):
                for runner in runs:
                    result = runner(fault, Path(tmp))
                    results.append(result)
                    print(f"# {result.system:<18} {fault:<12} recover {result.recover_s} s  {result.note}", file=sys.stderr, flush=True)
    return report_results(args, results, {"step_time_s": STEP_TIME, "hang_timeout_s": HANG_TIMEOUT_SET, "state_mb": STATE_MB})


def report_results(args: argparse.Namespace, results: list[Result], header: dict) -> int:
    """The table (and p50/p95 rows with ``--repeat``), or with ``--json`` one object: ``header`` and the results."""
    if args.json:
        print(json.dumps({**header, "results": [asdict(r) for r in results]}))
        return 0
    fmt = lambda v: "-" if v is None else str(v)  # noqa: E731
    print("| fault | system | fault -> first step after resume (s) | detect (s) | reschedule (s) | startup (s) | restore (s) | steps lost | note |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r.fault} | {r.system} | {fmt(r.recover_s)} | {fmt(r.detect_s)} | {fmt(r.reschedule_s)} | "
              f"{fmt(r.startup_s)} | {fmt(r.restore_s)} | {fmt(r.steps_lost)} | {r.note} |")
    if args.repeat > 1:
        print()
        print("| fault | system | runs | recover p50 (s) | recover p95 (s) | startup p50 (s) | steps lost p50 |")
        print("|---|---|---|---|---|---|---|")
        for key in dict.fromkeys((r.fault, r.system) for r in results):
            rows = [r for r in results if (r.fault, r.system) == key and r.recover_s is not None]
            recover_p50, recover_p95 = quantiles([r.recover_s for r in rows])
            print(f"| {key[0]} | {key[1]} | {len(rows)} | {fmt(recover_p50)} | {fmt(recover_p95)} | "
                  f"{fmt(quantiles([r.startup_s for r in rows])[0])} | {fmt(quantiles([r.steps_lost for r in rows])[0])} |")
    return 0


def kubernetes_main(args: argparse.Namespace) -> int:
    """``--backend kubernetes``: every system, fault and repeat on a control plane of its own; the same output."""
    import recovery_kubernetes  # beside this script; brings up the tests' control plane harness

    faults = args.faults.split(",")
    systems = args.systems.split(",")
    unknown = [s for s in systems if s not in recovery_kubernetes.SYSTEMS] + [f for f in faults if f not in recovery_kubernetes.FAULTS]
    if unknown:
        print(f"recovery.py: unknown {', '.join(unknown)}: systems are {', '.join(recovery_kubernetes.SYSTEMS)}, "
              f"faults {', '.join(recovery_kubernetes.FAULTS)}", file=sys.stderr)
        return 2
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-k8s-") as tmp:
        for fault in faults:
            for i in range(args.repeat):
                for system in systems:
                    result = Result(**recovery_kubernetes.run(system, fault, Path(tmp) / f"{system}-{fault}-{i}"))
                    results.append(result)
                    print(f"# {result.system:<18} {fault:<12} recover {result.recover_s} s  {result.note}", file=sys.stderr, flush=True)
    return report_results(args, results, {"backend": "kubernetes", "step_time_s": recovery_kubernetes.STEP_TIME})


if __name__ == "__main__":
    sys.exit(main())
