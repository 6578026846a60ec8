"""A rank under ``unbroken run`` leaves its round when its launcher asks, even blocked in a collective on a hung peer.

The watch's thread reads the launcher's request (a real file, rejoin.py); the end to end check runs a real two-rank
gloo group in subprocesses: rank 1 stops answering (as a SIGSTOPped or deadlocked rank), rank 0 blocks in an
all-reduce on it, and the request makes that all-reduce fail in well under the group's 60 s timeout."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from unbroken.rank import rejoin
from unbroken.rank.leave_watch import LeaveWatch
from unbroken.plumbing.ports import free_port


def test_a_request_for_this_round_is_passed_on_with_why(tmp_path: Path) -> None:
    asked: list[str] = []
    called = threading.Event()
    watch = LeaveWatch(tmp_path, 3, lambda why: (asked.append(why), called.set())).start()
    rejoin.request_leave(tmp_path, 3, "a peer in pod 2 hangs")
    assert called.wait(5), "the watch did not pass the request on"
    watch.stop()
    assert asked == ["a peer in pod 2 hangs"]


def test_a_request_for_another_round_is_not_this_rounds(tmp_path: Path) -> None:
    rejoin.request_leave(tmp_path, 2, "the round before")  # left over: this rank already left round 2
    assert rejoin.leave_requested(tmp_path, 3) is None
    asked: list[str] = []
    called = threading.Event()
    watch = LeaveWatch(tmp_path, 3, lambda why: (asked.append(why), called.set())).start()
    rejoin.request_leave(tmp_path, 3, "round 3 breaks")
    assert called.wait(5)
    watch.stop()
    assert asked == ["round 3 breaks"], "only this round's request, once"


def test_after_stop_nothing_is_passed_on(tmp_path: Path) -> None:
    asked: list[str] = []
    watch = LeaveWatch(tmp_path, 1, asked.append).start()
    watch.stop()  # joins: the thread is gone when stop returns
    rejoin.request_leave(tmp_path, 1, "too late: this rank finished")
    assert not any(t.name == "unbroken-leave-watch-1" for t in threading.enumerate())
    assert asked == []


RANK = """
import datetime, os, sys, time
import torch, torch.distributed as dist
from pathlib import Path
from unbroken.rank.group_sockets import GroupSockets
from unbroken.rank.leave_watch import LeaveWatch
rank, port, rejoin_dir = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
group = GroupSockets.opened_by(lambda: dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)))
if rank == 1:
    print("hung", flush=True)
    sys.stdin.read()  # never answers a collective again; ends when the test closes its stdin
    os._exit(0)
LeaveWatch(rejoin_dir, 0, lambda why: group.shut_down()).start()
print("in all_reduce", flush=True)
started = time.monotonic()
try:
    dist.all_reduce(torch.ones(1))
except Exception as exc:
    print(f"left after {time.monotonic() - started:.2f} s: {type(exc).__name__}", flush=True)
    os._exit(0)
os._exit(1)
"""


def test_a_rank_blocked_on_a_hung_peer_leaves_when_asked(tmp_path: Path) -> None:
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), port, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        assert ranks[1].stdout is not None and ranks[1].stdout.readline().strip() == "hung"
        assert ranks[0].stdout is not None and ranks[0].stdout.readline().strip() == "in all_reduce"
        rejoin.request_leave(tmp_path, 0, "the launchers saw no step for 3 s")
        out, _ = ranks[0].communicate(timeout=30)
        assert ranks[0].returncode == 0, out
        assert out.startswith("left after "), out
        assert float(out.split()[2]) < 10, f"left at the request, not at the group's 60 s timeout: {out}"
    finally:
        for proc in ranks:
            proc.kill()
            proc.communicate()


def test_the_group_unbroken_makes_on_a_gpu_carries_gloo_beside_nccl() -> None:
    """``dcp.async_save`` asserts "A CPU backend must be enabled for async save" in an NCCL-only group, which is what
    every multi-process GPU job under unbroken had (seen on an H100). The default is both; the GPU benchmark
    (benchmarks/gpu.py) runs ``dcp.async_save`` and the leave watch's abort in such a group."""
    from unbroken.rank.process_group import default_backend

    assert default_backend(cuda=True) == "cpu:gloo,cuda:nccl"
    assert default_backend(cuda=False) == "gloo"
