"""Health checks on real local clusters: kernel-log faults (Xid, NPD rules), hung checks, deep checks on join."""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from unbroken.plumbing.waiting import wait_until

from unbroken.plumbing import procs
from unbroken.state.phases import DeepHealthStatus, NodeState

FIXTURE = Path(__file__).parent.parent / "fixtures" / "npd-kernel-monitor.json"


def _events(cluster, node: str, reason: str | None = None):
    return cluster.store.list_events(object_kind="Node", object_name=node, reason=reason)


def test_xid_79_replaces_the_node_and_the_job_resumes_xid_13_is_only_an_event_npd_rule_fires(make_cluster, tmp_path):
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "ClusterName": "xid", "InstanceGroups": [{"InstanceGroupName": "gpu", "InstanceCount": 3}],
        "Health": {"RuleFiles": [str(FIXTURE)]},
    }))
    cluster = make_cluster("-f", str(config))
    cluster.submit(tmp_path, "train", nodes=2, procs=1, steps=100_000, step_time=0.05)
    cluster.wait_step("train", 3, 120)
    first, second = sorted(w.node for w in cluster.workers("train", 0))

    # Xid 13 (application-level): an event, the node stays in service, the job is untouched
    cluster.cli("chaos", "xid", first, "13")
    warning = wait_until(lambda: _events(cluster, first, "HealthCheckWarning"), 5, f"Xid 13 event on {first}")[0]
    assert "Xid 13 (Graphics engine exception)" in warning.message
    assert cluster.store.get_node(first).state is NodeState.SCHEDULABLE and cluster.job("train").attempt == 0

    # Xid 79 (fallen off the bus): UnschedulablePendingReplacement, the job resumes on the spare.
    # How fast is the benchmarks' business (docs/health.md); here: what happens, and in which order.
    injected = time.time()
    cluster.cli("chaos", "xid", second, "79")
    faulted = wait_until(lambda: (n := cluster.store.get_node(second)).fault_type == "FaultyInstance" and n, 30,
                         f"{second} faulted by Xid 79")
    detected = time.time() - injected
    assert "Xid 79 (GPU has fallen off the bus) on PCI:0000:b9:00" in faulted.fault_reason
    fault_event = _events(cluster, second, "FaultyInstance")[0]
    chaos_event = _events(cluster, second, "ChaosXid")[0]
    assert fault_event.message.endswith("-> UnschedulablePendingReplacement")
    assert chaos_event.id < fault_event.id, "the fault follows the kernel-log line that caused it"
    listed = {n["name"]: n for n in cluster.json("node", "list", "--all")}[second]
    assert listed["fault_type"] == "FaultyInstance" and "Xid 79" in listed["fault_reason"]
    assert listed["deep_health_check_status"] == "Passed"
    assert listed["health_status"] in ("UnschedulablePendingReplacement",)  # Retired shows the same label

    cluster.wait_step("train", 1, 120, attempt=1)
    resumed_after = time.time() - injected
    resumed_on = {w.node for w in cluster.workers("train", 1)}
    assert second not in resumed_on and first in resumed_on
    job_events = cluster.json("job", "describe", "train")["events"]
    assert any(e["reason"] == "NodeFault" and "Xid 79" in e["message"] for e in job_events)
    print(f"\nXid 79 -> {faulted.state.value}: {detected:.2f} s (event {fault_event.ts - injected:.2f} s); "
          f"job resumed (first step of attempt 1): {resumed_after:.1f} s")

    # an NPD rule file from the cluster file fires: a permanent KernelDeadlock rule asks for a reboot
    replacement = wait_until(lambda: cluster.store.get_node(second).replaced_by, 30, f"{second} replaced")
    wait_until(lambda: cluster.store.get_node(replacement).state is NodeState.SCHEDULABLE, 60, f"{replacement} joins")
    line = "INFO: task docker:2301 blocked for more than 120 seconds."
    with open(cluster.layout.kernel_log(replacement), "a") as f:
        f.write(line + "\n")
    reboot = wait_until(lambda: _events(cluster, replacement, "RebootRequired"), 5, "KernelDeadlock reboot")[0]
    assert "KernelDeadlock: DockerHung: task docker:2301 blocked" in reboot.message
    wait_until(lambda: (n := cluster.store.get_node(replacement)).reboots == 1 and n.state is NodeState.SCHEDULABLE, 60,
             f"{replacement} rebooted and back")
    cluster.cli("job", "cancel", "train")


HANG = "import time\n\ndef hang(ctx):\n    time.sleep(3600)\n"


def test_a_hung_check_is_fail_timeout_within_its_timeout_and_the_agent_keeps_working(make_cluster, tmp_path):
    check = tmp_path / "site_checks.py"
    check.write_text(HANG)
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "ClusterName": "hang", "NodeRecovery": "None", "InstanceGroups": [{"InstanceGroupName": "g", "InstanceCount": 1}],
        "Health": {"MonitorIntervalSeconds": 1,
                   "CustomChecks": [{"Id": "site.hang", "Suites": ["Continuous"], "Target": f"{check}:hang", "TimeoutSeconds": 2}]},
    }))
    cluster = make_cluster("-f", str(config))
    failed = wait_until(lambda: [e for e in _events(cluster, "node-1", "HealthCheckFailed") if "site.hang" in e.message],
                      20, "site.hang failed")[0]
    assert "site.hang: Fail: FaultyInstance detected. Replace the instance. did not finish within its timeout of 2 s" in failed.message
    node = wait_until(lambda: (n := cluster.store.get_node("node-1")).state is NodeState.PENDING_REPLACEMENT and n, 5, "node out")
    assert node.fault_type == "FaultyInstance" and "site.hang" in node.fault_reason
    # the agent is alive and heartbeating well after the hung check was killed
    wait_until(lambda: (cluster.store.get_node("node-1").heartbeat_at or 0) > failed.ts + 2, 10, "heartbeats go on")
    assert procs.alive(node.agent_pid)
    lines = [json.loads(line) for line in cluster.layout.agent_log("node-1").read_text().splitlines() if line.startswith("{")]
    hung = next(entry for entry in lines if entry.get("check") == "site.hang" and entry.get("reason") == "Timeout")
    assert hung["level"] == "error" and hung["status"] == "Fail", hung
    assert hung["duration_s"] >= 2.0, "killed at its timeout, not before"


def test_deep_checks_on_join_pass_healthy_nodes_and_take_out_a_slow_one(make_cluster, tmp_path):
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "ClusterName": "deep", "NodeRecovery": "None",
        "InstanceGroups": [
            {"InstanceGroupName": "good", "InstanceCount": 2, "OnStartDeepHealthChecks": ["InstanceStress", "InstanceConnectivity"]},
            {"InstanceGroupName": "bad", "InstanceCount": 1, "InstanceType": "cpu-slow", "OnStartDeepHealthChecks": ["InstanceStress"]},
        ],
        # a profile no CPU meets: the real measurement must fail it
        "Health": {"Profiles": {"cpu-slow": {"MatmulFloor": 1e9, "MemoryBandwidthFloorGBps": 0.5, "BusBwFloorGBps": 0.1}}},
    }))
    cluster = make_cluster("-f", str(config))
    nodes = {n["name"]: n for n in cluster.json("node", "list")}
    good = [n for n in nodes.values() if n["group"] == "good"]
    bad = next(n for n in nodes.values() if n["group"] == "bad")
    assert [(n["state"], n["deep_health_check_status"]) for n in good] == [("Schedulable", "Passed")] * 2
    assert (bad["health_status"], bad["deep_health_check_status"], bad["fault_type"]) == (
        "UnschedulablePendingReplacement", "Failed", "FaultyInstance")
    assert "stress.matmul: matmul below threshold on cpu: expected >= 1e+09 GFLOP/s" in bad["fault_reason"]
    for node in good:
        passed = {e.message.split(":")[0] for e in _events(cluster, node["name"], "HealthCheckPassed")}
        assert {"stress.matmul", "stress.membw", "storage.checkpoint", "collective.allreduce"} <= passed, passed
    assert cluster.store.get_node(bad["name"]).deep_health is DeepHealthStatus.FAILED


def test_validate_prints_one_verdict_per_node_and_runs_a_real_job(make_cluster, kjv_tokens):
    """The burn-in is the LLM workload (FSDP2 across both nodes); the default MLP one is the same code path."""
    cluster = make_cluster("--nodes", "2")
    verdicts = json.loads(cluster.cli("validate", "-o", "json", "--steps", "10", "--workload", "llm", "--data", str(kjv_tokens),
                                      timeout=300).stdout)
    assert [(v["node"], v["verdict"], v["stress"], v["collective"], v["training"], v["devices"]) for v in verdicts] == [
        ("node-1", "Pass", "Pass", "Pass", "Pass", "Skip"), ("node-2", "Pass", "Pass", "Pass", "Pass", "Skip")]
    job = next(j for j in cluster.store.list_jobs() if j.name.startswith("validate-"))
    assert job.phase.value == "Succeeded" and "unbroken.workloads.llm" in job.spec().command
    listed = cluster.json("check", "list")
    assert {c["id"] for c in listed} >= {"devices.inventory", "stress.matmul", "collective.allreduce", "storage.checkpoint"}
