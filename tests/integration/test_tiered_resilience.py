"""The foundation's recovery promises again, with the tiered checkpoint as the job's checkpoint.

Real clusters, real ranks writing shared memory, real replicas over the
authenticated peer protocol, a real file:// persistent tier. Final parameters
must equal the uninterrupted reference run bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from helpers import STEPS, Cluster, assert_same_parameters

from unbroken.state.records import CheckpointTier, StepStatus


def tiers(tmp: Path, name: str, **persistent: Any) -> dict[str, Any]:
    return {
        "memory": {"keep": 2, "replicas": 1},
        "persistent": {"uri": f"file://{tmp / (name + '-persistent')}", "every_steps": 20, **persistent},
    }


def restore_sources(cluster: Cluster, job: str, attempt: int) -> list[str]:
    """What each rank of ``attempt`` printed about where it restored from."""
    lines = []
    for worker in cluster.workers(job, attempt):
        for log in Path(worker.log_dir or "").rglob("stdout.log"):
            lines += [line for line in log.read_text().splitlines() if line.startswith("unbroken: restored step")]
    return lines


def test_kill_9_worker_resumes_from_shared_memory_bit_identical(cluster3, tmp_path, reference):
    output = cluster3.submit(tmp_path, "tk9", steps=STEPS, step_time=0.1, checkpoint=tiers(tmp_path, "tk9"))
    cluster3.wait_step("tk9", 25, 120)
    cluster3.cli("chaos", "kill-worker", "tk9", "--rank", "3")
    job = cluster3.wait_job_phase("tk9", {"Succeeded", "Failed"}, 180)
    assert job.phase.value == "Succeeded", job.reason
    assert job.attempt == 1
    report = cluster3.json("job", "describe", "tk9")["report"]
    assert report["attempts"][1]["restored_step"] >= 20, report
    sources = restore_sources(cluster3, "tk9", 1)
    assert len(sources) == 4, sources
    assert not [s for s in sources if "persistent" in s], f"memory tier should have served every rank: {sources}"
    assert_same_parameters(reference, output)
    # the persistent tier got its steps too, and they verify
    steps = cluster3.store.list_checkpoint_steps("tk9", tier=CheckpointTier.PERSISTENT)
    assert any(s.status is StepStatus.COMMITTED for s in steps), steps
    verify = cluster3.cli("ckpt", "verify", "tk9", "-o", "json", check=False)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    report = json.loads(verify.stdout)
    assert report["ok"] is True
    checks = report["checks"]
    assert checks and all(c["ok"] is True for c in checks), [c for c in checks if c["ok"] is not True]
    persistent = {(c["step"], c["rank"]) for c in checks if c["tier"] == "persistent"}
    committed = {s.step for s in steps if s.status is StepStatus.COMMITTED}
    assert persistent == {(step, rank) for step in committed for rank in range(4)}, "every rank of every committed step was read back"


def test_lost_node_ranks_restore_from_replicas_on_peers(cluster3, tmp_path, reference):
    output = cluster3.submit(tmp_path, "tnode", steps=STEPS, step_time=0.1, checkpoint=tiers(tmp_path, "tnode", every_steps=1000))
    cluster3.wait_step("tnode", 25, 120)
    victim = next(w.node for w in cluster3.workers("tnode") if w.node_rank == 0)
    # the victim's shards must be replicated before it dies, or there is nothing to test
    cluster3.wait_for_replicas("tnode", victim)
    cluster3.cli("chaos", "kill-node", victim)
    job = cluster3.wait_job_phase("tnode", {"Succeeded", "Failed"}, 180)
    assert job.phase.value == "Succeeded", job.reason
    assert job.attempt == 1
    sources = restore_sources(cluster3, "tnode", 1)
    assert len(sources) == 4, sources
    assert [s for s in sources if "from replica on" in s], f"the lost node's ranks should restore from replicas: {sources}"
    assert not [s for s in sources if "persistent" in s], sources  # every_steps=1000: nothing drained
    assert_same_parameters(reference, output)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a read-only filesystem")
def test_read_only_persistent_tier_degrades_visibly_and_training_continues(make_cluster, tmp_path):
    mount = tmp_path / "ro"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,ro", "tmpfs", str(mount)], check=True)
    try:
        cluster = make_cluster("--nodes", "2")
        cluster.submit(tmp_path, "tro", steps=40, step_time=0.05, checkpoint={"memory": {"keep": 2, "replicas": 1},
                                                             "persistent": {"uri": f"file://{mount}/ckpt", "every_steps": 10}})
        job = cluster.wait_job_phase("tro", {"Succeeded", "Failed"}, 180)
        assert job.phase.value == "Succeeded", job.reason
        assert job.attempt == 0, "a failing persistent tier must not cost a restart"
        listed = cluster.json("ckpt", "list", "tro")
        failed = [s for s in listed["steps"] if s["persistent"] == "Failed"]
        assert failed, listed
        assert any("Read-only file system" in (s["persistent_message"] or "") for s in failed), failed
        assert any("Read-only file system" in w for w in listed["tier_warnings"]), listed
        agent_logs = "".join(p.read_text() for p in (cluster.dir / "nodes").glob("*/agent.log"))
        assert "drain of step" in agent_logs and "Read-only file system" in agent_logs
        table = cluster.cli("ckpt", "list", "tro").stdout
        assert "warning:" in table and "Failed" in table
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
