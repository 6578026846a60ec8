"""The agent's own watch on its ranks (supervision/rank_watch.py), what the agent makes of the deaths it sees
(agent/workers.py), and the controller's doorbell (plumbing/doorbell.py).

Real processes throughout: a stand-in for torchrun that starts two "ranks" (children with LOCAL_RANK in
their environment) and, like torchrun between two monitor passes, does not reap them at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from unbroken.plumbing import doorbell
from unbroken.supervision.torchrun import NodeSettings, RunningWorker
from unbroken.agent.progress import ProgressBook
from unbroken.supervision.rank_watch import Rank, RankDeath, RankWatch, wait_status
from unbroken.agent.workers import WorkerRunner
from unbroken.config.cluster import ClusterConfig
from unbroken.plumbing.layout import ClusterLayout
from unbroken.runtime import create_local
from unbroken.state.phases import JobPhase, WorkerPhase
from unbroken.state.records import Desired, Job, Worker
from unbroken.plumbing.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

# Starts two ranks; reaps a dead one only after REAP_AFTER seconds (torchrun polls every --monitor-interval).
FAKE_TORCHRUN = textwrap.dedent("""
    import os, subprocess, sys, time
    ranks = [subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(float(sys.argv[1])); sys.exit(int(sys.argv[2]))",
                               sys.argv[1 + 2 * i], sys.argv[2 + 2 * i]],
                              env={**os.environ, "RANK": str(10 + i), "LOCAL_RANK": str(i)}) for i in range(2)]
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # not a rank: no LOCAL_RANK
    while any(r.returncode is None for r in ranks):
        time.sleep(1.0)
        for r in ranks:
            r.poll()
    helper.kill()
""")


@pytest.fixture
def deaths() -> Iterator[tuple[RankWatch, queue.Queue[RankDeath]]]:
    seen: queue.Queue[RankDeath] = queue.Queue()
    watch = RankWatch(seen.put)
    yield watch, seen
    watch.close()


@contextlib.contextmanager
def fake_torchrun(*ranks: tuple[float, int]) -> Iterator[subprocess.Popen[bytes]]:
    """Ranks as (seconds alive, exit code); the stand-in is killed on the way out (its ranks die with it: 60 s at most)."""
    args = [str(x) for sleep_and_code in ranks for x in sleep_and_code]
    parent = subprocess.Popen([sys.executable, "-c", FAKE_TORCHRUN, *args])
    try:
        yield parent
    finally:
        parent.kill()
        parent.wait()


def rank_pids(parent: subprocess.Popen[bytes]) -> dict[int, int]:
    """local rank -> pid, once both ranks run."""
    def found() -> dict[int, int]:
        ranks = {}
        for child in psutil.Process(parent.pid).children():
            env = child.environ()
            if "LOCAL_RANK" in env:
                ranks[int(env["LOCAL_RANK"])] = child.pid
        return ranks if len(ranks) == 2 else {}
    return wait_until(found, 10, "both ranks started")


def test_a_rank_killed_is_reported_with_its_signal_before_its_parent_reaps_it(deaths) -> None:
    watch, seen = deaths
    with fake_torchrun((60, 0), (60, 0)) as parent:
        watch.track(7, parent.pid, 2)
        pids = rank_pids(parent)
        wait_until(lambda: len(watch._ranks) == 2, 10, "both ranks watched")  # the helper is not a rank
        assert watch._workers[7].found == set(pids.values())  # all found: torchrun's children are not listed again
        os.kill(pids[1], signal.SIGKILL)
        death = seen.get(timeout=5)
        assert (death.rank.worker_id, death.rank.rank, death.rank.local_rank, death.rank.pid) == (7, "11", 1, pids[1])
        assert death.exit_code == -signal.SIGKILL
        assert psutil.Process(pids[0]).is_running() and seen.empty()


def test_a_rank_that_exits_with_a_code_or_cleanly_is_reported_as_such(deaths) -> None:
    watch, seen = deaths
    with fake_torchrun((0.5, 3), (1.0, 0)) as parent:
        watch.track(1, parent.pid, 2)
        first, second = seen.get(timeout=10), seen.get(timeout=10)
        assert {(d.rank.local_rank, d.exit_code) for d in (first, second)} == {(0, 3), (1, 0)}


def test_a_forgotten_worker_is_no_longer_watched(deaths) -> None:
    watch, seen = deaths
    with fake_torchrun((60, 0), (60, 0)) as parent:
        watch.track(2, parent.pid, 2)
        pids = rank_pids(parent)
        wait_until(lambda: len(watch._ranks) == 2, 10, "both ranks watched")
        watch.forget(2)
        wait_until(lambda: not watch._ranks, 10, "its ranks unwatched")
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(queue.Empty):
            seen.get(timeout=0.5)


def test_wait_status_reads_a_zombie_and_nothing_else() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(5)"])
    wait_until(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, 10, "the child a zombie")
    assert wait_status(child.pid) == 5
    child.wait()
    assert wait_status(child.pid) is None  # reaped
    assert wait_status(os.getpid()) is None  # running


def test_the_doorbell_wakes_its_listener_and_a_ring_without_one_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "controller.wake"
    assert doorbell.ring(path) is False  # no bell yet
    path.write_text("a stale file")
    bell = doorbell.Doorbell(path)
    try:
        assert bell.wait(0.05) is False  # nobody rang: the timeout
        assert doorbell.ring(path) and doorbell.ring(path)
        assert bell.wait(5) is True
        assert bell.wait(0.05) is False  # both rings taken at once
    finally:
        bell.close()
    assert doorbell.ring(path) is False  # the bell is there but nobody listens


def test_a_rank_torchrun_reaped_first_is_named_when_torchrun_then_stops_the_others(tmp_path: Path) -> None:
    """On a busy node torchrun may reap a dead rank before the watch reads its status; then it
    stops the other ranks with SIGTERM, whose status the watch does read. The worker's failure
    must name the rank that ended first, not one torchrun stopped because of it."""
    runtime = create_local(ClusterLayout.at(tmp_path / "cluster"), ClusterConfig.with_nodes(1))
    table = runtime.worker_table
    assert table is not None
    runtime.cluster.add_job(Job(name="j", spec_json=json.dumps({"name": "j"}), phase=JobPhase.RUNNING))
    [worker] = table.add_workers([Worker(job="j", attempt=0, node="node-1", node_rank=1, desired=Desired.RUN,
                                         phase=WorkerPhase.RUNNING, rdzv_endpoint="127.0.0.1:29500")])
    runner = WorkerRunner("node-1", table, runtime.cluster, runtime.layout, ProgressBook(), lambda: NodeSettings(tmp_path / "agent.sock", None, "127.0.0.1"))
    torchrun = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        runner.running[worker.id] = RunningWorker(worker.id, torchrun, tmp_path / "logs")
        runner.rank_died(RankDeath(Rank(worker.id, 101, "3", 1), exit_code=None))  # reaped before it was read
        assert table.list_workers(node="node-1")[0].phase is WorkerPhase.RUNNING  # maybe a clean exit: wait
        runner.rank_died(RankDeath(Rank(worker.id, 100, "2", 0), exit_code=-signal.SIGTERM))  # torchrun's teardown
        [failed] = table.list_workers(node="node-1")
        assert failed.phase is WorkerPhase.FAILED and failed.exit_code is None
        assert failed.message is not None and failed.message.startswith("rank 3 (local rank 1) ended first"), failed.message
    finally:
        runner.close()
        torchrun.kill()
        torchrun.wait()
