"""Silent data corruption on a real local cluster: one bit of one rank's parameters flipped through the rank
(``chaos corrupt``), caught by the replicas' fingerprints, the suspect node taken out, the checkpoints saved after
the last agreed step untrusted, and the job resumed from that step to the very parameters of a run nobody corrupted.

What cannot run here is a GPU that computes wrong: the flip stands for its wrong result (one bit of a parameter
changed in place, nothing raised), and the node's known-answer check is made to see one wrong element (the
``chaos-sdc`` file) as a faulty device would. Everything else is the real path: gloo, DDP, the agents, the
controller, the SQLite catalog, the memory and persistent tiers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import Cluster, assert_same_parameters

from unbroken.plumbing.waiting import wait_until
from unbroken.state.phases import NodeState

pytestmark = pytest.mark.slow

STEPS = 240
EVERY = 20
"""Replicas compared every 20 steps, saves every 10: a save falls between a flip and its detection."""


def corrupt(cluster: Cluster, job: str, *args: str) -> tuple[str, int, int]:
    """Flip a bit a few steps ahead of the job; returns the command's output and the check steps that follow from
    the step the rank flipped after (it says which: a rank already past the asked step flips at its next one):
    the last that agrees, and the one that sees the flip."""
    ahead = (cluster.step(job) + 40) // EVERY * EVERY + 5
    out = cluster.cli("chaos", "corrupt", job, "--step", str(ahead), *args).stdout
    flipped = int(out.split("after step ")[1].split(";")[0].split()[0])
    agreed = flipped // EVERY * EVERY
    return out, agreed, agreed + EVERY


def event(cluster: Cluster, job: str, reason: str) -> str | None:
    return next((e["message"] for e in cluster.json("job", "describe", job)["events"] if e["reason"] == reason), None)


def submit(cluster: Cluster, tmp: Path, name: str, *, nodes: int, procs: int, checkpoint: dict[str, object]) -> Path:
    return cluster.submit(tmp, name, steps=STEPS, nodes=nodes, procs=procs, step_time=0.03, checkpoint_every=10,
                          extra_args=["--watch-replicas", str(EVERY)], checkpoint=checkpoint)


def tiers(tmp: Path, name: str) -> dict[str, object]:
    return {"memory": {"keep": 3, "replicas": 1}, "persistent": {"uri": f"file://{tmp}/{name}-persistent", "every_steps": 10}}


def test_a_flipped_bit_in_one_replica_is_outvoted_its_node_replaced_and_the_job_resumes_bit_identical(
        cluster3: Cluster, tmp_path: Path) -> None:
    reference = submit(cluster3, tmp_path, "clean", nodes=2, procs=2, checkpoint=tiers(tmp_path, "clean"))
    assert cluster3.wait_job_phase("clean", {"Succeeded", "Failed"}, 240).phase.value == "Succeeded"

    output = submit(cluster3, tmp_path, "sdc", nodes=2, procs=2, checkpoint=tiers(tmp_path, "sdc"))
    cluster3.wait_step("sdc", 5, 120)
    victim = next(w.node for w in cluster3.workers("sdc") if w.node_rank == 1)  # ranks 2 and 3
    flipped, agreed, detected = corrupt(cluster3, "sdc", "--rank", "3")
    assert f"rank 3 on {victim}: flipped bit 3 of byte 8192 of the first parameter" in flipped, flipped

    message = wait_until(lambda: event(cluster3, "sdc", "SilentDataCorruption"), 120, "the SilentDataCorruption event")
    assert (f"replicas disagree at step {detected} in model.0.weight: rank 3 on {victim} outvoted by its replicas; "
            f"last agreed step {agreed}") in message, message
    # the verdict is read a step after its check: the save at the check's own step was written before it (it may be
    # cataloged yet or not when the controller marks)
    assert re.search(rf"checkpoint steps {agreed + 10}(, {detected})? marked untrusted", message), message
    assert f"node {victim} taken out (SilentDataCorruption)" in message, message
    node = cluster3.store.get_node(victim)
    assert node.fault_type == "SilentDataCorruption" and node.state in (NodeState.PENDING_REPLACEMENT, NodeState.RETIRED)

    restarting = event(cluster3, "sdc", "JobRestarting") or ""
    assert restarting.startswith(f"silent data corruption: replicas disagree at step {detected}"), restarting
    wait_until(lambda: cluster3.job("sdc").attempt == 1 and cluster3.step("sdc") > 0, 120, "attempt 1 stepping")
    assert victim not in {w.node for w in cluster3.workers("sdc", 1)}
    resumed = wait_until(lambda: event(cluster3, "sdc", "JobResumed"), 60, "the JobResumed event")
    assert resumed.startswith(f"attempt 1 resumed from step {agreed};"), resumed

    job = cluster3.wait_job_phase("sdc", {"Succeeded", "Failed"}, 240)
    assert job.phase.value == "Succeeded", job.reason
    assert_same_parameters(reference, output)  # the rollback lost nothing of the corruption: bit for bit the clean run
    assert f"silent data corruption: replicas disagree at step {detected}" in cluster3.cli("job", "describe", "sdc").stdout
    listed = {s["step"]: s for s in cluster3.json("ckpt", "list", "sdc")["steps"]}
    # the untrusted step was saved again by attempt 1; the persistent tier keeps attempt 0's marked
    assert listed[agreed + 10]["persistent"] == "Untrusted", listed[agreed + 10]


def test_two_replicas_that_disagree_are_both_checked_and_only_the_one_that_computes_wrong_is_replaced(
        cluster3: Cluster, tmp_path: Path) -> None:
    output = submit(cluster3, tmp_path, "pair", nodes=2, procs=1, checkpoint={"dir": str(tmp_path / "pair-ckpt")})
    cluster3.wait_step("pair", 5, 120)
    nodes = {w.node_rank: w.node for w in cluster3.workers("pair")}
    victim, healthy = nodes[1], nodes[0]
    _, agreed, detected = corrupt(cluster3, "pair", "--rank", "1", "--target", "optimizer")

    message = wait_until(lambda: event(cluster3, "pair", "SilentDataCorruption"), 120, "the SilentDataCorruption event")
    # the first differing tensor in the state's order: the flipped moment itself, or (a step after it) the weight it moved
    assert re.search(rf"replicas disagree at step {detected} in (model\.0\.weight|optimizer\.state\.0\.exp_avg):", message), message
    assert "no majority among ranks 0, 1" in message and f"last agreed step {agreed}" in message, message
    assert "cordoned until its known-answer check" in message, message

    def settled() -> bool:
        return (cluster3.store.get_node(victim).state in (NodeState.PENDING_REPLACEMENT, NodeState.RETIRED)
                and cluster3.store.get_node(healthy).state is NodeState.SCHEDULABLE)

    wait_until(settled, 120, f"{victim} out and {healthy} back after their known-answer checks")
    assert cluster3.store.get_node(victim).fault_type == "SilentDataCorruption"
    cleared = [e.message for e in cluster3.store.list_events(object_kind="Node", object_name=healthy, reason="SilentDataCorruptionCleared")]
    assert cleared and "stress.known_answer passed" in cleared[0], cleared
    # the file tier quarantined what it saved after the agreed step, and the job resumes from that step
    quarantined = sorted(p.name for p in (tmp_path / "pair-ckpt").iterdir() if p.name.startswith("untrusted-"))
    assert quarantined == [f"untrusted-step-{agreed + 10:09d}", f"untrusted-step-{detected:09d}"], quarantined
    assert "replicas disagree" in (tmp_path / "pair-ckpt" / quarantined[0] / "UNTRUSTED").read_text()
    resumed = wait_until(lambda: event(cluster3, "pair", "JobResumed"), 120, "the JobResumed event")
    assert resumed.startswith(f"attempt 1 resumed from step {agreed};"), resumed
    assert victim not in {w.node for w in cluster3.workers("pair", 1)}
    assert cluster3.wait_job_phase("pair", {"Succeeded", "Failed"}, 240).phase.value == "Succeeded"
    assert output.exists()
