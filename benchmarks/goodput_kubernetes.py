"""Goodput on Kubernetes, for ``benchmarks/goodput.py --backend kubernetes``: the PyTorchJob of recovery_kubernetes.py
(2 pods of 1 rank, 50 ms steps, a checkpoint every 20 steps) for ``--minutes`` under each system, a control plane of its
own each, the faults of goodput.py's seeded schedule on worker-0, read from rank 0's step timeline as goodput.py reads
its own (``analyse``).

Systems: ``k8s:training-operator`` (the job as Kubeflow documents it, nothing of unbroken), ``k8s:unbroken`` (pods
recreated at each restart), ``k8s:unbroken+launcher`` (``unbroken run`` in the pods: ranks restarted in place, hangs
too) and ``k8s:unbroken+spare-pod`` (the same with a third pod standing by, which takes a lost node's pod's place).
Faults in turn, on the worker pod that trains (worker-0, or the spare pod once it took worker-0's place):
kill-worker (SIGKILL its rank), hang-worker (SIGSTOP it), kill-node (the kubelet fails its node; it does not come back:
3 nodes, the job needs 2). Xid 79 is not injected here (recovery from it is the
same restart as a lost node's, after the agent's report).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from controlplane.unbroken_cluster import JOBS, Cluster, rank_log, rank_pids, submit, unbroken_cluster
from harness import Fault, Outcome, analyse, read_timeline, run_faults
from processes import stop_process
from recovery_kubernetes import start_system, system_job

FAULTS = ("kill-worker", "hang-worker", "kill-node")


def training_worker(cluster: Cluster, name: str) -> str:
    """The job's worker pod that trains now: the first, by name, with a rank running (a spare pod has none)."""
    workers = sorted(p.metadata.name for p in cluster.pods(name) if "-worker-" in p.metadata.name)
    return next((w for w in workers if rank_pids(cluster, w)), f"{name}-worker-0")


def keep_pod_logs(cluster: Cluster, name: str, into: Path) -> None:
    """Every pod's log of the job as it ends, beside the timeline: the kubelet's own files go with the cluster."""
    into.mkdir(exist_ok=True)
    for pod in cluster.pods(name):
        (into / f"{pod.metadata.name}.log").write_text(rank_log(cluster, pod.metadata.name))


def kubernetes_faults(faults: list[Fault]) -> list[Fault]:
    """goodput.py's schedule (the same times) with this backend's kinds in turn."""
    return [Fault(f.at, FAULTS[i % len(FAULTS)]) for i, f in enumerate(faults)]


def run(system: str, faults: list[Fault], minutes: float, root: Path) -> Outcome:
    base = system.removeprefix("k8s:")
    workdir = root / system.replace(":", "-")
    workdir.mkdir(parents=True)
    with unbroken_cluster(workdir) as cluster:
        agents = start_system(cluster, base)
        try:
            timeline = workdir / "progress.log"
            body = system_job("goodput", base, workdir, timeline, steps=10_000_000, retries=50)
            started = time.time()
            name = submit(cluster, body)

            def inject(fault: Fault) -> None:
                worker = training_worker(cluster, name)
                if fault.kind == "kill-node":
                    node = cluster.core.read_namespaced_pod(worker, JOBS).spec.node_name
                    if not node:
                        raise RuntimeError(f"{worker} is not on a node")
                    cluster.kubelet.fail_node(node)
                    if node in agents:  # the node's agent dies with it
                        stop_process(agents.pop(node), sig=signal.SIGKILL)
                    return
                pids = rank_pids(cluster, worker)
                if not pids:
                    raise RuntimeError(f"no rank running in {worker}")
                os.kill(pids[0], signal.SIGKILL if fault.kind == "kill-worker" else signal.SIGSTOP)

            injected = run_faults(faults, started, minutes, inject, timeline)
            keep_pod_logs(cluster, name, workdir / "pods")
            if not read_timeline(timeline):  # say why: a job that never stepped is a setup problem, not a goodput
                print(f"# {system}: no step in {minutes:g} min; the master pod's log ends:\n"
                      f"{rank_log(cluster, f'{name}-master-0')[-3000:]}", file=sys.stderr)
            return analyse(system, read_timeline(timeline), started, time.time(), injected)
        finally:
            for proc in agents.values():
                stop_process(proc, sig=signal.SIGKILL)
