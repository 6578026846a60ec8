"""Recovery on Kubernetes, for ``benchmarks/recovery.py --backend kubernetes``: one PyTorchJob, three faults, each
system on a control plane of its own.

Real: etcd, kube-apiserver, kube-controller-manager (its node lifecycle controller marks a dead node NotReady and
evicts its pods), kube-scheduler and training-operator v1.9.3, built from their Go modules; ``deploy/``'s RBAC;
torchrun, gloo and the MLP workload as real processes. Simulated: the kubelet (tests/controlplane/kubelet.py runs
each pod as local processes; its restart back-off starts at 1 s and doubles to 10 s, where a real kubelet's starts
at 10 s and doubles to 5 min).

Systems, the same job (2 pods of 1 rank, 50 ms steps, a checkpoint file every 20 steps):

* ``training-operator``: the job as Kubeflow documents it (``restartPolicy: OnFailure``), no unbroken
  annotations, no unbroken operator or agents. A killed rank's torchrun exits, the kubelet restarts its container;
  the other pod's rank fails on its lost peer and is restarted the same way; both rendezvous again and resume from
  the checkpoint file. Nothing sees a hang; a dead node's pods stay Terminating, so nothing replaces them.
* ``unbroken``: the same job with ``auto-resume`` (5 retries) and the node agent's socket mounted (progress, hang
  timeouts from step times), unbroken's operator and an agent per node: a restart deletes and recreates every pod.
* ``unbroken+launcher``: as ``unbroken``, with the pods' command ``unbroken run`` instead of torchrun
  (kubernetes/pod_launcher/): a failed rank is replaced in place from the pod's warm spare and takes the model from the
  surviving rank's memory; the launchers give up, and the operator recreates the pods, when a round cannot be
  made (a lost node). A hang is seen by the launchers from their ranks' step times (half the operator's hang
  timeout) and restarted in place too: the hung rank's pod's ranks are replaced, the others held.
* ``unbroken+spare-pod``: as ``unbroken+launcher`` with one spare pod (a third pod, ``--spare-pods 1``): a lost
  node's pod's place goes to the spare pod's warm spare, which takes the model from the master's memory.
* ``unbroken+elastic``: as ``unbroken+launcher``, an elastic job (``elasticPolicy`` min 1, max 2): after a lost
  node the master pod goes on alone at once; recovery ends at its first step at the smaller size.
* ``unbroken+bystander``: as ``unbroken``, on nodes shared with another opted-in job (three pods, one per node)
  that runs throughout; neither job asks for a GPU, so the scheduler fits both. Its reschedule beside ``unbroken``'s
  is the cost of sharing nodes (unbroken once waited for the other job to end).

Faults: ``kill-worker`` (SIGKILL worker-0's rank), ``hang-worker`` (SIGSTOP it), ``kill-node`` (the kubelet fails worker-0's node: its processes,
the node agent's among them, die, its Lease and status stop).

Measured from rank 0's step timeline (``--progress-log``: step, wall time, pid per step; rank 0 is the master
pod, which no fault here touches directly): **recover** = fault -> first step of a new rank 0 process; **steps
lost** = last step before the fault - the step resumed from; **detect** = fault -> unbroken's ``JobRestarting``
Event; **reschedule** = detection -> every pod of the new attempt Running (polled every 50 ms: the control plane and
the pods' start); **startup** = pods Running -> first step (torchrun, ``import torch``, rendezvous, restore);
**restore** = the master rank's own ``restore()`` time. An in-place restart keeps rank 0's process: its recovery
ends at the replacement rank's first step (its "first step N at T" line), **detect** = fault -> the coordinator's
"round 0 broken", **reschedule** = that -> every pod ready for round 1 (leaving the group, the replacement started),
**startup** = that -> the first step (the new group formed, the model taken from the peer).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from controlplane.unbroken_cluster import (  # noqa: E402 - tests/controlplane, on the path above
    JOBS, LAUNCHER, TORCHRUN, Cluster, auto_resume, one_pod_per_node, pytorchjob, rank_log, rank_process, start_agents, submit,
    unbroken_cluster, without_gpus,
)
from processes import stop_process  # noqa: E402
from harness import RESUMED, poll, read_timeline  # noqa: E402 - beside this script
from unbroken.kubernetes.backend import names  # noqa: E402

SYSTEMS = ("training-operator", "unbroken", "unbroken+launcher", "unbroken+spare-pod", "unbroken+elastic", "unbroken+bystander")
IN_PLACE = ("unbroken+launcher", "unbroken+spare-pod", "unbroken+elastic")
"""The systems whose pods run ``unbroken run``: their recoveries may happen in place, with no pod recreated."""
FAULTS = ("kill-worker", "hang-worker", "kill-node")
STEP_TIME = 0.05
CHECKPOINT_EVERY = 20
FAULT_AT_STEP = 45
"""Past the checkpoint at step 40 (every 20) and past the 10 steps the hang timeout is measured from."""
GIVE_UP_AFTER = 60.0


def start_system(cluster: Cluster, system: str) -> dict[str, subprocess.Popen[bytes]]:
    """unbroken's operator and an agent per node (returned) for the unbroken systems; nothing for training-operator alone."""
    if not system.startswith("unbroken"):
        return {}
    cluster.start_operator()
    return start_agents(cluster)


def system_job(name: str, system: str, workdir: Path, progress: Path, *, steps: int, retries: int) -> dict[str, Any]:
    """The benchmarks' PyTorchJob as ``system`` runs it: for unbroken, auto-resume with ``retries`` and the agent's socket,
    and ``unbroken run`` in place of torchrun for unbroken+launcher; rank 0's step timeline in ``progress``."""
    managed = system.startswith("unbroken")
    body = pytorchjob(name, workdir / "ckpt", steps=steps, step_time=STEP_TIME, checkpoint_every=CHECKPOINT_EVERY,
                      report_progress=managed, annotations=auto_resume(retries) if managed else None,
                      launcher=LAUNCHER if system in IN_PLACE else TORCHRUN, workload_args=("--progress-log", str(progress)),
                      spare_pods=1 if system == "unbroken+spare-pod" else 0,
                      elastic=(1, 2) if system == "unbroken+elastic" else None)
    return without_gpus(body) if system == "unbroken+bystander" else body


def start_bystander(cluster: Cluster, workdir: Path) -> bool:
    """Another opted-in job, a pod on every node, running before the measured job starts."""
    name = submit(cluster, one_pod_per_node(without_gpus(pytorchjob(
        "bystander", workdir / "bystander", steps=1_000_000, step_time=STEP_TIME, nodes=3, annotations=auto_resume(1)))))
    return bool(poll(lambda: sum(p.status.phase == "Running" for p in cluster.pods(name)) == 3, 120))


def _restarting_at(cluster: Cluster, name: str) -> float | None:
    """When unbroken decided to restart the job: its JobRestarting Event's own time stamp."""
    for event in cluster.core.list_namespaced_event(JOBS, field_selector=f"involvedObject.name={name}").items:
        if event.reason == "JobRestarting":
            return float((event.metadata.annotations or {}).get(f"{names.PREFIX}/time", 0)) or None
    return None


def _all_running(cluster: Cluster, name: str, attempt: str) -> bool:
    pods = cluster.pods(name)
    return len(pods) >= 2 and all((p.metadata.annotations or {}).get(names.ATTEMPT) == attempt and p.status.phase == "Running"
                                  and p.metadata.deletion_timestamp is None for p in pods)


def run(system: str, fault: str, workdir: Path) -> dict[str, Any]:
    """One run: a fresh cluster, the job up past a checkpoint, the fault, the first step after the resume."""
    workdir.mkdir(parents=True)
    result: dict[str, Any] = {"system": system, "fault": fault, "detect_s": None, "recover_s": None, "steps_lost": None,
                              "note": "", "reschedule_s": None, "startup_s": None, "restore_s": None}
    with unbroken_cluster(workdir) as cluster:
        agents = start_system(cluster, system)
        managed = bool(agents)
        try:
            if system == "unbroken+bystander" and not start_bystander(cluster, workdir):
                result["note"] = "the bystander's pods were not all running within 120 s"
                return result
            progress = workdir / "progress.log"
            body = system_job("bench", system, workdir, progress, steps=100_000, retries=5)
            name = submit(cluster, body)
            if not poll(lambda: any(step >= FAULT_AT_STEP for step, *_ in read_timeline(progress)), 180):
                result["note"] = f"the job never reached step {FAULT_AT_STEP}"
                print(f"# {system}: the master pod's log ends: {rank_log(cluster, f'{name}-master-0')[-2000:]}", file=sys.stderr)
                return result
            # steady state: every pod's spare warm (warming one imports torch, which would slow the restart on 2 cores)
            if system in IN_PLACE and not poll(
                    lambda: all("warm spare ready" in rank_log(cluster, f"{name}-{pod}") for pod in ("master-0", "worker-0"))
                    and (system != "unbroken+spare-pod" or "is warm and stands by" in rank_log(cluster, f"{name}-master-0")), 60):
                result["note"] = "the pods' warm spares were not ready within 60 s"
                return result
            old_pids = {pid for _, _, pid, _ in read_timeline(progress)}
            log_offset = len(rank_log(cluster, f"{name}-master-0"))
            worker_offset = len(rank_log(cluster, f"{name}-worker-0"))
            worker = cluster.core.read_namespaced_pod(f"{name}-worker-0", JOBS)
            fault_at = time.time()
            if fault == "kill-node":
                cluster.kubelet.fail_node(worker.spec.node_name)
                if worker.spec.node_name in agents:  # the node's agent dies with it
                    stop_process(agents.pop(worker.spec.node_name), sig=signal.SIGKILL)
            else:
                rank_process(cluster, f"{name}-worker-0").send_signal(signal.SIGKILL if fault == "kill-worker" else signal.SIGSTOP)

            replacement = f"{name}-worker-1" if system == "unbroken+spare-pod" else f"{name}-worker-0"
            replacement_offset = 0 if system == "unbroken+spare-pod" else worker_offset

            def resumed() -> tuple[int, float] | None:
                new = [(step, at) for step, at, pid, _ in read_timeline(progress) if pid not in old_pids and at > fault_at]
                if new or system not in IN_PLACE:
                    return new[0] if new else None
                if system == "unbroken+elastic":  # in place, smaller: rank 0 lives on; its first step in round 1
                    rounds = _round_times(rank_log(cluster, f"{name}-master-0")[log_offset:])
                    later = [(step, at) for step, at, *_ in read_timeline(progress) if rounds and at > rounds[1]]
                    return later[0] if later else None
                # in place: rank 0 lives on; the replacement's first step
                return _first_step_line(rank_log(cluster, replacement)[replacement_offset:], fault_at)

            running_at = None
            if system in ("unbroken", "unbroken+bystander"):  # the new attempt's pods come up before its first step: watch them
                running_at = poll(lambda: _all_running(cluster, name, "1") and time.time(), GIVE_UP_AFTER)
            first = poll(resumed, GIVE_UP_AFTER)
            in_place = None
            if system in IN_PLACE and first is not None:
                in_place = _round_times(rank_log(cluster, f"{name}-master-0")[log_offset:])
                if in_place is None:  # the launchers gave up: the pods were recreated, as for unbroken
                    running_at = poll(lambda: _all_running(cluster, name, "1") and time.time(), 1.0)
                    if running_at and running_at > first[1]:  # seen only after the first step: not a measure of either
                        running_at = None
            detected = _restarting_at(cluster, name) if managed and in_place is None else None
            if detected is not None:
                result["detect_s"] = round(detected - fault_at, 2)
            if first is None:
                result["note"] = f"no step after the fault within {GIVE_UP_AFTER:g} s" + (
                    "" if detected is None else " (a restart was decided)")
                return result
            first_step, first_at = first
            last_before = max(step for step, at, pid, _ in read_timeline(progress) if pid in old_pids and at <= fault_at)
            result["recover_s"] = round(first_at - fault_at, 2)
            # an in-place restart may resume past the last step rank 0 logged before the fault (the step in flight): 0 lost
            result["steps_lost"] = max(0, last_before - (first_step - 1))
            if in_place is not None:
                broken_at, ready_at = in_place
                result.update(detect_s=round(broken_at - fault_at, 2), reschedule_s=round(ready_at - broken_at, 2),
                              startup_s=round(first_at - ready_at, 2), note="in place (round 1, no pod recreated)")
            elif detected is not None and running_at:
                result["reschedule_s"] = round(running_at - detected, 2)
                result["startup_s"] = round(first_at - running_at, 2)
            if in_place is None:
                result["note"] = "pods recreated" if managed else "containers restarted by the kubelet"
            restores = [float(m.group(1)) for m in RESUMED.finditer(rank_log(cluster, f"{name}-master-0")[log_offset:])]
            result["restore_s"] = round(restores[0], 3) if restores else None
            return result
        finally:
            for proc in agents.values():
                stop_process(proc, sig=signal.SIGKILL)


_FIRST_STEP = re.compile(r"rank \d+: first step (\d+) at (\d+\.\d+)")
_ROUND_1_READY = re.compile(r"round 1: \d+ pods \(node ranks \[[\d, ]+\]\) are ready")


def _first_step_line(log: str, after: float) -> tuple[int, float] | None:
    """The first "first step N at T" a rank logged after ``after``: a replacement rank's first step."""
    for match in _FIRST_STEP.finditer(log):
        if float(match.group(2)) > after:
            return int(match.group(1)), float(match.group(2))
    return None


def _round_times(master_log: str) -> tuple[float, float] | None:
    """From the coordinator's log lines (node rank 0's launcher): when round 0 broke and when every pod was ready for
    round 1; None if there was no round 1 (the launchers gave up)."""
    broken = ready = None
    for line in master_log.splitlines():
        if not line.startswith("{") or '"component": "launcher"' not in line:
            continue
        record = json.loads(line)
        at = datetime.fromisoformat(record["ts"]).timestamp()
        if record["msg"].startswith("round 0 broken") and broken is None:
            broken = at
        elif _ROUND_1_READY.match(record["msg"]):
            ready = at
    return (broken, ready) if broken is not None and ready is not None else None
