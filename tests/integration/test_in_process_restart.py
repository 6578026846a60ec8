"""In-process restart (issue 11, item 2): the ranks on healthy nodes keep their processes across a restart.

First the rank's side alone, with real processes and real gloo (the test plays the agent through
rejoin.py's files): a survivor whose peer died leaves its process group, waits, rejoins the next
attempt with a new peer and trains again in the same process; without a notice it exits with the
collective's error (the full-restart fallback). Then the whole path on a real local cluster, the
shipped MLP workload's final parameters compared bit for bit with the uninterrupted reference run.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from helpers import STEPS, assert_same_parameters

from unbroken.rank import rejoin
from unbroken.rank.env import GroupPlacement
from unbroken.plumbing.waiting import wait_until

RANK_SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist
import unbroken, unbroken.train

unbroken.train.REJOIN_WAIT_SECONDS = float(os.environ["REJOIN_WAIT"])
ctx = unbroken.init(structured_logs=False)
entries = []

def train(ctx):
    entries.append([ctx.attempt, ctx.rank, ctx.world_size])
    restored = ctx.checkpoint.restore()  # the first restore of an attempt asks the live peers first
    weight = restored.state["w"] if restored else torch.zeros(1)
    ctx.keep_live(lambda: {"w": weight})
    if ctx.attempt == 0:
        weight = torch.full((1,), 7.0)
        ctx.progress(7)  # the state of step 7 is live on every rank of attempt 0
    total = torch.ones(1)
    dist.all_reduce(total)
    if ctx.attempt == 0 and os.environ.get("DIE_IN_ATTEMPT_0"):
        os._exit(9)  # the failing peer: gone after the first collective
    while ctx.attempt == 0:  # the survivor: collectives until the dead peer's absence raises
        dist.all_reduce(torch.ones(1))
    with open(os.environ["RESULT"], "w") as out:
        json.dump({"pid": os.getpid(), "entries": entries, "sum": total.item(), "w": weight.item(),
                   "restored": [restored.step, restored.source] if restored else None}, out)
    dist.destroy_process_group()
    return 0

sys.exit(ctx.run(train))
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _start_rank(tmp: Path, name: str, group: GroupPlacement, *, attempt: int = 0, die: bool = False,
                wait: float = 60) -> subprocess.Popen[str]:
    script = tmp / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, **group.to_environ(), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GLOO_SOCKET_IFNAME": "lo",
           "UNBROKEN_CHECKPOINT_DIR": str(tmp / "ckpt"), "REJOIN_WAIT": str(wait), "RESULT": str(tmp / f"{name}.json"),
           "OMP_NUM_THREADS": "1", "UNBROKEN_ATTEMPT": str(attempt)}
    env.pop("UNBROKEN_CLUSTER_DIR", None)
    if die:
        env["DIE_IN_ATTEMPT_0"] = "1"
    log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 - the child writes it; closed with the test's tmp
    return subprocess.Popen([sys.executable, str(script)], env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def _placement(tmp: Path, name: str, group_rank: int, rendezvous: str) -> GroupPlacement:
    return GroupPlacement(group_rank=group_rank, nnodes=2, rendezvous=rendezvous, rejoin_dir=tmp / name / "rejoin",
                          collective_timeout=20)


def test_a_survivor_leaves_the_broken_group_and_rejoins_the_next_attempt_in_the_same_process(tmp_path: Path) -> None:
    first = f"127.0.0.1:{_free_port()}"
    survivor = _start_rank(tmp_path, "survivor", _placement(tmp_path, "survivor", 0, first))
    doomed = _start_rank(tmp_path, "doomed", _placement(tmp_path, "doomed", 1, first), die=True)
    started = [survivor, doomed]
    try:
        assert doomed.wait(60) == 9
        rejoin_dir = tmp_path / "survivor" / "rejoin"
        wait_until(lambda: set(rejoin.acknowledged(rejoin_dir, 0, 1)) == {0}, 60,
                   "the survivor to leave attempt 0's process group")
        assert survivor.poll() is None, "the survivor stays alive, waiting"
        # the next attempt: a replacement takes group rank 0 (it hosts the new store), the survivor joins as rank 1
        second = f"127.0.0.1:{_free_port()}"
        replacement = _start_rank(tmp_path, "replacement", _placement(tmp_path, "replacement", 0, second), attempt=1)
        started.append(replacement)
        rejoin.post_notice(rejoin_dir, rejoin.RejoinNotice(attempt=1, group_rank=1, nnodes=2, rendezvous=second))
        assert survivor.wait(60) == 0, (tmp_path / "survivor.log").read_text()[-3000:]
        assert replacement.wait(60) == 0, (tmp_path / "replacement.log").read_text()[-3000:]
    finally:
        for process in started:
            process.kill()
    result = json.loads((tmp_path / "survivor.json").read_text())
    assert result["pid"] == survivor.pid
    assert result["entries"] == [[0, 0, 2], [1, 1, 2]], "the same process trained in attempt 0 as rank 0, then in attempt 1 as rank 1"
    assert result["sum"] == 2.0, "attempt 1's collective ran across the survivor and the replacement"
    new = json.loads((tmp_path / "replacement.json").read_text())
    assert new["restored"] == [7, "live peer (rank 1)"] and new["w"] == 7.0, "the new rank has the survivor's step-7 state"
    assert result["restored"] == [7, "own memory"] and result["w"] == 7.0
    log = (tmp_path / "survivor.log").read_text()
    assert "leaves attempt 0's process group" in log and "rejoins as attempt 1" in log, log[-3000:]
    # the agent, chaos and the CLI know the process by its new rank (rank/registry.py)
    registered = json.loads((rejoin_dir / f"{survivor.pid}.json").read_text())
    assert registered == {"rank": 1, "local_rank": 0}


def test_without_a_next_attempt_the_survivor_exits_with_the_collective_error(tmp_path: Path) -> None:
    """The fallback: no notice within the wait (the agent stopped holding it), so the rank exits as
    it would without in-process restarts, and the restart is a full one."""
    first = f"127.0.0.1:{_free_port()}"
    survivor = _start_rank(tmp_path, "survivor", _placement(tmp_path, "survivor", 0, first), wait=1)
    doomed = _start_rank(tmp_path, "doomed", _placement(tmp_path, "doomed", 1, first), die=True)
    try:
        assert doomed.wait(60) == 9
        assert survivor.wait(60) == 1
    finally:
        survivor.kill()
    log = (tmp_path / "survivor.log").read_text()
    assert "no next attempt within 1 s; exiting for a full restart" in log, log[-3000:]
    assert "Traceback" in log and not (tmp_path / "survivor.json").exists()


def test_a_killed_rank_restarts_in_process_from_the_survivors_state_and_the_job_ends_bit_identical(cluster3, tmp_path,
                                                                                                      reference) -> None:
    output = cluster3.submit(tmp_path, "inproc", steps=STEPS, step_time=0.2, checkpoint_every=5, in_process_restart=True)
    cluster3.wait_step("inproc", 3, 120)
    (before,) = [w for w in cluster3.workers("inproc", 0) if w.node_rank == 0]
    survivors = sorted(p.pid for p in cluster3.runtime.backend.rank_processes(before))
    assert len(survivors) == 2, survivors
    killed_at = cluster3.step("inproc")
    assert killed_at < STEPS - 15, f"the job is too close to its end ({killed_at}) for the test to mean anything"

    cluster3.cli("chaos", "kill-worker", "inproc", "--rank", "3")  # global rank 3: found through the rank registry
    cluster3.wait_step("inproc", killed_at + 2, 120, attempt=1)
    restarting = [e.message for e in cluster3.store.list_events(object_kind="Job", object_name="inproc") if e.reason == "JobRestarting"]
    assert restarting and f"in-process: the ranks on {before.node} stay" in restarting[0], restarting
    (after,) = [w for w in cluster3.workers("inproc", 1) if w.node == before.node]
    assert after.pid == before.pid, "the same torchrun"
    assert sorted(p.pid for p in cluster3.runtime.backend.rank_processes(after)) == survivors, "the same rank processes"
    held = next(w for w in cluster3.workers("inproc", 0) if w.node == before.node)
    assert held.message and held.message.startswith("held for an in-process restart"), held.message
    # state from live peers (item 4): the new ranks took the survivors' state at their last step, no checkpoint read
    resumed = wait_until(lambda: [e.message for e in cluster3.store.list_events(object_kind="Job", object_name="inproc")
                                  if e.reason == "JobResumed"], 30, "the JobResumed event")
    lost = int(resumed[0].split("; ")[1].split()[0])
    assert lost <= 1, resumed
    (replaced,) = [w for w in cluster3.workers("inproc", 1) if w.node != before.node]
    rank_logs = "".join(path.read_text() for path in Path(replaced.log_dir).glob("*/attempt_*/*/stdout.log"))
    assert "from live peer (rank 0)" in rank_logs, rank_logs[-3000:]

    job = cluster3.wait_job_phase("inproc", {"Succeeded", "Failed"}, 180)
    assert job.phase.value == "Succeeded", job.reason
    assert job.attempt == 1
    assert_same_parameters(reference, output)
