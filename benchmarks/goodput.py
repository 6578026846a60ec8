"""Goodput under a stream of faults: unbroken vs plain torchrun vs torchrun in a retry loop, one run.

The same 2-node x 2-rank job (``unbroken.workloads.mlp``, 50 ms/step, a save every
20 steps) runs for ``--minutes`` under each system. Faults arrive on a seeded schedule
(exponential gaps of mean ``--mtbf-seconds``, counted from the job's first step), kinds
in turn: kill-worker (SIGKILL rank 3), hang-worker (SIGSTOP rank 3), kill-node (every process of rank 3's node), xid79.

The systems:

* **unbroken**: a 3-node local cluster (one spare, automatic node recovery), auto-resume with
  a budget larger than the faults, hang_timeout 10 s (``--hang-timeout auto``: none set, so
  unbroken sets it from the job's own step times; a ``+autohang`` suffix does that for one system,
  so both run side by side). Xid 79 is written to the node's kernel
  log (``chaos xid``): the agent takes the node out and the job moves.
* **unbroken+warm**: the same with ``resilience.warm_spares: 1``: restarts take a torchrun
  (and ranks) that imported torch before the fault.
* **unbroken+warm+inproc**: and ``resilience.in_process_restart``: the ranks on the node that
  did not fail keep their processes and rejoin (rank 0's process then survives a restart, so a
  recovery is also seen as a step that does not follow the one before it).

  Both unbroken systems checkpoint the way a user of unbroken does, through its tiers
  (``--unbroken-checkpoint tiers``, the default): every save into shared memory with a
  replica on a peer node, and every 200th step drained to a ``file://`` persistent tier
  by the agents. ``--unbroken-checkpoint file`` gives them the baselines' fsync'd file
  per save instead, to compare the systems with the checkpoint held equal.
* **torchrun**: two torchrun agents (c10d rendezvous) with ``--max-restarts 3`` and the
  script's own disk checkpoint, as the PyTorch DDP tutorial runs it. A lost node does not
  come back. Xid 79 is a SIGKILL of rank 3 here: on a GPU the rank dies with its device,
  and nothing but a kernel log (which nobody reads) says more.
* **retry-loop**: the same two agents with ``--max-restarts 0``, relaunched together with a new
  rendezvous whenever either exits: what a Kubernetes ``restartPolicy: OnFailure`` gives a
  job. A lost node is relaunched like a rescheduled pod.

Every system's rank 0 writes its step timeline (``--progress-log``), read the same way for all:

* **goodput** = the steps of the final trajectory x the median step time / wall time;
* **recovery** per fault = fault → the first step of a new rank-0 process or attempt (none: unrecovered);
* **badput** by cause:
  - startup: the first launch to the first step;
  - recovery: fault → first step after, for recovered faults;
  - lost_steps: steps recomputed, at the step time;
  - hang_wait / down: stuck in a hang / not running after an unrecovered fault, to the end.

  For unbroken, recovery is split further from its own report: detection, restart
  (placement) and startup.

    .venv/bin/python benchmarks/goodput.py [--minutes 10] [--mtbf-seconds 120] [--seed 1]
        [--unbroken-checkpoint tiers|file] [--hang-timeout 10|auto] [--keep DIR] [--json]
    .venv/bin/python benchmarks/goodput.py --backend kubernetes [--systems k8s:training-operator,k8s:unbroken,k8s:unbroken+launcher,k8s:unbroken+spare-pod]

``--backend kubernetes`` runs a PyTorchJob on the real control plane with the process kubelet
(goodput_kubernetes.py): training-operator alone, unbroken recreating pods, and unbroken with
``unbroken run`` in the pods; the faults kill-worker, hang-worker and kill-node in turn.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # --backend kubernetes: tests/controlplane

from harness import FAULT_KINDS, Fault, Outcome, analyse, free_port, rank_pid, read_timeline, run_faults  # noqa: E402

from unbroken.controller import report  # noqa: E402
from unbroken.controller import jobs
from unbroken.plumbing import procs
from unbroken.runtime import fault_injection
from unbroken.config.cluster import ClusterConfig  # noqa: E402
from unbroken.config.job import JobSpec  # noqa: E402
from unbroken.plumbing.layout import ClusterLayout  # noqa: E402
from unbroken.runtime import local_cluster  # noqa: E402

FAULTS = FAULT_KINDS
KUBERNETES_SYSTEMS = ("k8s:training-operator", "k8s:unbroken", "k8s:unbroken+launcher", "k8s:unbroken+spare-pod")
"""``--backend kubernetes`` (goodput_kubernetes.py, which keeps the same tuple)."""
STEP_TIME = 0.05
CHECKPOINT_EVERY = 20
HANG_TIMEOUT = 10.0
PERSIST_EVERY = 200  # steps: ~10 s of training between copies in the persistent tier
QUIET_TAIL = 10.0  # no fault in the last seconds: each one gets a chance to recover
FIRST_STEP_ALLOWANCE = 10.0  # faults count from the first step, which comes ~7 s after launch


def schedule(minutes: float, mtbf: float, seed: int) -> list[Fault]:
    rng = random.Random(seed)
    faults: list[Fault] = []
    at = 0.0
    while True:
        at += rng.expovariate(1.0 / mtbf)
        if at > minutes * 60 - QUIET_TAIL - FIRST_STEP_ALLOWANCE:
            return faults
        faults.append(Fault(round(at, 2), FAULTS[len(faults) % len(FAULTS)]))


def workload(progress_log: Path) -> list[str]:
    return ["-m", "unbroken.workloads.mlp", "--steps", "10000000", "--checkpoint-every", str(CHECKPOINT_EVERY),
            "--step-time", str(STEP_TIME), "--progress-log", str(progress_log)]


# -- the systems ------------------------------------------------------------------------


def checkpoint_spec(kind: str, root: Path) -> dict[str, Any]:
    """The job file's ``checkpoint:`` section: unbroken's tiers, or one fsync'd file per save like the baselines."""
    if kind == "file":
        return {"dir": str(root / "unbroken-ckpt")}
    return {"memory": {"keep": 2, "replicas": 1},
            "persistent": {"uri": (root / "unbroken-persistent").as_uri(), "every_steps": PERSIST_EVERY}}


def run_unbroken(faults: list[Fault], minutes: float, root: Path, *, warm: bool = False, in_process: bool = False,
                 checkpoint: str = "tiers", hang_timeout: float | None = HANG_TIMEOUT) -> Outcome:
    system = "unbroken" + ("+warm" if warm else "") + ("+inproc" if in_process else "") + ("+autohang" if hang_timeout is None else "")
    root = root / system
    root.mkdir()
    layout = ClusterLayout.at(root / "cluster")
    runtime, _ = local_cluster.up(layout, ClusterConfig.with_nodes(3, name="goodput"))
    store, backend = runtime.cluster, runtime.backend
    timeline_path = root / "unbroken-progress.log"
    try:
        local_cluster.wait_ready(runtime, 120)
        spec = JobSpec.model_validate({
            "name": "goodput", "nodes": 2, "procs_per_node": 2, "command": workload(timeline_path),
            "resilience": {"auto_resume": True, "max_retry": 1000, "hang_timeout": hang_timeout, "require_deep_health_passed": False,
                           "warm_spares": 1 if warm else 0, "in_process_restart": in_process},
            "checkpoint": checkpoint_spec(checkpoint, root),
        })
        started = time.time()
        jobs.submit(store, spec, note="benchmarks/goodput.py")

        def inject(fault: Fault) -> None:
            job = store.get_job("goodput")
            if fault.kind in ("kill-worker", "hang-worker"):
                target = fault_injection.pick_rank(runtime, "goodput", rank=3)
                sig = signal.SIGKILL if fault.kind == "kill-worker" else signal.SIGSTOP
                fault_injection.signal_rank(runtime, target, sig, "ChaosKillWorker" if fault.kind == "kill-worker" else "ChaosHangWorker")
                return
            node = next(w.node for w in backend.observe_attempt("goodput", job.attempt) if w.node_rank == 1)
            if fault.kind == "kill-node":
                fault_injection.kill_node(runtime, node)
            else:
                fault_injection.inject_xid(runtime, node, 79)

        injected = run_faults(faults, started, minutes, inject, timeline_path)
        ended = time.time()
        outcome = analyse(system, read_timeline(timeline_path), started, ended, injected, default_step_s=STEP_TIME)
        summary = report.summarize(store.get_job("goodput"), backend.worker_history("goodput"),
                                   store.list_events(object_kind="Job", object_name="goodput"), now=ended)
        for recovery in summary.recoveries:
            outcome.badput["detection"] = outcome.badput.get("detection", 0.0) + recovery.detected_at - recovery.fault_at
            outcome.badput["restart"] = outcome.badput.get("restart", 0.0) + recovery.scheduled_at - recovery.detected_at
            outcome.badput["restart_startup"] = outcome.badput.get("restart_startup", 0.0) + recovery.first_step_at - recovery.scheduled_at
        stall = sum(a.checkpoint_stall_s for a in summary.attempts)
        outcome.badput["checkpoint_stall"] = stall
        return outcome
    finally:
        local_cluster.down(layout)


class TorchrunPair:
    """Two torchrun agents ("nodes") of one rendezvous; relaunchable as a pair."""

    def __init__(self, work: Path, max_restarts: int, timeline: Path) -> None:
        self.work, self.max_restarts, self.timeline = work, max_restarts, timeline
        self.groups: list[subprocess.Popen[bytes]] = []
        self.launches = 0

    def launch(self) -> None:
        self.launches += 1
        port = free_port()
        self.groups = []
        for node_rank in range(2):
            env = {**os.environ, "UNBROKEN_CHECKPOINT_DIR": str(self.work / "ckpt"), "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"goodput-{self.launches}",
                    "--rdzv-conf", f"is_host={1 if node_rank == 0 else 0}", "--max-restarts", str(self.max_restarts),
                    "--monitor-interval", "0.2", *workload(self.timeline)]
            log = open(self.work / f"launch{self.launches}-node{node_rank}.log", "wb")  # noqa: SIM115 - closed with the process
            self.groups.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))

    def any_exited(self) -> bool:
        return any(g.poll() is not None for g in self.groups)

    def stop(self) -> None:
        for group in self.groups:
            procs.kill_now(procs.tree(group.pid))
        for group in self.groups:
            group.wait()

    def inject(self, fault: Fault) -> None:
        node = self.groups[1]
        if node.poll() is not None:
            raise RuntimeError("rank 3's node is not running")
        if fault.kind == "kill-node":
            procs.kill_now(procs.tree(node.pid))
            return
        os.kill(rank_pid(node.pid, local_rank=1), signal.SIGSTOP if fault.kind == "hang-worker" else signal.SIGKILL)


def run_torchrun(system: str, faults: list[Fault], minutes: float, root: Path, *, retry_loop: bool) -> Outcome:
    work = root / system
    work.mkdir(parents=True)
    timeline = work / "progress.log"
    pair = TorchrunPair(work, 0 if retry_loop else 3, timeline)
    started = time.time()
    pair.launch()

    def supervise() -> None:
        if retry_loop and pair.any_exited():
            pair.stop()
            pair.launch()

    try:
        injected = run_faults(faults, started, minutes, pair.inject, timeline, supervise)
    finally:
        pair.stop()
    outcome = analyse(system, read_timeline(timeline), started, time.time(), injected, default_step_s=STEP_TIME)
    outcome.badput["relaunches"] = float(pair.launches - 1)
    return outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="wall time of each system's run")
    parser.add_argument("--mtbf-seconds", type=float, default=120.0, help="mean time between faults")
    parser.add_argument("--seed", type=int, default=1, help="of the fault schedule (the same for every system)")
    parser.add_argument("--systems", default="unbroken,unbroken+warm,torchrun,retry-loop")
    parser.add_argument("--unbroken-checkpoint", choices=("tiers", "file"), default="tiers",
                        help="how the unbroken systems checkpoint: through unbroken's tiers (memory, peer replica, "
                             "persistent) or the baselines' file per save")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="keep each system's files (logs, timeline; Kubernetes: every pod's log) in DIR, new or empty; "
                             "default: a temporary folder, removed")
    parser.add_argument("--hang-timeout", default=str(HANG_TIMEOUT),
                        help="the unbroken jobs' hang_timeout in seconds, or 'auto': none set, so unbroken sets it from the "
                             "job's step times (controller/hang_timeout.py)")
    parser.add_argument("--backend", choices=("local", "kubernetes"), default="local",
                        help="kubernetes: a PyTorchJob on the real control plane (goodput_kubernetes.py), systems "
                             f"{', '.join(KUBERNETES_SYSTEMS)}")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    hang_timeout = None if args.hang_timeout == "auto" else float(args.hang_timeout)
    faults = schedule(args.minutes, args.mtbf_seconds, args.seed)
    if args.backend == "kubernetes":
        import goodput_kubernetes

        faults = goodput_kubernetes.kubernetes_faults(faults)
        if args.systems == parser.get_default("systems"):
            args.systems = ",".join(KUBERNETES_SYSTEMS)
    systems = args.systems.split(",")
    unknown = [s for s in systems if s.startswith("k8s:") != (args.backend == "kubernetes")
               or (s.startswith("k8s:") and s not in KUBERNETES_SYSTEMS)]
    if unknown:
        print(f"goodput.py: {', '.join(unknown)} is not a system of --backend {args.backend} (Kubernetes: "
              f"{', '.join(KUBERNETES_SYSTEMS)})", file=sys.stderr)
        return 2
    print(f"{len(faults)} faults in {args.minutes:g} min: " + ", ".join(f"{f.kind}@{f.at:.0f}s" for f in faults), file=sys.stderr)
    outcomes = []
    if args.keep is not None and args.keep.exists() and any(args.keep.iterdir()):
        print(f"goodput.py --keep {args.keep}: not empty; give a new or empty folder", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        root = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="unbroken-goodput-")))
        root.mkdir(parents=True, exist_ok=True)
        for system in systems:
            print(f"running {system} for {args.minutes:g} min", file=sys.stderr)
            if system.startswith("k8s:"):
                import goodput_kubernetes

                outcomes.append(goodput_kubernetes.run(system, faults, args.minutes, root))
            elif system.split("+")[0] == "unbroken":
                extras = system.split("+")[1:]
                outcomes.append(run_unbroken(faults, args.minutes, root, warm="warm" in extras, in_process="inproc" in extras,
                                             checkpoint=args.unbroken_checkpoint,
                                             hang_timeout=None if "autohang" in extras else hang_timeout))
            else:
                outcomes.append(run_torchrun(system, faults, args.minutes, root, retry_loop=system == "retry-loop"))
    results = [o.to_dict() for o in outcomes]
    if args.json:
        print(json.dumps({"backend": args.backend, "minutes": args.minutes, "mtbf_seconds": args.mtbf_seconds, "seed": args.seed, "hang_timeout": args.hang_timeout,
                          "unbroken_checkpoint": args.unbroken_checkpoint, "results": results}))
        return 0
    print(f"goodput over {args.minutes:g} min, mtbf {args.mtbf_seconds:g} s, seed {args.seed}, hang_timeout {args.hang_timeout}, "
          f"unbroken checkpoints: {args.unbroken_checkpoint}: "
          + ", ".join(f"{f.kind}@{f.at:.0f}s" for f in faults) + "\n")
    print("| system | goodput | recover p50 (s) | recover p95 (s) | unrecovered | badput (s) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        unrecovered = sum(1 for f in r["fault_log"] if f["recover_s"] is None)
        spent = ", ".join(f"{k} {v:g}" for k, v in r["badput"].items() if v)
        print(f"| {r['system']} | {r['goodput']:.1%} | {r['recover_p50_s']} | {r['recover_p95_s']} | {unrecovered} of {r['faults']} | {spent} |")
    print("\nrecovery per fault (s; - = not recovered before the next fault or the end)\n")
    print("| system | " + " | ".join(f"{f.kind}@{f.at:.0f}s" for f in faults) + " |")
    print("|---|" + "---|" * len(faults))
    for r in results:
        row = ["-" if f["recover_s"] is None else f"{f['recover_s']:g}" for f in r["fault_log"]]
        print(f"| {r['system']} | " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
