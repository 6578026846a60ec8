"""The agent's side of an in-process restart: when a worker asked to hold is kept, and when it is stopped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from unbroken.rank import rejoin
from unbroken.agent import held
from unbroken.supervision.torchrun import RunningWorker


def _worker(tmp_path: Path, ranks: int = 2, abort_timeout: float = 5.0) -> RunningWorker:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    return RunningWorker(worker_id=1, process=process, log_dir=tmp_path, rejoin_dir=tmp_path / "rejoin", ranks=ranks,
                         abort_timeout=abort_timeout)


def test_a_worker_is_held_once_every_rank_left_the_attempt(tmp_path: Path) -> None:
    running = _worker(tmp_path)
    try:
        assert held.leaving(running, 4, now=100.0) == (held.Leaving.WAITING, set())
        rejoin.acknowledge_abort(tmp_path / "rejoin", 1, 4)
        rejoin.acknowledge_abort(tmp_path / "rejoin", 0, 3)  # left an older attempt: does not count for this one
        assert held.leaving(running, 4, now=101.0) == (held.Leaving.WAITING, {1})
        rejoin.acknowledge_abort(tmp_path / "rejoin", 0, 4)
        assert held.leaving(running, 4, now=102.0) == (held.Leaving.LEFT, {0, 1})
    finally:
        running.kill()


def test_a_rank_that_does_not_leave_in_time_stops_the_worker_instead(tmp_path: Path) -> None:
    running = _worker(tmp_path, abort_timeout=2.0)
    try:
        rejoin.acknowledge_abort(tmp_path / "rejoin", 0, 4)
        assert held.leaving(running, 4, now=100.0)[0] is held.Leaving.WAITING
        assert held.leaving(running, 4, now=102.5) == (held.Leaving.TIMED_OUT, {0})
    finally:
        running.kill()


def test_a_held_worker_not_adopted_is_killed_and_one_that_died_is_not_adopted(tmp_path: Path) -> None:
    pool = held.HeldWorkers()
    kept, dead = _worker(tmp_path / "a"), _worker(tmp_path / "b")
    pool.keep("job-a", kept, 0)
    pool.keep("job-b", dead, 0)
    dead.kill()
    assert pool.take("job-b") is None, "its torchrun is gone: the next attempt launches afresh"
    pool.expire(lambda job: job == "job-a")  # the job ended while its worker was held
    assert kept.process.poll() is not None and not pool
