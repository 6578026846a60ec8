"""Step-time intelligence on a real local cluster: a node slowed for real (its processes stopped for part
of every 50 ms by ``chaos slow-node``) is named a straggler, a healthy run beside a CPU hog is not,
``replace`` moves the job off it, and a job that sets no hang_timeout is timed by its own steps.

The jobs run the shipped MLP with ``--compute-matmuls``: fixed CPU work per step in a ``compute``
section, which a slowed node really takes longer over (a sleep would not be slowed)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import Cluster

from unbroken.state.phases import NodeState
from unbroken.plumbing.waiting import wait_until

pytestmark = pytest.mark.slow

MATMULS = "40"
"""~50 ms of compute a step here: long next to the 50 ms slow-down cycle and the scheduler's noise."""


HOG = """
import os, time
cpus = sorted(os.sched_getaffinity(0))
turn = 0
while True:
    os.sched_setaffinity(0, {cpus[turn % len(cpus)]})
    turn += 1
    until = time.monotonic() + 0.02
    while time.monotonic() < until:
        pass
"""
"""Busy all the time, on each core in turn, 20 ms on each: shorter than a step (~50 ms), so every step of every
rank meets it about as often. A hog left where the scheduler puts it can sit beside one rank for the whole test:
that rank is then slower for real (a straggler, rightly named), and the test failed on it once in CI. Turns of
250 ms still let one rank meet it for several steps in a row; the test failed on that twice in CI, naming the
healthy peer."""


@pytest.fixture
def cpu_hog() -> Iterator[subprocess.Popen[bytes]]:
    """A process that keeps a core busy: the noisy neighbour of a shared machine, moving between its cores."""
    hog = subprocess.Popen([sys.executable, "-c", HOG])
    yield hog
    hog.kill()
    hog.wait()


def event(cluster: Cluster, job: str, reason: str) -> str | None:
    return next((e["message"] for e in cluster.json("job", "describe", job)["events"] if e["reason"] == reason), None)


def start_job(cluster: Cluster, tmp: Path, name: str, **resilience: object) -> str:
    """A 2-node job of one rank per node; returns the node of rank 1 (the one the tests slow)."""
    cluster.submit(tmp, name, steps=100_000, nodes=2, procs=1, step_time=0.0, checkpoint_every=1000,
                   extra_args=["--compute-matmuls", MATMULS], hang_timeout=None, **resilience)
    cluster.wait_step(name, 5, 120)
    return next(w.node for w in cluster.workers(name) if w.node_rank == 1)


def test_a_slowed_node_is_named_a_straggler_and_recovers_while_a_noisy_healthy_run_names_none(
        cluster3: Cluster, tmp_path: Path, cpu_hog: subprocess.Popen[bytes]) -> None:
    victim = start_job(cluster3, tmp_path, "slow")
    # healthy beside the hog for 150 steps: scored all along (the metric), never named
    healthy_until = cluster3.step("slow") + 150
    wait_until(lambda: cluster3.step("slow") >= healthy_until, 180, "150 healthy steps")
    false_alarm = event(cluster3, "slow", "StragglerDetected")
    assert false_alarm is None, (false_alarm, cluster3.cli("job", "describe", "slow").stdout)

    cluster3.cli("chaos", "slow-node", victim, "--factor", "2")  # returns once the slowing has begun
    slowed_at_step, slowed_at = cluster3.step("slow"), time.monotonic()
    message = wait_until(lambda: event(cluster3, "slow", "StragglerDetected"), 90, "the StragglerDetected event")
    assert f"node {victim} is a straggler" in message, message
    # The section named, if any, is the one the slowed node spends its extra time in. Whether one is named depends on
    # where the stops land: each section's time is its own median, and stops that land in a different section each
    # step lift the work's median but no section's much (CI: "slowest section 'forward' at 1", and 'data' at 0.967,
    # which the scores now refuse to say; tests/unit/test_step_timing.py names the section where the slowdown is).
    assert "slowest section" not in message or "slowest section 'compute'" in message, message
    detected_at_step = int(message.rsplit("at step ", 1)[1].split(";")[0])
    # a window's median flips after 10 slowed steps, then two of the agent's 1 s reports; the
    # benchmark (benchmarks/straggler.py) measures it, this bounds it loosely
    assert detected_at_step - slowed_at_step <= 150 and time.monotonic() - slowed_at < 30, (slowed_at_step, message)
    assert cluster3.job("slow").phase.value == "Running"  # report only: nothing restarts

    cluster3.cli("chaos", "slow-node", victim, "--clear")
    back = wait_until(lambda: event(cluster3, "slow", "StragglerRecovered"), 90, "the StragglerRecovered event")
    assert f"node {victim} keeps pace again" in back
    cluster3.cli("job", "cancel", "slow")


def test_with_replace_a_straggler_node_is_taken_out_and_the_job_moves_to_the_spare_in_process(cluster3: Cluster, tmp_path: Path) -> None:
    """With in-process restarts the healthy node's rank stays in its process and the spare's new rank takes its
    state from it: the move loses at most the step in flight."""
    victim = start_job(cluster3, tmp_path, "mover", straggler_policy="replace", straggler_restart_cost=1, in_process_restart=True)
    spare = ({"node-1", "node-2", "node-3"} - {w.node for w in cluster3.workers("mover")}).pop()
    cluster3.cli("chaos", "slow-node", victim, "--factor", "3")
    message = wait_until(lambda: event(cluster3, "mover", "StragglerReplaced"), 120, "the StragglerReplaced event")
    assert f"node {victim} taken out" in message and f"spare {spare} free" in message, message
    node = cluster3.store.get_node(victim)
    assert node.fault_type == "Straggler"
    assert node.state in (NodeState.PENDING_REPLACEMENT, NodeState.RETIRED)
    job = cluster3.wait_job_phase("mover", {"Running"}, 60)
    wait_until(lambda: cluster3.job("mover").attempt == 1 and cluster3.step("mover") > 0, 120, "attempt 1 stepping")
    assert victim not in {w.node for w in cluster3.workers("mover", 1)}
    assert spare in {w.node for w in cluster3.workers("mover", 1)}
    restarting = event(cluster3, "mover", "JobRestarting") or ""
    assert f"node {victim} is UnschedulablePendingReplacement: straggler in job mover" in restarting, restarting
    assert job.phase.value == "Running"
    resumed = wait_until(lambda: event(cluster3, "mover", "JobResumed"), 60, "the JobResumed event")
    lost = int(resumed.split("; ")[1].split(" steps lost")[0])
    assert lost <= 1, resumed
    cluster3.cli("chaos", "slow-node", victim, "--clear")
    cluster3.cli("job", "cancel", "mover")


def test_a_hang_in_a_job_with_no_hang_timeout_is_detected_from_its_own_step_times(cluster3: Cluster, tmp_path: Path) -> None:
    cluster3.submit(tmp_path, "quick", steps=100_000, nodes=2, procs=1, step_time=0.05, checkpoint_every=1000, hang_timeout=None)
    cluster3.wait_step("quick", 40, 120)
    described = cluster3.cli("job", "describe", "quick").stdout
    assert "from step times: max(3 s" in described, described
    stopped = time.monotonic()
    cluster3.cli("chaos", "hang-worker", "quick", "--rank", "1")
    job = cluster3.wait_job_phase("quick", {"Restarting", "Failed"}, 60)
    detected = time.monotonic() - stopped
    assert job.phase.value == "Restarting" and "from step times" in (job.reason or ""), job.reason
    assert detected < 10, f"a 50 ms-step job's hang took {detected:.1f} s to detect"
    cluster3.cli("job", "cancel", "quick")
