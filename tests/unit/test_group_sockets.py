"""A rank leaving a gloo group ends its connections, so a peer blocked on it sees it go at once.

Real sockets, and a real two-rank gloo group in subprocesses: rank 0 blocks in a receive from
rank 1; rank 1, with a receive of its own in flight, keeps its process (as a rank held for an in-process
restart does), shuts the group's connections down and aborts the group."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from unbroken.rank.group_sockets import GroupSockets
from unbroken.plumbing.ports import free_port


def test_the_connections_opened_are_shut_and_the_listener_and_older_sockets_are_not() -> None:
    with socket.create_server(("127.0.0.1", 0)) as older_listener:
        older = socket.create_connection(older_listener.getsockname())
        older_peer, _ = older_listener.accept()
        made: dict[str, socket.socket] = {}

        def form() -> None:
            made["listener"] = socket.create_server(("127.0.0.1", 0))
            made["client"] = socket.create_connection(made["listener"].getsockname())
            made["server_side"], _ = made["listener"].accept()

        group = GroupSockets.opened_by(form)
        assert group.shut_down() == 2, "the client and the accepted connection"
        made["server_side"].settimeout(5)
        assert made["server_side"].recv(1) == b"", "the peer sees the end of stream"
        made["listener"].settimeout(5)
        late = socket.create_connection(made["listener"].getsockname())  # the listener still accepts
        made["listener"].accept()[0].close()
        late.close()
        older.sendall(b"x")
        assert older_peer.recv(1) == b"x", "a socket from before the group is untouched"
        for sock in (*made.values(), older, older_peer):
            sock.close()


def test_a_descriptor_reused_for_another_socket_is_not_touched() -> None:
    made: dict[str, socket.socket] = {}
    with socket.create_server(("127.0.0.1", 0)) as listener:
        group = GroupSockets.opened_by(lambda: made.update(conn=socket.create_connection(listener.getsockname())))
        listener.accept()[0].close()
        fd = made["conn"].fileno()
        made["conn"].close()
        other = socket.create_connection(listener.getsockname())  # most likely the same descriptor number
        accepted, _ = listener.accept()
        assert group.shut_down() == 0
        other.sendall(b"y")
        assert accepted.recv(1) == b"y", f"descriptor {fd} now belongs to another socket"
        other.close()
        accepted.close()


RANK = """
import datetime, os, sys, time
import torch, torch.distributed as dist
from unbroken.rank.group_sockets import GroupSockets
rank = int(sys.argv[1])
group = GroupSockets.opened_by(lambda: dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)))
if rank == 0:
    t = torch.zeros(1)
    started = time.monotonic()
    try:
        dist.recv(t, src=1)
    except Exception as exc:
        print(f"left after {time.monotonic() - started:.2f} s: {type(exc).__name__}", flush=True)
        os._exit(0)
    os._exit(1)
else:
    # Work of its own still in flight, as a rank that left in the middle of DDP's all-reduces has:
    # with it, ``abort`` alone leaves rank 0 blocked until this process ends (31 s when tried).
    pending = dist.irecv(torch.zeros(1), src=0)
    time.sleep(0.5)  # not synchronisation: rank 0 leaves at once whether or not it is in its receive yet
    print(f"shut {group.shut_down()}", flush=True)
    dist.distributed_c10d._abort_process_group()
    time.sleep(30)  # still alive, and only the shutdown can have told rank 0
"""


def test_a_gloo_peer_blocked_on_a_leaving_rank_sees_it_go_at_once(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, str(script), str(r), port], stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        out, _ = ranks[0].communicate(timeout=45)
        assert ranks[0].returncode == 0, out
        waited = float(out.split("left after ")[1].split()[0])
        assert waited < 10, f"rank 0 waited {waited} s: it should leave a moment after the shutdown, long before its 60 s timeout"
    finally:
        ranks[1].kill()
        shut = ranks[1].communicate(timeout=10)[0]
    assert "shut " in shut and not shut.strip().endswith("shut 0"), shut
