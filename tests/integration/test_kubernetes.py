"""unbroken on Kubernetes, end to end, on a real control plane: the operator restarts real PyTorchJobs.

What is real: etcd, kube-apiserver (RBAC), kube-controller-manager (the Job, garbage-collector and node
lifecycle controllers: a dead node is tainted and its pods evicted by Kubernetes itself), kube-scheduler and
Kubeflow's training-operator v1, built from their Go modules (tests/controlplane/components.py has the
versions); ``deploy/``'s ServiceAccounts and RBAC, applied with ``kubectl kustomize deploy/``: the operator and
the node agents run with those accounts' tokens, so a missing permission fails a test. ``unbroken operator``
(watch caches + the shared reconcilers) and the node agents run as their own processes; the training pods are
real processes (torchrun, gloo, the MLP workload); ``kill -9`` really kills a rank; ``kubectl`` is the real binary.

What is simulated, and how (no container runtime here): the kubelet. tests/controlplane/kubelet.py registers
the Nodes, renews their Leases, runs each pod bound to them as local processes and reports their status; all
pods share 127.0.0.1, and a Service's name resolves there through the kubelet's /etc/hosts. Each test gets a
control plane of its own (~6 s): Nodes are cluster-wide and the tests fail, reboot and remediate them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes
import psutil
import pytest
import yaml

from controlplane.unbroken_cluster import (
    JOBS, NODES, SYSTEM, UNBROKENS, Agents, Cluster, auto_resume, checkpoint_steps, cluster_file, node_shm, pytorchjob,
    one_pod_per_node, rank_log, rank_process, running_with_a_checkpoint, start_agent, start_agents, submit, unbroken_cluster,
    wait_for_job, wait_resumed_off, without_gpus,
)
from helpers import run_cli
from processes import slowed, stop_process
from unbroken.checkpoint.node import credentials
from unbroken.kubernetes.backend import heartbeats, names, node_credentials, rank_env
from unbroken.kubernetes.backend.rank_env import AGENT_DIR
from unbroken.kubernetes.backend.client import api_client
from unbroken.kubernetes.backend.catalog import KubernetesCatalog
from unbroken.rank.symptoms import says_peer_lost
from unbroken.plumbing.waiting import WaitTimeout, wait_until

pytestmark = pytest.mark.timeout(300)

@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """``unbroken_cluster`` (with JobSet and the Trainer for a test marked ``trainer``, Kueue for one marked ``kueue``);
    afterwards: no kubelet error, no refusal in the operator's log, no pod process left."""
    with unbroken_cluster(tmp_path, trainer=request.node.get_closest_marker("trainer") is not None,
                          kueue=request.node.get_closest_marker("kueue") is not None) as result:
        yield result
        result.stop_operator()
        result.assert_clean()



def resumed_as(cluster: Cluster, name: str, attempt: int) -> bool:
    """The job's two pods are both of ``attempt`` and its master's rank has resumed from a checkpoint."""
    pods = cluster.pods(name)
    return len(pods) == 2 and all((p.metadata.annotations or {}).get(names.ATTEMPT) == str(attempt) for p in pods) \
        and "resumed at step" in rank_log(cluster, f"{name}-master-0")


def test_a_rank_killed_restarts_the_job_which_resumes_from_its_checkpoint(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_operator()
    checkpoints = tmp_path / "ckpt"
    name = running_with_a_checkpoint(cluster, pytorchjob("llm", checkpoints, steps=400, annotations=auto_resume(2)), checkpoints, 20)

    rank_process(cluster, f"{name}-worker-0").send_signal(signal.SIGKILL)

    wait_until(lambda: cluster.annotations(name).get(names.RESTART_COUNT) == "1", 30, "restart-count 1 on the PyTorchJob")
    reasons = wait_until(lambda: (r := cluster.reasons(name)).count("JobScheduled") >= 2 and r, 60, "attempt 1 scheduled")
    # a JobRestartCause may land anywhere after the restart: it follows the cause's report, the restart never waits for it
    assert [r for r in reasons if r != "JobRestartCause"][:3] == ["JobScheduled", "JobRestarting", "JobScheduled"], reasons
    restarting = next(m for _, r, m in cluster.events(name) if r == "JobRestarting")
    assert "restart 1 of 2" in restarting, restarting

    # The workload's controller recreated the pods for attempt 1; they resume from the checkpoint.
    def resumed() -> bool:
        pods = cluster.pods(name)
        return bool(pods) and all((p.metadata.annotations or {}).get(names.ATTEMPT) == "1" for p in pods) \
            and "resumed at step" in rank_log(cluster, f"{name}-master-0")
    wait_until(resumed, 120, "attempt 1's pods to resume from a checkpoint")
    # job logs on the cluster: the current pods' container output, read from the kubelet through the API
    logs = run_cli("--kubeconfig", str(cluster.kubeconfig), "job", "logs", f"{JOBS}/{name}").stdout.splitlines()
    master = [line.removeprefix(f"[{name}-master-0] ") for line in logs if line.startswith(f"[{name}-master-0] ")]
    assert any("resumed at step" in line for line in master), logs[-40:]
    assert any(line.startswith(f"[{name}-worker-0] ") for line in logs), logs[-40:]
    # Only attempt 1's pod: the kubelet's file holds both pods of that name one after the other, and attempt 0's
    # first step (a single digit; attempt 1 resumed at step 20 or later) is in the file but not in the pod's log.
    first_steps = re.compile(r"rank 0: first step \d at ")
    assert first_steps.search(rank_log(cluster, f"{name}-master-0"))
    assert not any(first_steps.search(line) for line in master), master[:20]
    wait_until(lambda: cluster.annotations(name).get(names.JOB_PHASE) == "Succeeded", 180, "the job to finish")
    assert cluster.annotations(name)[names.RESTART_COUNT] == "1"
    wait_until(lambda: cluster.reasons(name)[-1:] == ["JobSucceeded"], 10, "the JobSucceeded event")  # a write after the phase


def test_a_restart_beside_another_opted_in_jobs_pods_on_shared_nodes_waits_for_nothing_but_the_scheduler(
        cluster: Cluster, tmp_path: Path) -> None:
    """Nodes with room for two jobs (no GPU asked): a 3-pod job runs on them (one pod per node) and a 2-pod job beside
    it. A rank of the second is killed: it is relaunched and resumes while the first still runs, as the scheduler
    allows; unbroken never counts the other job's pods as making a node busy (it once waited for them to leave)."""
    cluster.start_operator()

    bystander = submit(cluster, one_pod_per_node(without_gpus(
        pytorchjob("bystander", tmp_path / "b", steps=100_000, nodes=3, annotations=auto_resume(1)))))
    wait_until(lambda: len({p.spec.node_name for p in cluster.pods(bystander) if p.status.phase == "Running"}) == 3, 90,
               "the bystander's pods running on every node")
    checkpoints = tmp_path / "ckpt"
    name = running_with_a_checkpoint(cluster, without_gpus(pytorchjob("shared", checkpoints, steps=100_000,
                                                                      annotations=auto_resume(2))), checkpoints)
    rank_process(cluster, f"{name}-worker-0").send_signal(signal.SIGKILL)
    wait_until(lambda: cluster.annotations(name).get(names.RESTART_COUNT) == "1", 30, "the restart")

    # 180 s: the bystander's three ranks train on the same two cores all along (CI once took over 90 s to resume)
    wait_for_job(cluster, name, lambda: resumed_as(cluster, name, 1), 180, "attempt 1 to resume beside the bystander's pods")
    assert cluster.annotations(bystander).get(names.JOB_PHASE) == "Running"
    assert cluster.annotations(bystander).get(names.RESTART_COUNT, "0") == "0", "the bystander was never touched"
    cluster.assert_clean()


def test_an_elastic_jobs_member_exit_is_left_to_its_rendezvous_not_restarted(cluster: Cluster, tmp_path: Path) -> None:
    """Kubeflow's elastic shape: ``elasticPolicy`` (min 1, max 2, maxRestarts 100), torchrun with c10d rendezvous in
    Master + Worker. One member's torchrun (not the one hosting the rendezvous store) is killed: the kubelet restarts
    its container in place, and while the other member runs, unbroken restarts nothing and spends no retry (it once
    restarted the whole job at the exit). Whether torchrun's agents then regroup is torch's to do (below); if they
    cannot (both members down), the job is below its min and unbroken restarts it, saying so."""
    cluster.start_operator()
    checkpoints = tmp_path / "ckpt"
    body = pytorchjob("elastic-echo", checkpoints, steps=300, annotations=auto_resume(2), elastic=(1, 2))
    body["spec"]["elasticPolicy"]["maxRestarts"] = 100
    name = running_with_a_checkpoint(cluster, body, checkpoints)
    # The member that does not host the c10d store: the store lives in one agent (torch's rendezvous has no
    # replica of it) on the rendezvous endpoint's port, training-operator's MASTER_PORT, and every pod here shares
    # 127.0.0.1, so whichever bound that port first hosts it. (The other may listen too: the workers' own store,
    # hosted by the member that drew group rank 0, is on a port of its own.)
    port = int(next(e.value for p in cluster.pods(name) for c in p.spec.containers for e in c.env or [] if e.name == "MASTER_PORT"))
    agents = {pod: psutil.Process(wait_until(lambda pod=pod: cluster.kubelet.pid_of(JOBS, f"{name}-{pod}"), 30, f"{pod}'s torchrun"))
              for pod in ("master-0", "worker-0")}
    victim = next(pod for pod, agent in agents.items()
                  if not any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in agent.net_connections("tcp")))
    survivor = agents[next(pod for pod in agents if pod != victim)]
    agents[victim].kill()

    def back_in_place() -> bool:
        pod = next(p for p in cluster.pods(name) if p.metadata.name.endswith(victim))
        return any((c.restart_count or 0) >= 1 and c.state.running is not None for c in pod.status.container_statuses or [])
    wait_until(back_in_place, 60, "the kubelet to restart the member in place")
    assert survivor.is_running(), "the other member's agent lived through the exit"
    assert cluster.annotations(name).get(names.RESTART_COUNT, "0") == "0", cluster.events(name)
    assert "JobRestarting" not in cluster.reasons(name), cluster.events(name)

    # Whether torch's agents regroup is torch's to do: on this machine a gloo group formed again after a member's
    # in-place restart sometimes never comes back (benchmarks/sdc.py says the same of torchrun's own restarts), and
    # nothing here (no node agent) would see that hang. What is unbroken's: for 30 s after the member is back it
    # restarts nothing but a job below its min, and a job that finishes meanwhile ends Succeeded.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and cluster.annotations(name).get(names.JOB_PHASE) != "Succeeded":
        restarts = [m for _, r, m in cluster.events(name) if r == "JobRestarting"]
        assert all("below elasticPolicy.minReplicas 1" in m for m in restarts), restarts
        time.sleep(0.5)  # watching for a decision that must not come: a poll, not synchronisation
    cluster.assert_clean()


def test_a_spent_retry_budget_fails_the_job_with_the_reason(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_operator()
    name = submit(cluster, pytorchjob("budget", tmp_path / "ckpt", steps=2000, annotations=auto_resume(0)))
    wait_until(lambda: cluster.annotations(name).get(names.JOB_PHASE) == "Running", 60, "the operator to adopt the job")
    rank_process(cluster, f"{name}-master-0").send_signal(signal.SIGKILL)

    wait_until(lambda: cluster.annotations(name).get(names.JOB_PHASE) == "Failed", 30, "the job to fail")
    # The phase annotation and the Event are two API writes: the Event may land a moment later.
    failed = wait_until(lambda: next((m for _, r, m in cluster.events(name) if r == "JobFailed"), None), 10,
                        "the JobFailed event")
    assert "max_retry 0 restarts used" in failed and "SIGKILL" in failed, failed
    assert cluster.job(name)["spec"]["runPolicy"]["suspend"] is True  # its pods are stopped
    wait_until(lambda: not cluster.pods(name), 30, "its pods to be gone")
    assert cluster.annotations(name)[names.RESTART_COUNT] == "0"


def test_jobs_without_the_annotation_or_with_a_bad_one_are_left_alone(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_operator()
    plain = submit(cluster, pytorchjob("plain", tmp_path / "plain", steps=2000, nodes=1))
    bad = submit(cluster, pytorchjob("bad", tmp_path / "bad", steps=2000, nodes=1,
                                     annotations={names.AUTO_RESUME: "true", names.MAX_RETRY: "many"}))
    warning = wait_until(lambda: [e for e in cluster.events(bad) if e[1] == "InvalidAnnotation"], 30, "a warning on the bad job")
    kind, _, message = warning[0]
    assert kind == "Warning"
    assert f'annotation {names.MAX_RETRY}: "many" is not a whole number (valid: 0 to 1000)' in message
    # A crash in either is nobody's business but the workload's own controller's (OnFailure: restart in place).
    for name in (plain, bad):
        rank_process(cluster, f"{name}-master-0").send_signal(signal.SIGKILL)
    wait_until(lambda: all(p.status.container_statuses and p.status.container_statuses[0].restart_count >= 1
                         for n in (plain, bad) for p in cluster.pods(n)), 30, "the kubelet to restart both in place")
    for name in (plain, bad):
        annotations = cluster.annotations(name)
        assert not [k for k in annotations if k.startswith(names.PREFIX) and k not in (names.AUTO_RESUME, names.MAX_RETRY)]
        assert not (cluster.job(name)["spec"].get("runPolicy") or {}).get("suspend")
    assert cluster.events(plain) == []
    assert len([e for e in cluster.events(bad) if e[1] == "InvalidAnnotation"]) == 1  # warned once, not every pass


def test_a_lost_node_is_remediated_and_its_stuck_pods_force_deleted_so_the_job_resumes_elsewhere(
        cluster: Cluster, tmp_path: Path) -> None:
    """The node's kubelet dies with it. Kubernetes' node lifecycle controller marks the Node NotReady (Unknown) and
    taints it unreachable, its taint eviction deletes the pods there (they stay Terminating: no kubelet confirms);
    unbroken labels, taints and conditions the node, calls its remediator, force-deletes the stuck pod so that
    training-operator can recreate it elsewhere, and the job resumes on the other nodes."""
    cluster.start_operator()
    checkpoints = tmp_path / "ckpt"
    name = running_with_a_checkpoint(cluster, pytorchjob("lost", checkpoints, steps=400, annotations=auto_resume(3)), checkpoints)
    worker = cluster.core.read_namespaced_pod(f"{name}-worker-0", JOBS)
    dead = worker.spec.node_name

    cluster.kubelet.fail_node(dead)

    node = wait_until(lambda: (n := cluster.core.read_node(dead)).metadata.labels.get(names.NODE_HEALTH_STATUS) ==
                    "UnschedulablePendingReplacement" and n, 30, "the lost node's label")
    assert node.metadata.labels[names.FAULT_TYPES] == "NodeLost"
    assert any(t.key == names.TAINT_KEY for t in node.spec.taints or [])
    # the condition is the write after the labels' (nodes/status)
    wait_until(lambda: any(c.type == names.CONDITION_TYPE and c.status == "False"
                           for c in cluster.core.read_node(dead).status.conditions or []), 10, "the UnbrokenHealthy=False condition")
    wait_until(lambda: f"Replace {dead}" in cluster.remediations.read_text(), 30, "the Command remediator to be called")
    assert node.spec.unschedulable or cluster.core.read_node(dead).spec.unschedulable  # cordoned

    # The node lifecycle controller writes the two effects in separate passes: NoSchedule with the condition,
    # NoExecute from its rate-limited eviction queue a moment later.
    wait_until(lambda: {t.effect for t in cluster.core.read_node(dead).spec.taints or []
                        if t.key == "node.kubernetes.io/unreachable"} == {"NoSchedule", "NoExecute"}, 30,
               "Kubernetes' unreachable taints, NoSchedule and NoExecute")
    ready = next(c for c in cluster.core.read_node(dead).status.conditions if c.type == "Ready")
    assert (ready.status, ready.reason) == ("Unknown", "NodeStatusUnknown")  # written by the node lifecycle controller

    wait_until(lambda: "PodForceDeleted" in cluster.reasons(name), 60, "the stuck pod to be force-deleted")
    wait_resumed_off(cluster, name, dead)
    restarting = next(m for _, r, m in cluster.events(name) if r == "JobRestarting")
    # What restarts the job comes first: the node's loss (its Lease is silent for NodeLostAfterSeconds), or the
    # survivor's collective failing on the dead peer (gloo: within a second) -- a symptom, whose cause is the node.
    assert dead in restarting or says_peer_lost(restarting), restarting


def test_an_operator_killed_mid_job_loses_no_restart_and_doubles_none(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_operator()
    checkpoints = tmp_path / "ckpt"
    name = running_with_a_checkpoint(cluster, pytorchjob("durable", checkpoints, steps=600, annotations=auto_resume(3)), checkpoints)
    rank_process(cluster, f"{name}-worker-0").send_signal(signal.SIGKILL)
    wait_until(lambda: cluster.annotations(name).get(names.RESTART_COUNT) == "1", 30, "the first restart")

    # Killed mid-restart (the count is the restart's first write; its stop and launch may not
    # have happened yet), with no goodbye: its leader lease must expire before the successor leads.
    # The successor finishes that restart rather than losing it or counting a second one.
    cluster.stop_operator(signal.SIGKILL)
    cluster.start_operator()
    wait_until(lambda: all((p.metadata.annotations or {}).get(names.ATTEMPT) == "1" and p.status.phase == "Running"
                         for p in cluster.pods(name)) and len(cluster.pods(name)) == 2, 120, "attempt 1 running")
    assert cluster.annotations(name)[names.RESTART_COUNT] == "1"
    assert cluster.reasons(name).count("JobRestarting") == 1
    # Kill again under the new operator: exactly one more restart.
    time_killed = time.time()
    rank_process(cluster, f"{name}-master-0").send_signal(signal.SIGKILL)
    wait_until(lambda: cluster.annotations(name).get(names.RESTART_COUNT) == "2", 60, "the second restart")
    wait_until(lambda: cluster.annotations(name).get(names.JOB_PHASE) == "Running", 60, "attempt 2 running")
    assert cluster.reasons(name).count("JobRestarting") == 2
    assert cluster.annotations(name)[names.RESTART_COUNT] == "2"
    assert time.time() - time_killed < 60




@pytest.fixture
def agents(cluster: Cluster) -> Iterator[Agents]:
    """The node agents of every node, running for the test, SIGKILLed after it."""
    started = start_agents(cluster)
    try:
        yield started
    finally:
        for proc in started.values():
            stop_process(proc, sig=signal.SIGKILL)


def test_an_xid_79_in_a_nodes_kernel_log_takes_it_out_and_the_job_resumes_on_other_nodes(cluster: Cluster, agents: Agents, tmp_path: Path) -> None:
    from unbroken.health.xid_lines import xid_line

    cluster.start_operator()
    checkpoints = tmp_path / "ckpt"
    name = running_with_a_checkpoint(cluster, pytorchjob("xid", checkpoints, steps=400, annotations=auto_resume(3)), checkpoints)
    faulty = cluster.core.read_namespaced_pod(f"{name}-worker-0", JOBS).spec.node_name

    with open(cluster.kubelet.node_dir(faulty) / "kmsg.log", "a") as kmsg:
        kmsg.write(xid_line(79, "PCI:0000:b9:00") + "\n")
    written = time.monotonic()
    def taken_out() -> Any:
        # The labels and taint are one write, the condition (nodes/status) the next: wait for both.
        n = cluster.core.read_node(faulty)
        flipped = n.metadata.labels.get(names.NODE_HEALTH_STATUS) == "UnschedulablePendingReplacement"
        return flipped and any(c.type == names.CONDITION_TYPE for c in n.status.conditions or []) and n
    node = wait_until(taken_out, 10, "the Xid to reach the node's labels and condition", interval=0.05)
    assert time.monotonic() - written < 2.0, "label and condition must change within 2 s of the kernel log line"
    assert node.metadata.labels[names.FAULT_TYPES] == "FaultyInstance"  # HyperPod's fault type for an Xid 79
    assert "Xid" in node.metadata.labels[names.FAULT_REASONS], node.metadata.labels
    condition = next(c for c in node.status.conditions if c.type == names.CONDITION_TYPE)
    assert (condition.status, condition.reason) == ("False", "NvidiaXID79Error")
    assert any(t.key == names.TAINT_KEY for t in node.spec.taints or [])
    # what a platform engineer sees with the real kubectl, from the real API server
    listing = cluster.plane.kubectl("get", "nodes", "-L", f"{names.NODE_HEALTH_STATUS},{names.FAULT_TYPES}").stdout
    row = next(line.split() for line in listing.splitlines() if line.startswith(faulty))
    assert row[-2:] == ["UnschedulablePendingReplacement", "FaultyInstance"], listing
    described = cluster.plane.kubectl("describe", "node", faulty).stdout
    assert f"{names.TAINT_KEY}=Unschedulable:NoSchedule" in described, described
    assert re.search(rf"{names.CONDITION_TYPE}\s+False.*NvidiaXID79Error", described), described
    def every_event_described() -> Any:
        # The remediation's Event (NodeReplaced) may follow the fault's by a pass: the Events are read
        # first, then `kubectl describe`, so every reason read must show in what describe prints.
        reasons = [r for r, _ in node_events(cluster, faulty)]
        shown = cluster.plane.kubectl("describe", "node", faulty).stdout
        return "FaultyInstance" in reasons and all(r in shown for r in reasons) and (reasons, shown)
    wait_until(every_event_described, 10, "kubectl describe to show unbroken's Events on the node")

    wait_resumed_off(cluster, name, faulty)
    assert cluster.annotations(name)[names.RESTART_COUNT] == "1"
    events = [(r, m) for _, r, m in cluster.events(name) if r in ("JobScheduled", "JobRestarting")]
    assert [r for r, _ in events] == ["JobScheduled", "JobRestarting", "JobScheduled"], events
    assert faulty in events[1][1] and "Xid" in events[1][1], events[1]


def test_with_the_memory_tier_an_xid_79_moves_the_job_which_restores_from_a_peer_replica(cluster: Cluster, agents: Agents,
                                                                                        tmp_path: Path) -> None:
    """Done-when 2 with the tiered checkpoint: the ranks save into their node's shared memory, the agents replicate
    each shard to a peer node and keep the catalog in ConfigMaps; the faulty node's memory is then gone (its agent
    killed, its /dev/shm/unbroken removed, as a replaced instance's would be), and the job resumes on the other
    two nodes from the peer replica -- no file checkpoint anywhere."""
    from unbroken.health.xid_lines import xid_line
    from unbroken.state.records import CheckpointTier, StepStatus

    cluster.start_operator()
    tiers = json.dumps({"memory": {"every_steps": 10, "keep": 2, "replicas": 1}})
    name = submit(cluster, pytorchjob("tiered", tmp_path / "no-files", steps=400, annotations=auto_resume(3), tiers_json=tiers))
    job = f"{JOBS}/{name}"
    catalog = KubernetesCatalog(cluster.api, SYSTEM)

    def replicated_step() -> int | None:
        """The newest memory step committed with a replica of both ranks' shards on a node other than its own."""
        committed = [s.step for s in catalog.list_checkpoint_steps(job, tier=CheckpointTier.MEMORY) if s.status is StepStatus.COMMITTED]
        copies = catalog.list_shard_copies(job, tier=CheckpointTier.REPLICA)
        return next((step for step in committed if {c.rank for c in copies if c.step == step} == {0, 1}), None)
    saved = wait_until(replicated_step, 120, "a committed memory step with a peer replica of each rank")
    assert not (tmp_path / "no-files").exists(), "the tiered checkpoint writes no files"

    def listed_replicated() -> list[tuple[int, str, int, int]] | None:
        """``ckpt list`` shows a committed step at or after ``saved`` with a replica of each rank. Polled: the job
        saves on while the agents replicate and retire steps, so one listing can catch a newer step whose replicas
        are still being pushed next to an older one already retired (the rows are what the CLI saw, for the failure)."""
        listed = json.loads(run_cli("--kubeconfig", str(cluster.kubeconfig), "ckpt", "list", job, "-o", "json").stdout)
        rows = [(r["step"], r["memory"], r["replicated"], r["world_size"]) for r in listed["steps"]]
        listings.append(rows)
        return rows if any(row[1:] == ("Committed", 2, 2) and row[0] >= saved for row in rows) else None
    listings: list[list[tuple[int, str, int, int]]] = []
    try:
        wait_until(listed_replicated, 20, f"ckpt list to show a committed step >= {saved} replicated for both ranks")
    except WaitTimeout as exc:
        pytest.fail(f"{exc}; the last listings (step, memory, replicated, world size): {listings[-3:]}")
    # ckpt verify on the cluster: the CLI presents the agents' certificate (the Secret) to every node's shard server
    # (every step: the job saves on, and keep 2 retires ``saved`` within a second or so)
    verified = json.loads(run_cli("--kubeconfig", str(cluster.kubeconfig), "ckpt", "verify", job, "-o", "json").stdout)
    by_step: dict[int, set[tuple[str, int]]] = {}
    for c in verified["checks"]:
        if c["ok"] is True:
            by_step.setdefault(c["step"], set()).add((c["tier"], c["rank"]))
    whole = {("memory", 0), ("memory", 1), ("replica", 0), ("replica", 1)}
    assert verified["ok"] and any(found == whole for found in by_step.values()), verified
    faulty = cluster.core.read_namespaced_pod(f"{name}-master-0", JOBS).spec.node_name
    assert (node_shm(cluster, faulty)).is_dir() and any(node_shm(cluster, faulty).rglob("*.slot")), "rank 0's slots on its node"

    with open(cluster.kubelet.node_dir(faulty) / "kmsg.log", "a") as kmsg:
        kmsg.write(xid_line(79, "PCI:0000:b9:00") + "\n")
    wait_until(lambda: cluster.core.read_node(faulty).metadata.labels.get(names.NODE_HEALTH_STATUS) == "UnschedulablePendingReplacement",
               10, "the Xid to take the node out")
    # The instance is replaced: its memory tier goes with it.
    stop_process(agents[faulty], sig=signal.SIGKILL)
    shutil.rmtree(node_shm(cluster, faulty))

    wait_resumed_off(cluster, name, faulty)
    master = rank_log(cluster, f"{name}-master-0")
    restored = [line for line in master.splitlines() if "unbroken: restored step" in line]
    assert restored and "replica" in restored[-1], master[-3000:]
    resumed_at = int(restored[-1].split("restored step ")[1].split()[0])
    assert resumed_at >= saved, (resumed_at, saved)
    wait_until(lambda: cluster.annotations(name).get(names.JOB_PHASE) == "Succeeded", 180, "the job to finish")
    assert cluster.annotations(name)[names.RESTART_COUNT] == "1"
    events = [r for _, r, _ in cluster.events(name) if r in ("JobScheduled", "JobRestarting")]
    assert events == ["JobScheduled", "JobRestarting", "JobScheduled"], events


def test_a_node_whose_agent_stops_renewing_its_lease_is_lost_and_the_job_moves(cluster: Cluster, agents: Agents, tmp_path: Path) -> None:
    cluster.start_operator()
    checkpoints = tmp_path / "ckpt"
    name = running_with_a_checkpoint(cluster, pytorchjob("lease", checkpoints, steps=400, annotations=auto_resume(3)), checkpoints)
    silent = cluster.core.read_namespaced_pod(f"{name}-master-0", JOBS).spec.node_name

    agents[silent].kill()  # the kubelet is fine; unbroken's agent on the node is gone

    node = wait_until(lambda: (n := cluster.core.read_node(silent)).metadata.labels.get(names.FAULT_TYPES) == "NodeLost" and n,
                    30, "the node to be declared lost")
    assert node.metadata.labels[names.NODE_HEALTH_STATUS] == "UnschedulablePendingReplacement"
    wait_resumed_off(cluster, name, silent)
    restarting = next(m for _, r, m in cluster.events(name) if r == "JobRestarting")
    assert silent in restarting and "heartbeat lost" in restarting, restarting


STARTUP_TAINT = {"key": names.TAINT_KEY, "value": names.TAINT_VALUE, "effect": names.TAINT_EFFECT}


FAN_CHECK = """
from pathlib import Path
from unbroken.health.result import FaultAction, Outcome, Status, passed

def fans(ctx):
    if (Path({marker!r}) / ctx.node).exists():
        return Outcome(Status.FAIL, "fan 3 stopped", "FanFailure", {{"fan": 3}}, FaultAction.REBOOT)
    return passed("all fans spinning")
"""


def test_a_continuous_check_failing_on_a_working_node_takes_it_out_for_a_reboot(cluster: Cluster, tmp_path: Path) -> None:
    """The DaemonSet's continuous checks (here with no kernel log at all): a site's check in the cluster file's
    Continuous suite runs every MonitorIntervalSeconds on each Schedulable node; when it fails on one, that node's
    agent takes it out (labels, taint, condition) and the operator's remediator reboots it. The others keep working."""
    marker = tmp_path / "broken-fans"
    marker.mkdir()
    check = tmp_path / "site_checks.py"
    check.write_text(FAN_CHECK.format(marker=str(marker)))
    config = yaml.safe_load(cluster.core.read_namespaced_config_map(names.CLUSTER_CONFIGMAP, SYSTEM).data["cluster.yaml"])
    config["Health"] = {**config.get("Health", {}), "MonitorIntervalSeconds": 1,
                        "CustomChecks": [{"Id": "site.fans", "Suites": ["Continuous"], "Target": f"{check}:fans"}]}
    cluster.core.patch_namespaced_config_map(names.CLUSTER_CONFIGMAP, SYSTEM, {"data": {"cluster.yaml": yaml.safe_dump(config)}})
    for node in NODES:  # the group whose InstanceType (cpu-dev) names the checks' health profile
        cluster.core.patch_node(node, {"metadata": {"labels": {f"{names.PREFIX}/instance-group": "gpu"}}})
    cluster.start_operator()
    agents = {node: start_agent(cluster, node, kernel_log="none") for node in NODES}
    try:
        def passed_everywhere() -> bool:
            return all(any(r == "HealthCheckPassed" and m.startswith("site.fans") for r, m in node_events(cluster, n)) for n in NODES)
        wait_until(passed_everywhere, 60, "site.fans to pass on every node")
        (marker / "gpu-b").touch()
        node = wait_until(lambda: (n := cluster.core.read_node("gpu-b")).metadata.labels.get(names.NODE_HEALTH_STATUS)
                          == "UnschedulablePendingReboot" and n, 30, "the failed check to take gpu-b out")
        assert "site.fans" in node.metadata.labels[names.FAULT_REASONS], node.metadata.labels
        assert any(t.key == names.TAINT_KEY for t in node.spec.taints or [])
        wait_until(lambda: any(c.type == names.CONDITION_TYPE and c.status == "False"
                               for c in cluster.core.read_node("gpu-b").status.conditions or []), 10, "the condition")
        wait_until(lambda: "Reboot gpu-b" in cluster.remediations.read_text(), 30, "the Command remediator to reboot gpu-b")
        failed = [m for r, m in node_events(cluster, "gpu-b") if r == "HealthCheckFailed"]
        assert failed and "site.fans" in failed[0] and "fan 3 stopped" in failed[0], failed
        for healthy in ("gpu-a", "gpu-c"):  # passing checks write nothing on the Node: it stays as unbroken found it
            node = cluster.core.read_node(healthy)
            assert node.metadata.labels.get(names.NODE_HEALTH_STATUS) is None and not node.spec.taints, node.metadata.labels
        assert "continuous checks cannot run" not in (cluster.workdir / "agent-gpu-a.log").read_text()
    finally:
        for proc in agents.values():
            stop_process(proc, sig=signal.SIGKILL)


def node_events(cluster: Cluster, node: str) -> list[tuple[str, str]]:
    """(reason, message) of a node's Events, oldest first."""
    items = [e for e in cluster.core.list_event_for_all_namespaces(label_selector=UNBROKENS).items if e.involved_object.kind == "Node"
             and e.involved_object.name == node]
    items.sort(key=lambda e: float((e.metadata.annotations or {}).get(f"{names.PREFIX}/time", 0)))
    return [(e.reason, e.message) for e in items]


def check_jobs(cluster: Cluster, node: str) -> list[Any]:
    jobs = kubernetes.client.BatchV1Api(cluster.api).list_namespaced_job(SYSTEM).items
    return [j for j in jobs if (j.metadata.annotations or {}).get(f"{names.PREFIX}/check-node") == node]


def test_a_joining_node_is_deep_checked_by_jobs_pinned_to_it_then_admitted_or_taken_out(cluster: Cluster) -> None:
    """Done-when 1: nodes registered with the startup taint are checked by Jobs on them; the healthy one is
    admitted (Passed, taint gone), the one a real matmul finds too slow is failed, tainted, conditioned and
    handed to the Command remediator. Nodes that were there before are left as they are. InstanceConnectivity
    runs across gpu-new and the one idle node whose deep check passed (gpu-a) as an Indexed Job, a pod on
    each, rank 0 on gpu-new."""
    cluster.core.patch_node("gpu-a", {"metadata": {"labels": {names.DEEP_HEALTH_CHECK_STATUS: "Passed"}}})
    cluster.start_operator()
    cluster.kubelet.add_node("gpu-new", labels={f"{names.PREFIX}/instance-group": "checked"}, taints=[STARTUP_TAINT])
    cluster.kubelet.add_node("gpu-slow", labels={"node.kubernetes.io/instance-type": "cpu-slow"}, taints=[STARTUP_TAINT])

    def labels(node: str) -> dict[str, str]:
        return cluster.core.read_node(node).metadata.labels or {}

    wait_until(lambda: labels("gpu-new").get(names.DEEP_HEALTH_CHECK_STATUS) == "InProgress", 30, "gpu-new InProgress")
    assert labels("gpu-new")[names.NODE_HEALTH_STATUS] == "Unschedulable"
    stress = wait_until(lambda: check_jobs(cluster, "gpu-new") or None, 30, "the InstanceStress Job")[0]
    assert stress.spec.backoff_limit == 0 and stress.spec.active_deadline_seconds > 30
    assert stress.metadata.annotations[f"{names.PREFIX}/check-suite"] == "InstanceStress"
    pod = stress.spec.template.spec
    assert [t.key for t in pod.tolerations] == [names.TAINT_KEY]
    term = pod.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms[0]
    assert (term.match_fields[0].key, term.match_fields[0].values) == ("metadata.name", ["gpu-new"])
    wait_until(lambda: any(p.startswith(stress.metadata.name) for p in cluster.kubelet.pods_on("gpu-new")), 30,
               "the check pod bound to gpu-new")

    node = wait_until(lambda: (n := cluster.core.read_node("gpu-new")).metadata.labels.get(names.NODE_HEALTH_STATUS) == "Schedulable"
                      and n, 240, "gpu-new admitted")
    assert node.metadata.labels[names.DEEP_HEALTH_CHECK_STATUS] == "Passed"
    assert not any(t.key == names.TAINT_KEY for t in node.spec.taints or []), node.spec.taints
    suites = sorted(j.metadata.annotations[f"{names.PREFIX}/check-suite"] for j in check_jobs(cluster, "gpu-new"))
    assert suites == ["InstanceConnectivity", "InstanceStress"]
    sweep = next(j for j in check_jobs(cluster, "gpu-new") if j.metadata.annotations[f"{names.PREFIX}/check-suite"] == "InstanceConnectivity")
    assert (sweep.spec.completion_mode, sweep.spec.completions) == ("Indexed", 2)
    sweep_pods = cluster.core.list_namespaced_pod(SYSTEM, label_selector=f"job-name={sweep.metadata.name}").items
    assert sorted(p.spec.node_name for p in sweep_pods) == ["gpu-a", "gpu-new"], "one pod on each node of the sweep"
    leader = next(p for p in sweep_pods if p.spec.node_name == "gpu-new")
    judged = [json.loads(line) for line in cluster.core.read_namespaced_pod_log(leader.metadata.name, SYSTEM).splitlines()
              if line.startswith("{") and '"collective.allreduce"' in line]
    assert judged and judged[0]["status"] == "Pass" and "across gpu-new, gpu-a" in judged[0]["message"], judged
    started = [m for r, m in node_events(cluster, "gpu-new") if r == "DeepHealthCheckStarted"]
    assert any("InstanceConnectivity: Indexed Job" in m and "across gpu-new (rank 0), gpu-a" in m for m in started), started
    reasons = [r for r, _ in node_events(cluster, "gpu-new")]
    assert reasons == ["DeepHealthCheckStarted", "DeepHealthCheckStarted", "JoinChecksPassed", "NodeSchedulable"], reasons

    slow = wait_until(lambda: (n := cluster.core.read_node("gpu-slow")).metadata.labels.get(names.DEEP_HEALTH_CHECK_STATUS) == "Failed"
                      and n, 120, "gpu-slow Failed")
    wait_until(lambda: labels("gpu-slow").get(names.NODE_HEALTH_STATUS) == "UnschedulablePendingReplacement", 30, "gpu-slow out")
    assert any(t.key == names.TAINT_KEY for t in cluster.core.read_node("gpu-slow").spec.taints or [])
    wait_until(lambda: any(c.type == names.CONDITION_TYPE and c.status == "False" and c.reason == "DeepHealthCheckFailed"
                           for c in cluster.core.read_node("gpu-slow").status.conditions or []), 10, "the condition")
    wait_until(lambda: "Replace gpu-slow" in cluster.remediations.read_text(), 30, "the Command remediator to be called")
    failed = next(m for r, m in node_events(cluster, "gpu-slow") if r == "JoinChecksFailed")
    assert "InstanceStress: stress.matmul: matmul below threshold" in failed, failed
    assert slow.metadata.annotations[names.FAULT_DETAILS]

    # the nodes that were there when unbroken started were never checked nor tainted (gpu-a only lent its ranks)
    for old in NODES:
        assert labels(old).get(names.DEEP_HEALTH_CHECK_STATUS) == ("Passed" if old == "gpu-a" else None)
        assert not check_jobs(cluster, old) and not any(t.key == names.TAINT_KEY for t in cluster.core.read_node(old).spec.taints or [])


def test_node_commands_on_a_cluster_cordon_a_node_and_reboot_one_through_the_remediator(cluster: Cluster) -> None:
    """``unbroken --kubeconfig F node cordon|uncordon|reboot``: a cordon is unbroken's label and taint (its
    job keeps running, nothing new lands there); a reboot goes through the operator's remediator (here the
    Command one) and the node, back on a new bootID, is Schedulable again. Wrong moves are one-line errors."""
    cluster.start_operator()
    kube = ("--kubeconfig", str(cluster.kubeconfig))

    def labels(node: str) -> dict[str, str]:
        return cluster.core.read_node(node).metadata.labels or {}

    def tainted(node: str) -> bool:
        return any(t.key == names.TAINT_KEY for t in cluster.core.read_node(node).spec.taints or [])

    assert "Schedulable -> Unschedulable" in run_cli(*kube, "node", "cordon", "gpu-a").stdout
    assert labels("gpu-a")[names.NODE_HEALTH_STATUS] == "Unschedulable" and tainted("gpu-a")
    refused = run_cli(*kube, "node", "cordon", "gpu-a", check=False)
    assert refused.returncode == 2 and "node gpu-a is Unschedulable; NodeCordoned needs one of" in refused.stderr, refused
    run_cli(*kube, "node", "uncordon", "gpu-a")
    assert labels("gpu-a")[names.NODE_HEALTH_STATUS] == "Schedulable" and not tainted("gpu-a")
    unknown = run_cli(*kube, "node", "reboot", "gpu-zz", check=False)
    assert unknown.returncode == 2 and "gpu-zz" in unknown.stderr and "Traceback" not in unknown.stderr, unknown

    booted = cluster.core.read_node("gpu-c").status.node_info.boot_id
    run_cli(*kube, "node", "reboot", "gpu-c")
    wait_until(lambda: "Reboot gpu-c" in cluster.remediations.read_text(), 30, "the Command remediator to reboot gpu-c")
    assert labels("gpu-c")[names.NODE_HEALTH_STATUS] == "UnschedulablePendingReboot" and tainted("gpu-c")
    assert cluster.core.read_node("gpu-c").spec.unschedulable, "cordoned while it reboots"
    cluster.kubelet.reboot_node("gpu-c")
    wait_until(lambda: labels("gpu-c").get(names.NODE_HEALTH_STATUS) == "Schedulable" and not tainted("gpu-c"), 60,
               "gpu-c back from its reboot")
    reasons = [r for r, _ in node_events(cluster, "gpu-c")]
    assert reasons[0] == "NodeRebootRequested" and "NodeRebooted" in reasons, reasons
    rebooted = next(m for r, m in node_events(cluster, "gpu-c") if r == "NodeRebooted")
    assert booted in rebooted, rebooted
    assert not cluster.core.read_node("gpu-c").spec.unschedulable, "unbroken's cordon lifted"
    assert cluster.remediations.read_text() == "Reboot gpu-c\n", "no other node was touched"


def test_self_reboot_the_agent_reboots_its_node_which_joins_again_through_deep_checks(cluster: Cluster, tmp_path: Path) -> None:
    """The SelfReboot remediator: an Xid 48 (a GPU reset clears it) → PendingReboot → Rebooting; the node's
    own agent runs SelfRebootCommand (here a script that records the call: a real one reboots the host);
    the process kubelet plays the reboot (pods die, a new bootID) and the agent starts again as its DaemonSet
    pod would → the operator sees the new boot: Joining, the deep checks run again as a Job on the node,
    Schedulable, unbroken's cordon lifted, and the agent on the new boot does not reboot again."""
    from unbroken.health.xid_lines import xid_line

    calls = tmp_path / "self-reboots.log"
    calls.touch()
    record = "import os, sys; open(sys.argv[1], 'a').write(os.environ['UNBROKEN_NODE'] + ' ' + os.environ['UNBROKEN_ACTION'] + chr(10))"
    config = yaml.safe_load(cluster_file(cluster.remediations))
    config["InstanceGroups"].append({"InstanceGroupName": "stressed", "InstanceType": "cpu-dev", "InstanceCount": 0,
                                     "OnStartDeepHealthChecks": ["InstanceStress"]})
    config["Kubernetes"].update(Remediator="SelfReboot", SelfRebootCommand=[sys.executable, "-c", record, str(calls)])
    cluster.core.patch_namespaced_config_map(names.CLUSTER_CONFIGMAP, SYSTEM, {"data": {"cluster.yaml": yaml.safe_dump(config)}})
    node = "gpu-b"
    cluster.core.patch_node(node, {"metadata": {"labels": {f"{names.PREFIX}/instance-group": "stressed"}}})
    agents = start_agents(cluster)  # after the ConfigMap change: agents read the cluster file when they start
    try:
        cluster.start_operator()
        first_boot = cluster.core.read_node(node).status.node_info.boot_id
        with open(cluster.kubelet.node_dir(node) / "kmsg.log", "a") as kmsg:
            kmsg.write(xid_line(48, "PCI:0000:b9:00") + "\n")

        wait_until(lambda: calls.read_text() == f"{node} Reboot\n", 30, "the node's agent to run SelfRebootCommand")
        rebooting = cluster.core.read_node(node)
        assert rebooting.metadata.labels[names.NODE_HEALTH_STATUS] == "UnschedulablePendingReboot"
        assert rebooting.metadata.annotations[names.REBOOT_FROM_BOOT] == first_boot
        assert rebooting.spec.unschedulable and rebooting.metadata.annotations[names.CORDONED] == "true"
        assert any(t.key == names.TAINT_KEY for t in rebooting.spec.taints or [])

        stop_process(agents[node], sig=signal.SIGKILL)  # the host goes down with its agent
        new_boot = cluster.kubelet.reboot_node(node)
        agents[node] = start_agent(cluster, node)

        back = wait_until(lambda: (n := cluster.core.read_node(node)).metadata.labels.get(names.NODE_HEALTH_STATUS) == "Schedulable"
                          and n, 120, "the rebooted node admitted again")
        assert back.metadata.labels[names.DEEP_HEALTH_CHECK_STATUS] == "Passed"
        assert not back.spec.unschedulable, "unbroken lifts the cordon it set"
        assert not any(t.key == names.TAINT_KEY for t in back.spec.taints or [])
        assert names.REBOOT_FROM_BOOT not in (back.metadata.annotations or {})
        assert [j.metadata.annotations[f"{names.PREFIX}/check-suite"] for j in check_jobs(cluster, node)] == ["InstanceStress"]
        events = node_events(cluster, node)
        reasons = [r for r, _ in events]
        expected = ["NodeRebooting", "NodeSelfRebooting", "NodeRebooted", "DeepHealthCheckStarted", "JoinChecksPassed", "NodeSchedulable"]
        assert [r for r in reasons if r in expected] == expected, events
        rebooted = next(m for r, m in events if r == "NodeRebooted")
        assert first_boot in rebooted and new_boot in rebooted, rebooted
        # the agent on the new boot saw no reboot due (the mark is gone); one call in all
        assert calls.read_text() == f"{node} Reboot\n"
    finally:
        for proc in agents.values():
            stop_process(proc, sig=signal.SIGKILL)


def test_a_straggler_node_is_named_on_the_workload_then_taken_out_labelled_and_conditioned_and_the_job_moves(
        cluster: Cluster, agents: Agents, tmp_path: Path) -> None:
    """Issue 25 on the real control plane: the worker's node is slowed 3x for real (its pod's processes stopped for
    two thirds of every 50 ms); its agent's step timing reaches the operator with the heartbeats; a StragglerDetected
    Event lands on the PyTorchJob; under ``straggler-policy: replace`` the node is taken out (label, fault type,
    condition, remediator) and the job restarts on the third node."""
    cluster.start_operator()
    body = pytorchjob("slowpoke", tmp_path / "ckpt", steps=100_000, step_time=0.0, report_progress=True,
                      annotations={**auto_resume(2), names.STRAGGLER_POLICY: "replace", names.STRAGGLER_RESTART_COST: "1"})
    for replica in body["spec"]["pytorchReplicaSpecs"].values():
        replica["template"]["spec"]["containers"][0]["command"] += ["--compute-matmuls", "40"]
        replica["template"]["spec"]["terminationGracePeriodSeconds"] = 5
    name = submit(cluster, body)
    rank_process(cluster, f"{name}-worker-0")
    victim = cluster.core.read_namespaced_pod(f"{name}-worker-0", JOBS).spec.node_name
    wait_until(lambda: "JobScheduled" in cluster.reasons(name) or cluster.annotations(name).get(names.JOB_PHASE) == "Running",
               60, "the job running")
    pod_pid = cluster.kubelet.pid_of(JOBS, f"{name}-worker-0")
    assert pod_pid is not None
    with slowed(pod_pid, 3.0, 0.05):
        detected = wait_until(lambda: next((m for _, r, m in cluster.events(name) if r == "StragglerDetected"), None), 90,
                              "a StragglerDetected Event on the PyTorchJob")
        assert f"node {victim} is a straggler" in detected and "'compute'" in detected, detected
        replaced = wait_until(lambda: next((m for _, r, m in cluster.events(name) if r == "StragglerReplaced"), None), 60,
                              "the straggler taken out")
        assert f"node {victim} taken out" in replaced, replaced
    node = cluster.core.read_node(victim)
    assert node.metadata.labels[names.NODE_HEALTH_STATUS] == "UnschedulablePendingReplacement"
    assert node.metadata.labels[names.FAULT_TYPES] == "Straggler"
    wait_until(lambda: any(c.type == names.CONDITION_TYPE and c.status == "False" and c.reason == "Straggler"
                           for c in cluster.core.read_node(victim).status.conditions or []), 10, "UnbrokenHealthy=False, reason Straggler")
    wait_until(lambda: f"Replace {victim}" in cluster.remediations.read_text(), 30, "the remediator called")
    wait_until(lambda: cluster.annotations(name).get(names.RESTART_COUNT) == "1", 30, "restart-count 1")
    restarting = next(m for _, r, m in cluster.events(name) if r == "JobRestarting")
    assert f"node {victim} is UnschedulablePendingReplacement: straggler in job" in restarting, restarting

    def moved() -> bool:
        pods = cluster.pods(name)
        return len(pods) == 2 and all((p.metadata.annotations or {}).get(names.ATTEMPT) == "1" and p.status.phase == "Running"
                                      and p.spec.node_name != victim for p in pods)
    wait_until(moved, 120, "attempt 1 running off the straggler")


def test_a_flipped_bit_in_a_pytorchjob_takes_out_the_node_that_computes_wrong_and_resumes_from_the_agreed_step(
        cluster: Cluster, agents: Agents, tmp_path: Path) -> None:
    """Issue 37 on the real control plane: a PyTorchJob's two replicas (Master, Worker) compare their state every 20
    steps (saves every 10: one falls between a flip and its detection); one bit of the worker's parameters is flipped through its rank (the request file ``chaos corrupt`` writes,
    named by the pod's env), and its node's known-answer check is made to fail (the ``chaos-sdc`` file in its agent's
    state, as a faulty GPU would). Two replicas have no majority: the operator restarts the job, cordons both nodes
    as suspects, their agents run the known-answer check, the worker's node is taken out (label, fault type,
    remediator) and the master's comes back; the job resumes from the last agreed step on healthy nodes."""
    cluster.start_operator()
    request = tmp_path / "chaos-corrupt.json"
    body = pytorchjob("sdc", tmp_path / "ckpt", steps=100_000, step_time=0.02, report_progress=True, annotations=auto_resume(2),
                      workload_args=("--watch-replicas", "20"))
    template = body["spec"]["pytorchReplicaSpecs"]["Master"]["template"]  # the Worker's too: they share it
    template["spec"]["containers"][0]["env"].append({"name": "UNBROKEN_CHAOS_CORRUPT", "value": str(request)})
    template["spec"]["terminationGracePeriodSeconds"] = 5
    name = running_with_a_checkpoint(cluster, body, tmp_path / "ckpt", step=20)
    victim = cluster.core.read_namespaced_pod(f"{name}-worker-0", JOBS).spec.node_name
    healthy = cluster.core.read_namespaced_pod(f"{name}-master-0", JOBS).spec.node_name
    (cluster.kubelet.node_dir(victim) / "state" / "nodes" / victim / "chaos-sdc").parent.mkdir(parents=True, exist_ok=True)
    (cluster.kubelet.node_dir(victim) / "state" / "nodes" / victim / "chaos-sdc").touch()
    request.write_text(json.dumps({"rank": 1, "step": 0, "target": "params"}))  # the worker's rank, at its next step
    flipped = wait_until(lambda: json.loads(request.with_suffix(".done").read_text()) if request.with_suffix(".done").exists() else None,
                         60, "the worker's rank to flip the bit")
    agreed = flipped["step"] // 20 * 20

    said = wait_until(lambda: next((m for _, r, m in cluster.events(name) if r == "SilentDataCorruption"), None), 90,
                      "a SilentDataCorruption Event on the PyTorchJob")
    assert f"replicas disagree at step {agreed + 20} in model.0.weight" in said and "no majority among ranks 0, 1" in said, said
    assert f"last agreed step {agreed}" in said and "cordoned until its known-answer check" in said, said

    def settled() -> bool:
        labels = {n: cluster.core.read_node(n).metadata.labels for n in (victim, healthy)}
        return labels[victim].get(names.NODE_HEALTH_STATUS) == "UnschedulablePendingReplacement" and \
            labels[healthy].get(names.NODE_HEALTH_STATUS) == "Schedulable"
    wait_until(settled, 120, f"{victim} out and {healthy} back after their known-answer checks")
    assert cluster.core.read_node(victim).metadata.labels[names.FAULT_TYPES] == "SilentDataCorruption"
    wait_until(lambda: f"Replace {victim}" in cluster.remediations.read_text(), 30, "the remediator called")
    restarting = next(m for _, r, m in cluster.events(name) if r == "JobRestarting")
    assert restarting.startswith(f"silent data corruption: replicas disagree at step {agreed + 20}"), restarting
    quarantined = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("untrusted-"))
    # saved after the agreed step (the check step's own save too: the verdict is read a step later): never restored
    assert quarantined == [f"untrusted-step-{agreed + 10:09d}", f"untrusted-step-{agreed + 20:09d}"], quarantined

    def resumed() -> bool:
        pods = cluster.pods(name)
        return len(pods) == 2 and all((p.metadata.annotations or {}).get(names.ATTEMPT) == "1" and p.spec.node_name != victim
                                      for p in pods) and f"resumed at step {agreed} " in rank_log(cluster, f"{name}-master-0")
    wait_until(resumed, 180, f"attempt 1 off {victim}, resumed from step {agreed}")


def test_a_hung_rank_restarts_the_job_after_its_hang_timeout(cluster: Cluster, agents: Agents, tmp_path: Path) -> None:
    """Done-when 6: a rank stopped with SIGSTOP makes no progress; its node's agent keeps reporting the last
    step in its Lease; the operator restarts the job after hang-timeout-seconds, and it resumes."""
    cluster.start_operator()
    checkpoints = tmp_path / "ckpt"
    body = pytorchjob("hung", checkpoints, steps=3000, annotations={**auto_resume(2), names.HANG_TIMEOUT: "4"},
                      report_progress=True)
    name = running_with_a_checkpoint(cluster, body, checkpoints)
    leases = kubernetes.client.CoordinationV1Api(cluster.api)

    def reported_step(node: str) -> int | None:
        lease = leases.read_namespaced_lease(f"{names.LEASE_PREFIX}{node}", SYSTEM)
        reports = json.loads((lease.metadata.annotations or {}).get(names.LEASE_PROGRESS) or "[]")
        mine = [r for r in reports if r["job"] == f"{JOBS}/{name}" and r["attempt"] == 0]
        return mine[0].get("last_step") if mine else None  # absent until a rank has reported a step

    worker_node = cluster.core.read_namespaced_pod(f"{name}-worker-0", JOBS).spec.node_name
    wait_until(lambda: (reported_step(worker_node) or 0) >= 10, 30, "the ranks' progress in the agent's Lease")

    rank_process(cluster, f"{name}-worker-0").suspend()  # SIGSTOP: alive, silent
    stopped_at = time.time()

    wait_until(lambda: "JobRestarting" in cluster.reasons(name), 60, "the hang to restart the job")
    waited = time.time() - stopped_at
    restarting = next(m for _, r, m in cluster.events(name) if r == "JobRestarting")
    assert "hang: no progress from a rank on" in restarting and "hang_timeout 4 s" in restarting, restarting
    assert 4 <= waited < 15, waited  # not before the timeout; within a few passes after it
    # A stopped rank ignores SIGTERM: its pod goes at SIGKILL, and its name (which attempt 1 needs) stays taken
    # until then. unbroken stops an attempt with Kubernetes.StopGraceSeconds (3), not the pod's own 30 s.
    # (training-operator deletes the pods of a suspended job too, with their own grace: a second delete shortens it)
    wait_until(lambda: any(p.metadata.deletion_grace_period_seconds == 3 for p in cluster.pods(name)
                           if p.metadata.name.endswith("worker-0") and p.metadata.deletion_timestamp is not None), 30,
               "the hung worker's pod deleted with a 3 s grace period")
    wait_until(lambda: cluster.annotations(name).get(names.RESTART_COUNT) == "1", 30, "restart-count 1")

    def resumed() -> bool:
        pods = cluster.pods(name)
        return bool(pods) and all((p.metadata.annotations or {}).get(names.ATTEMPT) == "1" for p in pods) \
            and "resumed at step" in rank_log(cluster, f"{name}-master-0")
    wait_until(resumed, 120, "attempt 1 to resume from the checkpoint")


def test_a_rank_that_never_reaches_its_first_step_restarts_the_job_after_the_startup_timeout(
        cluster: Cluster, agents: Agents, tmp_path: Path) -> None:
    """A startup hang: the rank joined (``unbroken.init()`` said hello to its node's agent) and then never
    reported a step (a data loader stuck on a mount, a rendezvous that never completes). With
    ``startup-timeout-seconds`` the job restarts, and once the budget is spent it fails with the reason."""
    cluster.start_operator()
    body = pytorchjob("stuck", tmp_path / "ckpt", steps=10, nodes=1, report_progress=True,
                      annotations={**auto_resume(1), names.STARTUP_TIMEOUT: "4"})
    container = body["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    # The rank stamps its own start before importing anything: the startup timeout counts from the
    # container's start, and on a busy machine ``import unbroken`` alone can take seconds, so the
    # moment the test sees the hello is no reference (CI once saw it 2 s late).
    container["command"] = [sys.executable, "-c", "import time; print('started', time.time(), flush=True); "
                            "import unbroken; unbroken.init(); print('joined', flush=True); time.sleep(3600)"]
    body["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["terminationGracePeriodSeconds"] = 2
    name = submit(cluster, body)
    wait_until(lambda: "joined" in rank_log(cluster, f"{name}-master-0"), 60, "the rank to say hello")
    started_at = float(rank_log(cluster, f"{name}-master-0").split("started ", 1)[1].split()[0])

    wait_until(lambda: "JobRestarting" in cluster.reasons(name), 60, "the startup hang to restart the job")
    waited = time.time() - started_at
    restarting = next(m for _, r, m in cluster.events(name) if r == "JobRestarting")
    assert "reported progress within startup_timeout 4 s" in restarting and "restart 1 of 1" in restarting, restarting
    # startedAt has whole seconds (up to 1 s early) and python starts a moment after the container: not before
    # about 3 s, then within a few passes.
    assert 2 <= waited < 15, waited
    wait_until(lambda: cluster.annotations(name).get(names.JOB_PHASE) == "Failed", 90, "attempt 1 to hang too and fail the job")
    failed = wait_until(lambda: next((m for _, r, m in cluster.events(name) if r == "JobFailed"), None), 10, "the JobFailed event")
    assert "startup_timeout 4 s" in failed and "max_retry 1 restarts used" in failed, failed


TRAINER = ("trainer.kubeflow.org", "v1alpha1")
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"


def trainjob(name: str, checkpoints: Path, tmp_path: Path, *, steps: int, max_retry: int) -> dict[str, Any]:
    """A job file rendered as a TrainJob by the real CLI (``k8s render --kind TrainJob``), plus a runtime patch
    of another manager (a label, as Kueue writes one) that unbroken must keep."""
    job_file = tmp_path / f"{name}.yaml"
    job_file.write_text(yaml.safe_dump({
        "name": name, "nodes": 2, "procs_per_node": 1,
        "command": ["-m", "unbroken.workloads.mlp", "--steps", str(steps), "--checkpoint-every", "10", "--step-time", "0.05"],
        "resilience": {"auto_resume": True, "max_retry": max_retry}, "checkpoint": {"dir": str(checkpoints)}}))
    body: dict[str, Any] = json.loads(run_cli("k8s", "render", "--kind", "TrainJob", "-f", str(job_file), "--image", "train:1",
                                              "-n", JOBS, "--gpus-per-node", "1", "-o", "json").stdout)
    body["spec"]["runtimePatches"].append({"manager": "example.com/queue", "trainingRuntimeSpec": {"template": {"spec": {
        "replicatedJobs": [{"name": "node", "template": {"spec": {"template": {
            "metadata": {"labels": {"example.com/queue": "research"}}}}}}]}}}})
    return body


@pytest.mark.trainer
def test_a_trainjob_rank_killed_restarts_the_job_which_resumes_from_its_checkpoint(cluster: Cluster, tmp_path: Path) -> None:
    """Done-when 3 for a TrainJob, as ``unbroken k8s render --kind TrainJob`` writes one, through the real Trainer,
    JobSet and Job controllers with Kubeflow's own ``torch-distributed`` runtime: Trainer -> JobSet -> Jobs -> pods;
    a rank killed -> the TrainJob is suspended, its JobSet deleted and built again by the Trainer, the pods of
    attempt 1 come with unbroken's runtime patch and resume from the checkpoint."""
    cluster.start_operator()
    checkpoints = tmp_path / "ckpt"
    cluster.custom.create_namespaced_custom_object(*TRAINER, JOBS, "trainjobs", trainjob("tj", checkpoints, tmp_path, steps=400, max_retry=2))

    def train() -> dict[str, Any]:
        return cluster.custom.get_namespaced_custom_object(*TRAINER, JOBS, "trainjobs", "tj")

    def annotations() -> dict[str, str]:
        return train()["metadata"].get("annotations") or {}

    def pods() -> dict[int, Any]:
        """The live trainer pods by node rank (completion index)."""
        found = cluster.core.list_namespaced_pod(JOBS, label_selector=f"{JOBSET_NAME}=tj").items
        return {int(p.metadata.labels["batch.kubernetes.io/job-completion-index"]): p for p in found
                if not p.metadata.deletion_timestamp}

    def jobset_uid() -> str | None:
        try:
            return str(cluster.custom.get_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", JOBS, "jobsets", "tj")["metadata"]["uid"])
        except kubernetes.client.ApiException:
            return None

    wait_until(lambda: annotations().get(names.JOB_PHASE) == "Running", 60, "the operator to adopt the TrainJob")
    wait_until(lambda: any(s >= 20 for s in checkpoint_steps(checkpoints)), 120, "a checkpoint at step 20")
    first_jobset = jobset_uid()
    assert sorted(pods()) == [0, 1]
    for pod in pods().values():  # the CLI's runtime patch and trainer.env reached the pods: they can reach their agent
        assert "unbroken-agent" in {v.name for v in pod.spec.volumes or []}
        assert "UNBROKEN_AGENT_SOCKET" in {e.name for e in pod.spec.containers[0].env or []}

    rank_process(cluster, pods()[1].metadata.name).send_signal(signal.SIGKILL)

    wait_until(lambda: annotations().get(names.RESTART_COUNT) == "1", 30, "restart-count 1 on the TrainJob")
    reasons = wait_until(lambda: (r := cluster.reasons("tj")).count("JobScheduled") >= 2 and r, 60, "attempt 1 scheduled")
    # a JobRestartCause may land anywhere after the restart: it follows the cause's report, the restart never waits for it
    assert [r for r in reasons if r != "JobRestartCause"][:3] == ["JobScheduled", "JobRestarting", "JobScheduled"], reasons
    restarting = next(m for _, r, m in cluster.events("tj") if r == "JobRestarting")
    assert "restart 1 of 2" in restarting and "SIGKILL" in restarting, restarting

    def resumed() -> bool:
        live = pods()
        return sorted(live) == [0, 1] and all((p.metadata.annotations or {}).get(names.ATTEMPT) == "1" for p in live.values()) \
            and "resumed at step" in rank_log(cluster, live[0].metadata.name)
    wait_until(resumed, 120, "attempt 1's pods to resume from a checkpoint")
    assert jobset_uid() not in (None, first_jobset)  # built again: the runtime's Job failure counts start at 0
    patches = {p["manager"]: p for p in train()["spec"]["runtimePatches"]}
    assert set(patches) == {f"{names.PREFIX}/cli", "example.com/queue", f"{names.PREFIX}/operator"}, patches  # others' kept
    assert all((p.metadata.labels or {}).get("example.com/queue") == "research" for p in pods().values())

    wait_until(lambda: annotations().get(names.JOB_PHASE) == "Succeeded", 180, "the TrainJob to finish")
    assert annotations()[names.RESTART_COUNT] == "1"
    wait_until(lambda: cluster.reasons("tj")[-1:] == ["JobSucceeded"], 10, "the JobSucceeded event")  # a write after the phase
    # the Trainer's own verdict follows through JobSet and Jobs
    wait_until(lambda: any(c["type"] == "Complete" and c["status"] == "True" for c in train().get("status", {}).get("conditions", [])),
               30, "the TrainJob's Complete condition")


PLAIN_DDP = Path(__file__).resolve().parents[1] / "fixtures" / "plain_ddp.py"


def test_a_pytorchjob_written_as_kubeflow_documents_it_survives_a_killed_rank_and_completes(cluster: Cluster,
                                                                                         tmp_path: Path) -> None:
    """The shape of Kubeflow's PyTorchJob examples -- Master + Worker, ``restartPolicy: OnFailure``, a plain DDP
    script run with ``python3`` (no torchrun, no ``import unbroken``), the operator's default MASTER_PORT -- with
    unbroken's two annotations added and nothing else changed. The real training-operator builds the pods (its
    ``init-pytorch`` container waits for the master's Service name), a rank is killed, unbroken restarts the job
    through ``runPolicy.suspend``, the recreated pods resume from the script's own checkpoint and it completes."""
    cluster.start_operator()
    checkpoint = tmp_path / "shared" / "model.pt"
    checkpoint.parent.mkdir()
    container = {"name": "pytorch", "image": "docker.io/kubeflowkatib/pytorch-mnist-cpu:latest", "imagePullPolicy": "Always",
                 "command": ["python3", str(PLAIN_DDP), "--steps", "300", "--checkpoint", str(checkpoint)]}
    replica = {"replicas": 1, "restartPolicy": "OnFailure", "template": {"spec": {"containers": [container]}}}
    name = submit(cluster, {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
                            "metadata": {"name": "pytorch-simple", "namespace": JOBS, "annotations": auto_resume(2)},
                            "spec": {"pytorchReplicaSpecs": {"Master": replica, "Worker": json.loads(json.dumps(replica))}}})
    worker = wait_until(lambda: next((p for p in cluster.pods(name) if p.metadata.name.endswith("worker-0")), None), 60,
                        "the worker pod")
    assert [c.name for c in worker.spec.init_containers or []] == ["init-pytorch"], "training-operator's own init container"
    wait_until(checkpoint.exists, 120, "the script's first checkpoint")

    pid = wait_until(lambda: cluster.kubelet.pid_of(JOBS, f"{name}-worker-0"), 30, "the worker's rank")
    psutil.Process(pid).kill()

    wait_until(lambda: cluster.annotations(name).get(names.RESTART_COUNT) == "1", 60, "unbroken's restart")
    wait_until(lambda: "resumed at step" in rank_log(cluster, f"{name}-master-0"), 120, "the script to resume")
    wait_until(lambda: cluster.annotations(name).get(names.JOB_PHASE) == "Succeeded", 180, "the job to complete")
    assert "final loss" in rank_log(cluster, f"{name}-master-0")
    conditions = {c["type"]: c["status"] for c in cluster.job(name)["status"]["conditions"]}
    assert conditions.get("Succeeded") == "True", conditions  # training-operator's own verdict


def test_an_agents_token_is_refused_what_only_the_operator_may_do(cluster: Cluster, tmp_path: Path) -> None:
    """deploy/'s RBAC on the real API server: the node agent's ServiceAccount may write its node and Lease, never
    a workload, a pod's life or a deep-check Job -- the operator's may."""
    name = submit(cluster, pytorchjob("rbac", tmp_path / "ckpt", steps=10, nodes=1))
    agent = api_client(cluster.agent_kubeconfig("gpu-a"))
    operator = api_client(cluster.operator_kubeconfig)
    patch = {"metadata": {"annotations": {names.JOB_PHASE: "Running"}}}

    def refused(call: Any) -> int | None:
        try:
            call()
        except kubernetes.client.ApiException as e:
            return e.status
        return None

    custom = kubernetes.client.CustomObjectsApi
    assert refused(lambda: custom(agent).patch_namespaced_custom_object("kubeflow.org", "v1", JOBS, "pytorchjobs", name, patch)) == 403
    pod = wait_until(lambda: cluster.pods(name), 60, "the job's pod")[0].metadata.name
    assert refused(lambda: kubernetes.client.CoreV1Api(agent).delete_namespaced_pod(pod, JOBS)) == 403
    job = {"metadata": {"name": "not-a-check"}, "spec": {"template": {"spec": {
        "restartPolicy": "Never", "containers": [{"name": "c", "image": "x", "command": ["true"]}]}}}}
    assert refused(lambda: kubernetes.client.BatchV1Api(agent).create_namespaced_job(SYSTEM, job)) == 403
    # ... and the operator's account may do each of these
    assert refused(lambda: custom(operator).patch_namespaced_custom_object("kubeflow.org", "v1", JOBS, "pytorchjobs", name,
                                                                           {"metadata": {"annotations": {"x.example/y": "z"}}})) is None
    assert refused(lambda: kubernetes.client.BatchV1Api(operator).create_namespaced_job(SYSTEM, job, dry_run="All")) is None
    assert refused(lambda: kubernetes.client.CoreV1Api(operator).delete_namespaced_pod(pod, JOBS, dry_run="All")) is None


def test_a_compromised_node_cannot_make_the_operator_run_a_command(cluster: Cluster, agents: Agents, tmp_path: Path) -> None:
    """What an intruder on gpu-a holds is its agent's token and gpu-a's own credentials: it tries to rewrite the cluster
    file's RemediationCommand (the command the operator runs on a fault), to plant its own Secret, to read the
    heartbeat master key, and to have the operator certify it as gpu-b, and is refused each. Then a real Xid 79
    in gpu-a's kernel log: the operator remediates with the administrator's command, and the intruder's never runs.
    The agents themselves, under the same policy, did their work throughout (their Leases, their own credentials from
    the operator, the fault write)."""
    from unbroken.health.xid_lines import xid_line

    cluster.start_operator()
    marker = tmp_path / "owned"
    config = yaml.safe_load(cluster_file(cluster.remediations))
    config["Kubernetes"]["RemediationCommand"] = ["sh", "-c", f"touch {marker}"]
    intruder = kubernetes.client.CoreV1Api(api_client(cluster.agent_kubeconfig("gpu-a")))
    with pytest.raises(kubernetes.client.ApiException) as refused:
        intruder.patch_namespaced_config_map(names.CLUSTER_CONFIGMAP, SYSTEM, {"data": {"cluster.yaml": yaml.safe_dump(config)}})
    assert refused.value.status == 403 and "only the checkpoint catalog" in str(refused.value.body), refused.value.body
    with pytest.raises(kubernetes.client.ApiException) as refused:
        intruder.create_namespaced_secret(SYSTEM, {"metadata": {"name": "unbroken-heartbeat-key-2"}, "stringData": {"key": "x"}})
    assert refused.value.status == 403
    with pytest.raises(kubernetes.client.ApiException) as refused:
        intruder.read_namespaced_secret("unbroken-heartbeat-key", SYSTEM)
    assert refused.value.status == 403

    # every agent was certified for its own node by the operator; gpu-a's token gets nothing for gpu-b
    for node in NODES:
        own = cluster.kubelet.node_dir(node) / AGENT_DIR.lstrip("/") / rank_env.CLUSTER_FOLDER / credentials.CERT_FILE
        wait_until(own.is_file, 30, f"{node}'s certificate from the operator")
        assert credentials.common_name(own.read_bytes()) == f"unbroken node {node}"
    published = kubernetes.client.CoordinationV1Api(cluster.api).read_namespaced_lease(names.LEADER_LEASE, SYSTEM).metadata.annotations
    address = heartbeats.parse_address(published[heartbeats.ADDRESS_ANNOTATION])
    assert address is not None
    with pytest.raises(node_credentials.Refused, match="the token is bound to node gpu-a, the request asks for 'gpu-b'"):
        node_credentials.request(address, published[names.CLUSTER_CA].encode(), node_credentials.bearer_token(intruder.api_client),
                                 "gpu-b", tmp_path / "stolen")

    with open(cluster.kubelet.node_dir("gpu-a") / "kmsg.log", "a") as kmsg:
        kmsg.write(xid_line(79, "PCI:0000:b9:00") + "\n")
    wait_until(lambda: "Replace gpu-a" in cluster.remediations.read_text(), 30, "the administrator's remediation command")
    assert not marker.exists(), "the intruder's command ran"
    assert cluster.remediations.read_text() == "Replace gpu-a\n"
    cluster.assert_clean()


def test_unusual_workloads_beside_a_healthy_job_never_stop_its_recovery(cluster: Cluster, tmp_path: Path) -> None:
    """One object unbroken cannot read or act on must never blind the operator to the others. Valid but unusual
    PyTorchJobs that opt in -- an elasticPolicy with HPA metrics (the SDK's models could not read it: the whole pass
    once failed on it), a Worker-only job, ``nprocPerNode: auto``, replicas as a stray label -- sit beside a healthy
    job; a rank of the healthy one is killed and it is restarted as usual, and the operator never fails a pass."""
    cluster.start_operator()
    unusual = []
    elastic = pytorchjob("elastic-hpa", tmp_path / "e", steps=5000, nodes=2, annotations=auto_resume(1))
    elastic["spec"]["elasticPolicy"] = {"minReplicas": 1, "maxReplicas": 2, "rdzvBackend": "c10d", "metrics": [
        {"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}}}]}
    unusual.append(elastic)
    worker_only = pytorchjob("workers-only", tmp_path / "w", steps=5000, nodes=2, annotations=auto_resume(1))
    worker_only["spec"]["pytorchReplicaSpecs"] = {"Worker": {**worker_only["spec"]["pytorchReplicaSpecs"]["Master"],
                                                             "replicas": 1}}
    unusual.append(worker_only)
    auto = pytorchjob("nproc-auto", tmp_path / "a", steps=5000, nodes=1, annotations=auto_resume(1))
    auto["spec"]["nprocPerNode"] = "auto"
    unusual.append(auto)
    for body in unusual:
        for replica in body["spec"]["pytorchReplicaSpecs"].values():
            replica["template"]["spec"]["nodeSelector"] = {"no-such-node": "true"}  # they stay Pending: the GPUs are the healthy job's
        submit(cluster, body)
    checkpoints = tmp_path / "ckpt"
    name = running_with_a_checkpoint(cluster, pytorchjob("healthy", checkpoints, steps=400, annotations=auto_resume(2)), checkpoints)

    rank_process(cluster, f"{name}-worker-0").send_signal(signal.SIGKILL)

    wait_until(lambda: cluster.annotations(name).get(names.RESTART_COUNT) == "1", 60, "the healthy job's restart")
    wait_until(lambda: cluster.annotations(name).get(names.JOB_PHASE) == "Running", 60, "attempt 1 running")
    for body in unusual:  # each one adopted (or warned about by name), none stopping the pass
        job = body["metadata"]["name"]
        assert cluster.annotations(job).get(names.JOB_PHASE) or [e for e in cluster.events(job) if e[0] == "Warning"], job
    assert "reconcile pass failed" not in cluster.operator_log()


# --- liveness through disruptions (controller/liveness.py, kubernetes/backend/heartbeats.py) ----------------------


def hearing_every_node(cluster: Cluster) -> None:
    """Until the operator logs a datagram heard from every node (the agents read its address from the
    leader Lease at their next Lease renewal: within LeaseRenewSeconds of its start)."""
    log_path = cluster.workdir / "operator.log"
    wait_until(lambda: all(f'"node": "{n}"' in line for n in NODES for line in [
        "\n".join(l for l in log_path.read_text(errors="replace").splitlines() if "hearing a node" in l)]),
        30, "the operator to hear every agent's heartbeat datagrams")


def cluster_events(cluster: Cluster) -> list[str]:
    """Reasons of unbroken's cluster-wide Events (on its ConfigMap), oldest first."""
    items = cluster.core.list_namespaced_event(SYSTEM, field_selector=f"involvedObject.name={names.CLUSTER_CONFIGMAP}").items
    items.sort(key=lambda e: float((e.metadata.annotations or {}).get(f"{names.PREFIX}/time", 0)))
    return [e.reason for e in items]


def faulty_nodes(cluster: Cluster) -> list[str]:
    return [n.metadata.name for n in cluster.core.list_node().items if names.FAULT_TYPES in (n.metadata.labels or {})]


def untouched_for(cluster: Cluster, name: str, seconds: float, what: str) -> None:
    """For ``seconds`` (the disruption's length: what is tested is that nothing happens meanwhile), poll that
    no node is taken out and the job is not restarted."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        assert faulty_nodes(cluster) == [], f"{what}: a node was taken out"
        assert "JobRestarting" not in cluster.reasons(name), f"{what}: the job was restarted: {cluster.events(name)}"
        time.sleep(0.5)  # the poll's period, not a synchronisation: the condition is checked every round


def test_every_agent_paused_8_s_mid_job_loses_no_node_and_restarts_nothing(cluster: Cluster, agents: Agents,
                                                                          tmp_path: Path) -> None:
    """Every agent SIGSTOPped for 8 s (a stalled host, a slow rolling update): the operator hears no node for
    twice NodeLostAfterSeconds. The disruption guard holds (an Event says so), the job trains on, nothing is
    restarted or remediated; when the agents resume the hold lifts, and a node killed afterwards is lost as usual."""
    cluster.start_operator()
    checkpoints = tmp_path / "ckpt"
    name = running_with_a_checkpoint(cluster, pytorchjob("paused", checkpoints, steps=3000, annotations=auto_resume(3)), checkpoints)
    hearing_every_node(cluster)

    for proc in agents.values():
        os.kill(proc.pid, signal.SIGSTOP)
    paused = time.monotonic()
    try:
        wait_until(lambda: "LivenessHold" in cluster_events(cluster), 15, "the operator to hold")
        untouched_for(cluster, name, 8 - (time.monotonic() - paused), "agents paused")
    finally:
        for proc in agents.values():
            os.kill(proc.pid, signal.SIGCONT)
    wait_until(lambda: "LivenessHoldLifted" in cluster_events(cluster), 15, "the hold to lift")
    stepping = max(checkpoint_steps(checkpoints))
    wait_until(lambda: max(checkpoint_steps(checkpoints)) > stepping, 30, "the job to keep training")
    assert faulty_nodes(cluster) == [] and "JobRestarting" not in cluster.reasons(name)

    dead = cluster.core.read_namespaced_pod(f"{name}-worker-0", JOBS).spec.node_name
    cluster.kubelet.fail_node(dead)  # the machine dies, and its agent with it
    agents[dead].kill()
    wait_until(lambda: faulty_nodes(cluster) == [dead], 30, "the killed node to be lost as usual")
    wait_until(lambda: "JobRestarting" in cluster.reasons(name), 30, "the job to restart")


def test_an_api_server_down_30_s_mid_job_loses_no_node_and_restarts_nothing_and_a_later_restart_is_followed(cluster: Cluster, agents: Agents,
                                                                            tmp_path: Path) -> None:
    """kube-apiserver killed for 30 s mid-job: the agents' datagrams keep reaching the operator (they do not go
    through the API server), the ranks keep training, the operator decides nothing while it cannot confirm its
    leadership, and when the server is back nothing is restarted or taken out; then a killed rank restarts the
    job as usual, and unbroken follows the relaunch: its pods come back and train, or it says what they wait for."""
    cluster.start_operator()
    checkpoints = tmp_path / "ckpt"
    name = running_with_a_checkpoint(cluster, pytorchjob("outage", checkpoints, steps=3000, annotations=auto_resume(3)), checkpoints)
    hearing_every_node(cluster)
    before = max(checkpoint_steps(checkpoints))

    cluster.plane.stop_apiserver()
    down = time.monotonic()
    try:
        while time.monotonic() - down < 30:  # the outage's length; the ranks must live through it
            assert rank_process(cluster, f"{name}-master-0").is_running()
            time.sleep(1)
    finally:
        cluster.plane.start_apiserver()
    assert max(checkpoint_steps(checkpoints)) > before, "the job trained through the outage"
    untouched_for(cluster, name, 15, "after the API server came back")
    # The datagrams never stopped, but Kubernetes' node lifecycle controller, seeing no kubelet Lease renewed
    # for longer than its grace period, may mark every node NotReady for a moment when the server is back (a
    # real cluster does the same after an outage longer than --node-monitor-grace-period): that is most nodes
    # silent at once, and the guard holds until the kubelets' next renewals. Either way no hold is left.
    wait_until(lambda: (events := cluster_events(cluster)).count("LivenessHold") == events.count("LivenessHoldLifted"),
               30, "no hold in force")

    rank_process(cluster, f"{name}-worker-0").send_signal(signal.SIGKILL)
    wait_until(lambda: cluster.annotations(name).get(names.RESTART_COUNT) == "1", 60, "a killed rank to restart the job")
    # Followed to its first step: the recreated pods come back and train, or unbroken says what the attempt waits
    # for. Both happen here: training-operator, whose informers lived through the outage, has created the pods
    # ~20-30 s late (unbroken then names it and sends the launch once more), and kube-scheduler has logged "Scheduler
    # cache is corrupted" and left them unplaced (the control plane's own trouble after an API-server restart, as on
    # a real cluster; unbroken cannot mend it, only say it).
    def followed() -> bool:
        return resumed_as(cluster, name, 1) or any(r == "AttemptWaiting" for _, r, _ in cluster.events(name))
    wait_until(followed, 90, "attempt 1 to resume after the outage, or unbroken to say what it waits for")
    waits = [m for _, r, m in cluster.events(name) if r == "AttemptWaiting"]
    assert resumed_as(cluster, name, 1) or all("attempt 1, " in m for m in waits), waits


def test_a_rolling_restart_of_the_agents_loses_no_node(cluster: Cluster, agents: Agents, tmp_path: Path) -> None:
    """The agent DaemonSet updated one node at a time: each agent gets SIGTERM (it says it is leaving) and its
    successor starts 6 s later, longer than NodeLostAfterSeconds. No node is lost and the job is not restarted."""
    cluster.start_operator()
    checkpoints = tmp_path / "ckpt"
    name = running_with_a_checkpoint(cluster, pytorchjob("rolling", checkpoints, steps=3000, annotations=auto_resume(3)), checkpoints)
    hearing_every_node(cluster)
    for node in NODES:
        stop_process(agents[node], sig=signal.SIGTERM, timeout=15)
        untouched_for(cluster, name, 6, f"the agent on {node} restarting")
        agents[node] = start_agent(cluster, node)
    untouched_for(cluster, name, 6, "after the rolling restart")


@dataclass
class CuttableAddress:
    """An address of this machine that a test can take away and give back, on one end of a veth pair made for the
    test. While it is gone, datagrams sent to it are routed off the machine and lost; a socket bound to it stays
    bound and hears again when it is back: a real cut of a path (no tc action or netfilter module is loaded on
    these machines)."""

    address: str
    link: str

    def cut(self) -> None:
        subprocess.run(["ip", "addr", "del", f"{self.address}/32", "dev", self.link], check=True)

    def restore(self) -> None:
        subprocess.run(["ip", "addr", "add", f"{self.address}/32", "dev", self.link], check=True)


@pytest.fixture
def heartbeat_path() -> Iterator[CuttableAddress]:
    link = f"ubhb{uuid.uuid4().hex[:6]}"
    path = CuttableAddress(f"10.251.{int(link[-4:-2], 16)}.{int(link[-2:], 16) % 254 + 1}", link)
    subprocess.run(["ip", "link", "add", link, "type", "veth", "peer", "name", f"{link}p"], check=True)
    try:
        path.restore()
        subprocess.run(["ip", "link", "set", link, "up"], check=True)
        yield path
    finally:
        subprocess.run(["ip", "link", "del", link], check=False)


def heartbeats_accepted(cluster: Cluster) -> float:
    """The operator's unbroken_heartbeats_total{outcome="accepted"}, from its /metrics."""
    address = json.loads(next(line for line in cluster.operator_log().splitlines() if '"serving metrics"' in line))["address"]
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('unbroken_heartbeats_total{outcome="accepted"}'))


def test_the_agents_datagrams_cut_off_for_30_s_lose_no_node_and_restart_nothing(
        cluster: Cluster, agents: Agents, tmp_path: Path, heartbeat_path: CuttableAddress) -> None:
    """The address the operator hears heartbeats on goes away for 30 s (a partition between the agents and the
    operator; the API server still reachable): the operator hears no datagram (checked on its own counter), the
    agents' Leases vouch for their nodes, the job trains on and nothing is restarted or taken out; when the path
    is back the datagrams are heard again, and a node killed afterwards is lost as usual."""
    cluster.start_operator(heartbeat_host=heartbeat_path.address)
    checkpoints = tmp_path / "ckpt"
    name = running_with_a_checkpoint(cluster, pytorchjob("partition", checkpoints, steps=3000, annotations=auto_resume(3)),
                                     checkpoints)
    hearing_every_node(cluster)
    before = max(checkpoint_steps(checkpoints))

    heartbeat_path.cut()
    try:
        heard = heartbeats_accepted(cluster)
        untouched_for(cluster, name, 30, "datagrams cut off")
        assert heartbeats_accepted(cluster) == heard, "a datagram got through the cut"
    finally:
        heartbeat_path.restore()
    assert max(checkpoint_steps(checkpoints)) > before, "the job trained through the partition"
    heard = heartbeats_accepted(cluster)
    wait_until(lambda: heartbeats_accepted(cluster) >= heard + 2 * len(NODES), 15, "the datagrams to be heard again")
    assert faulty_nodes(cluster) == [] and "JobRestarting" not in cluster.reasons(name)

    dead = cluster.core.read_namespaced_pod(f"{name}-worker-0", JOBS).spec.node_name
    cluster.kubelet.fail_node(dead)
    agents[dead].kill()
    wait_until(lambda: faulty_nodes(cluster) == [dead], 30, "the killed node to be lost as usual")
    wait_until(lambda: "JobRestarting" in cluster.reasons(name), 30, "the job to restart")


# --- Kueue ---------------------------------------------------------------------------------------


def kueue_queue(cluster: Cluster, *, hold: bool) -> None:
    """A ResourceFlavor, a ClusterQueue with room for the three GPUs (its stopPolicy ``Hold`` while ``hold``: it admits
    nothing new) and the LocalQueue ``team-a`` in the jobs' namespace, as a platform team sets Kueue up."""
    quota = [{"name": name, "nominalQuota": amount} for name, amount in (("cpu", "64"), ("memory", "256Gi"), ("nvidia.com/gpu", "3"))]
    cluster.plane.apply([
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "default"}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": "gpus"},
         "spec": {"namespaceSelector": {}, "stopPolicy": "Hold" if hold else "None", "resourceGroups": [
             {"coveredResources": ["cpu", "memory", "nvidia.com/gpu"], "flavors": [{"name": "default", "resources": quota}]}]}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "team-a", "namespace": JOBS},
         "spec": {"clusterQueue": "gpus"}},
    ])


def kueue_workload(cluster: Cluster, name: str) -> dict[str, Any] | None:
    """The Kueue Workload of the PyTorchJob ``name`` (by its uid), None while Kueue has made none."""
    uid = cluster.job(name)["metadata"]["uid"]
    items = cluster.custom.list_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", JOBS, "workloads",
                                                         label_selector=f"kueue.x-k8s.io/job-uid={uid}")["items"]
    return items[0] if items else None


def admitted(workload: dict[str, Any] | None) -> bool:
    return workload is not None and any(c["type"] == "Admitted" and c["status"] == "True"
                                        for c in (workload.get("status") or {}).get("conditions") or [])


@pytest.mark.kueue
def test_a_job_kueue_holds_is_left_held_and_once_admitted_restarts_without_leaving_its_queue(cluster: Cluster,
                                                                                            tmp_path: Path) -> None:
    """Real Kueue: its webhook suspends a PyTorchJob labelled with a LocalQueue, and it unsuspends the job once the
    ClusterQueue admits it. An opted-in job on a queue that admits nothing yet stays suspended with no pod, Pending
    with the queue named (unbroken once unsuspended it, bypassing the queue). Given room, Kueue starts it; a killed
    rank restarts it without a suspension (Kueue unsuspends an admitted job at once, so unbroken marks the next attempt
    and deletes the pods), its Workload stays admitted throughout, and it resumes and completes. A queued job that
    fails for good is taken off its queue: its Workload deactivated, no pod left."""
    kueue_queue(cluster, hold=True)
    cluster.start_operator()
    checkpoints = tmp_path / "ckpt"
    body = pytorchjob("queued", checkpoints, steps=400, annotations=auto_resume(2))
    body["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    name = submit(cluster, body)
    wait_until(lambda: "JobHeld" in cluster.reasons(name), 30, "unbroken to see the job held")
    held = next(m for _, r, m in cluster.events(name) if r == "JobHeld")
    assert "until Kueue admits it from queue team-a" in held, held
    until = time.monotonic() + 5
    while time.monotonic() < until:  # held: nothing may start it meanwhile
        assert cluster.job(name)["spec"]["runPolicy"]["suspend"] is True and not cluster.pods(name)
        time.sleep(0.5)  # the poll's period, not a synchronisation

    kueue_queue(cluster, hold=False)  # the queue admits it: Kueue unsuspends it
    wait_until(lambda: admitted(kueue_workload(cluster, name)), 30, "Kueue to admit the job")
    wait_until(lambda: cluster.annotations(name).get(names.JOB_PHASE) == "Running", 60, "unbroken to adopt the admitted job")
    wait_until(lambda: any(s >= 10 for s in checkpoint_steps(checkpoints)), 120, "a checkpoint at step 10")
    workload = kueue_workload(cluster, name)
    assert workload is not None
    rank_process(cluster, f"{name}-worker-0").send_signal(signal.SIGKILL)
    wait_until(lambda: cluster.annotations(name).get(names.RESTART_COUNT) == "1", 30, "unbroken's restart")
    wait_for_job(cluster, name, lambda: resumed_as(cluster, name, 1), 120, "attempt 1 to resume")
    after = kueue_workload(cluster, name)
    assert after is not None and after["metadata"]["uid"] == workload["metadata"]["uid"] and admitted(after), \
        "the job kept its admission: it never went back to wait in the queue"
    wait_until(lambda: cluster.annotations(name).get(names.JOB_PHASE) == "Succeeded", 180, "the job to finish")

    failing = pytorchjob("queued-fails", tmp_path / "ckpt2", steps=4000, annotations=auto_resume(0))
    failing["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    failed = submit(cluster, failing)
    wait_until(lambda: cluster.annotations(failed).get(names.JOB_PHASE) == "Running", 60, "the second job admitted and adopted")
    rank_process(cluster, f"{failed}-worker-0").send_signal(signal.SIGKILL)
    wait_until(lambda: cluster.annotations(failed).get(names.JOB_PHASE) == "Failed", 30, "the job failed for good")
    wait_until(lambda: (w := kueue_workload(cluster, failed)) is not None and w["spec"].get("active") is False, 30,
               "its Workload deactivated")
    wait_until(lambda: not cluster.pods(failed), 60, "no pod of the failed job left")
    assert cluster.job(failed)["spec"]["runPolicy"]["suspend"] is True
