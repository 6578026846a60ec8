"""Node recovery by hand and by policy, the CLI's read views, plain torchrun, and the demo."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import yaml

from helpers import run_cli

from unbroken.plumbing.waiting import wait_until

from unbroken.plumbing import procs
from unbroken.state.phases import DeepHealthStatus, NodeState


def test_manual_reboot_and_replace(make_cluster):
    cluster = make_cluster("--nodes", "2")
    before = cluster.store.get_node("node-1").agent_pid
    cluster.cli("node", "reboot", "node-1")
    rebooted = wait_until(lambda: (n := cluster.store.get_node("node-1")).state is NodeState.SCHEDULABLE and n.reboots == 1 and n,
                        60, "node-1 back after reboot")
    assert rebooted.agent_pid != before and not procs.alive(before)
    assert rebooted.deep_health is DeepHealthStatus.PASSED
    reasons = [e.reason for e in cluster.store.list_events(object_kind="Node", object_name="node-1")]
    assert reasons.index("NodeRebootRequested") < reasons.index("NodeRebooting") < len(reasons) - 1

    old_pid = cluster.store.get_node("node-2").agent_pid
    cluster.cli("node", "replace", "node-2")
    replacement = wait_until(lambda: cluster.store.get_node("node-2").replaced_by, 30, "node-2 replaced")
    wait_until(lambda: cluster.store.get_node(replacement).state is NodeState.SCHEDULABLE, 60, f"{replacement} joins")
    assert cluster.store.get_node("node-2").state is NodeState.RETIRED and not procs.alive(old_pid)
    listed = cluster.json("node", "list")
    assert [n["name"] for n in listed] == ["node-1", replacement]
    assert {n["name"] for n in cluster.json("node", "list", "--all")} == {"node-1", "node-2", replacement}


def test_without_automatic_recovery_a_lost_node_waits_for_the_operator(make_cluster, tmp_path):
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "ClusterName": "manual", "NodeRecovery": "None",
        "InstanceGroups": [{"InstanceGroupName": "gpu", "InstanceCount": 2}],
        "Local": {"HeartbeatIntervalSeconds": 1, "NodeLostAfterSeconds": 3},
    }))
    cluster = make_cluster("-f", str(config))
    os.kill(cluster.store.get_node("node-2").agent_pid, signal.SIGKILL)
    lost = wait_until(lambda: (n := cluster.store.get_node("node-2")).state is NodeState.PENDING_REPLACEMENT and n,
                    20, "node-2 pending replacement")
    assert lost.fault_type == "NodeLost"
    described = cluster.json("node", "describe", "node-2")
    assert described["labels"]["unbroken.dev/node-health-status"] == "UnschedulablePendingReplacement"
    assert described["labels"]["unbroken.dev/fault-type"] == "NodeLost"
    # NodeRecovery None: several controller passes later there is still no replacement...
    wait_until(lambda: any(e.reason == "NodeLost" for e in cluster.store.list_events(object_kind="Node", object_name="node-2")),
             5, "NodeLost event")
    assert len(cluster.store.list_nodes()) == 2
    # ...until the operator asks for one.
    cluster.cli("node", "replace", "node-2")
    replacement = wait_until(lambda: cluster.store.get_node("node-2").replaced_by, 30, "node-2 replaced by hand")
    assert cluster.store.get_node(replacement).group == "gpu"


def test_cordon_keeps_running_work_but_takes_no_new_work(make_cluster, tmp_path):
    cluster = make_cluster("--nodes", "2")
    cluster.cli("node", "cordon", "node-2")
    cluster.submit(tmp_path, "solo", nodes=2, steps=20)
    wait_until(lambda: "needs 2" in (cluster.job("solo").reason or ""), 10, "job waits for 2 schedulable nodes")
    assert cluster.job("solo").phase.value == "Pending"
    cluster.cli("node", "uncordon", "node-2")
    job = cluster.wait_job_phase("solo", {"Succeeded", "Failed"}, 180)
    assert job.phase.value == "Succeeded", job.reason


def test_read_views_logs_and_cancel(make_cluster, tmp_path):
    cluster = make_cluster("--nodes", "2")
    cluster.submit(tmp_path, "views", steps=100_000, step_time=0.05)
    cluster.wait_step("views", 3, 120)
    status = cluster.json("cluster", "status")
    assert status["up"] and status["controller_pid"] and status["nodes"] == {"Schedulable": 2}
    jobs = cluster.json("job", "list")
    assert jobs[0]["name"] == "views" and jobs[0]["phase"] == "Running" and jobs[0]["nodes"] == ["node-1", "node-2"]
    nodes = {n["name"]: n for n in cluster.json("node", "list")}
    assert nodes["node-1"]["job"] == "views" and nodes["node-1"]["deep_health_check_status"] == "Passed"
    text = cluster.cli("job", "list").stdout
    assert "views" in text and "Running" in text

    node_logs = cluster.cli("job", "logs", "views", "--node", "node-2").stdout
    assert "[node-2 torchrun]" in node_logs or "[node-2 rank" in node_logs
    wait_until(lambda: "first step" in cluster.cli("job", "logs", "views", "--rank", "3").stdout, 30, "rank 3 log")
    # Rank logs are JSON lines a log shipper reads without a pattern, tagged with where they came from.
    worker = cluster.workers("views", 0)[0]
    stdout_files = list(cluster.layout.worker_log_dir("views", 0, worker.node).glob("*/attempt_*/*/stdout.log"))
    assert stdout_files
    records = [json.loads(line) for path in stdout_files for line in path.read_text().splitlines() if line.strip()]
    first = next(r for r in records if "first step" in r["msg"])
    assert {k: first[k] for k in ("component", "job", "node", "attempt")} == {
        "component": "rank", "job": "views", "node": worker.node, "attempt": 0}
    assert isinstance(first["rank"], int) and isinstance(first["step"], int) and first["level"] == "info" and first["ts"]
    bad = cluster.cli("job", "logs", "views", "--rank", "9", check=False)
    assert bad.returncode == 2 and "no rank 9" in bad.stderr

    follower = subprocess.Popen([sys.executable, "-m", "unbroken", "job", "logs", "views", "--rank", "0", "-f"],
                                env={**os.environ, "UNBROKEN_DIR": str(cluster.dir)}, stdout=subprocess.PIPE, text=True)
    cluster.cli("job", "cancel", "views")
    out, _ = follower.communicate(timeout=60)
    # c10d rendezvous assigns global ranks in arrival order, so rank 0 may live on either node
    assert follower.returncode == 0 and re.search(r"^\[node-[12] rank 0\] ", out, re.MULTILINE), out[-2000:]
    job = cluster.wait_job_phase("views", {"Cancelled"}, 30)
    assert job.reason == "cancelled by user"
    wait_until(lambda: not [p for p in procs.cluster_processes(cluster.dir) if procs.environ(p).get("UNBROKEN_JOB") == "views"],
             20, "cancelled job's processes gone")
    again = cluster.cli("job", "cancel", "views", check=False)
    assert again.returncode == 2 and "already ended" in again.stderr


def test_training_script_runs_under_plain_torchrun(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
    env["UNBROKEN_CHECKPOINT_DIR"] = str(tmp_path / "ckpt")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "unbroken.workloads.mlp",
         "--steps", "20", "--checkpoint-every", "10"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done: 20 steps" in result.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-000000010", "step-000000020"]


def test_demo_completes_and_prints_the_summary_again_when_run_again(tmp_path):
    # Twice in one directory (`make demo` twice): the second must not resume from the first one's checkpoints
    # (its persistent tier holds steps 50 to 150, all past the second run's last step). The second is
    # shorter: the fault still comes after two checkpoints.
    for run, steps in ((1, 150), (2, 60)):
        result = run_cli("demo", "--steps", str(steps), "--dir", str(tmp_path / "demo"), timeout=400)
        out = result.stdout
        for expected in ("demo summary", "Succeeded", "fault -> first step after resume", "goodput", "NodeReplaced",
                         "cluster torn down (no process left)"):
            assert expected in out, f"run {run}: {expected!r} missing from:\n{out}"
        assert re.search(r"#0 on \S+ from step 0;", out), f"run {run}: attempt 0 did not start afresh:\n{out}"
        assert not procs.cluster_processes(tmp_path / "demo")


def test_job_start_wait_exits_0_on_success_and_1_on_failure(make_cluster, tmp_path):
    cluster = make_cluster("--nodes", "1")
    ok = tmp_path / "ok.yaml"
    ok.write_text(yaml.safe_dump({"name": "ok", "command": ["-m", "unbroken.workloads.mlp", "--steps", "5"]}))
    done = cluster.cli("job", "start", "-f", str(ok), "--wait", "--steps", "5")
    assert "Succeeded" in done.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"name": "bad", "command": ["-m", "unbroken.workloads.mlp", "--steps", "5",
                                                              "--crash-at-step", "2"]}))
    failed = cluster.cli("job", "start", "-f", str(bad), "--wait", check=False)
    assert failed.returncode == 1 and "Failed" in failed.stdout
    assert "exited with code 3" in cluster.job("bad").reason
