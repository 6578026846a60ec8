"""The rank -> agent channel, the agent's progress book, and the training API outside an agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from unbroken.agent.progress import ProgressBook
from unbroken.rank.channel import MAX_DATAGRAM, AgentReceiver, MessageKind, RankMessage, RankSender, agent_socket
from unbroken.state.records import RankInfo, WorkerProgress

SRC = Path(__file__).resolve().parents[2] / "src"


def msg(kind: MessageKind, rank: int, ts: float, step: int | None = None, *, pid: int | None = None,
        job: str = "job", attempt: int = 0, **metrics: float) -> RankMessage:
    return RankMessage(kind=kind, job=job, attempt=attempt, rank=rank, local_rank=rank % 2,
                       pid=1000 + rank if pid is None else pid, ts=ts, step=step, metrics=metrics)


def clean_env() -> dict[str, str]:
    """The test process's environment minus anything an agent or torchrun would set."""
    launcher = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"}
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("UNBROKEN_", "TORCHELASTIC_")) and k not in launcher}
    env["PYTHONPATH"] = str(SRC)
    return env


def run_python(code: str, *args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=cwd, env=env or clean_env(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def by_worker(reports: list[WorkerProgress]) -> dict[tuple[str, int], WorkerProgress]:
    return {(r.job, r.attempt): r for r in reports}


def drain_until(receiver: AgentReceiver, count: int, timeout: float = 10.0) -> list[RankMessage]:
    got: list[RankMessage] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got.extend(receiver.drain())
        if len(got) < count:
            time.sleep(0.01)
    return got


# -- sender ----------------------------------------------------------------------------


def test_sender_without_address_drops_everything() -> None:
    sender = RankSender(None)
    assert sender.send(msg(MessageKind.HELLO, 0, 1.0)) is False
    sender.close()
    sender.close()


def test_sender_to_an_address_nobody_listens_on_returns_false_at_once(tmp_path: Path) -> None:
    sender = RankSender(agent_socket(tmp_path / "no-agent-here"))
    started = time.monotonic()
    results = [sender.send(msg(MessageKind.PROGRESS, 0, 1.0, step)) for step in range(1000)]
    elapsed = time.monotonic() - started
    sender.close()
    assert results == [False] * 1000
    assert elapsed < 2.0, f"1000 sends to a missing agent took {elapsed:.2f} s"
    assert sender.send(msg(MessageKind.PROGRESS, 0, 1.0, 1)) is False, "closed sender drops too"


def test_sender_to_a_full_queue_drops_instead_of_blocking(tmp_path: Path) -> None:
    address = agent_socket(tmp_path / "busy")
    receiver = AgentReceiver(address)  # bound but never drained while we send
    sender = RankSender(Path(address))
    try:
        started = time.monotonic()
        results = [sender.send(msg(MessageKind.PROGRESS, 0, 1.0, step, loss=0.5)) for step in range(50_000)]
        elapsed = time.monotonic() - started
        assert results[0] is True
        assert False in results, "the queue never filled up"
        assert elapsed < 10.0, f"sending took {elapsed:.2f} s"
        assert receiver.drain(), "what was queued before it filled up is delivered"
    finally:
        sender.close()
        receiver.close()


# -- the socket file ------------------------------------------------------------------


def test_the_agent_socket_lives_in_a_private_folder_and_replaces_a_stale_one(tmp_path: Path) -> None:
    path = agent_socket(tmp_path / "agent")
    first = AgentReceiver(path)
    first.close()  # an agent that died leaves its socket file behind
    assert path.exists()
    receiver = AgentReceiver(path)  # its successor binds the same path
    sender = RankSender(path)
    try:
        assert sender.send(msg(MessageKind.HELLO, 0, 1.0))
        assert [m.kind for m in drain_until(receiver, 1)] == [MessageKind.HELLO]
        assert (path.parent.stat().st_mode & 0o777) == 0o700, "only the agent's user may reach it"
    finally:
        sender.close()
        receiver.close()


def test_a_socket_path_too_long_for_unix_sockets_is_a_clear_error(tmp_path: Path) -> None:
    deep = tmp_path / ("x" * 120)
    with pytest.raises(ValueError, match="longer than 107 bytes"):
        AgentReceiver(agent_socket(deep))


def test_two_agents_receive_only_their_own_messages(tmp_path: Path) -> None:
    ra, rb = AgentReceiver(agent_socket(tmp_path / "a")), AgentReceiver(agent_socket(tmp_path / "b"))
    sender = RankSender(agent_socket(tmp_path / "a"))
    try:
        assert sender.send(msg(MessageKind.HELLO, 0, 1.0))
        assert [m.kind for m in drain_until(ra, 1)] == [MessageKind.HELLO]
        assert rb.drain() == []
    finally:
        sender.close()
        ra.close()
        rb.close()


NETNS_SENDER = """
import sys
from pathlib import Path
from unbroken.rank.channel import MessageKind, RankMessage, RankSender
ok = RankSender(Path(sys.argv[1])).send(RankMessage(kind=MessageKind.HELLO, job="j", attempt=0, rank=0, local_rank=0, pid=1, ts=1.0))
sys.exit(0 if ok else 3)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="creating a network namespace needs root")
def test_a_rank_in_another_network_namespace_reaches_its_agent(tmp_path: Path) -> None:
    """What a pod does with a hostPath mount: an abstract socket name would not cross the namespace."""
    namespace = f"ub-test-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", namespace], check=True)
    receiver = AgentReceiver(agent_socket(tmp_path / "agent"))
    try:
        result = subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-c", NETNS_SENDER, str(receiver.path)],
                                env=clean_env(), capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert [m.kind for m in drain_until(receiver, 1)] == [MessageKind.HELLO]
    finally:
        receiver.close()
        subprocess.run(["ip", "netns", "delete", namespace], check=False)


# -- receiving from another process ----------------------------------------------------

SENDER = """
import json, os, socket, sys, time
from pathlib import Path
from unbroken.rank.channel import MessageKind, RankMessage, RankSender

address = sys.argv[1]
raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # blocking: waits while the agent's queue is full
raw.settimeout(20)
sender = RankSender(Path(address))
common = dict(job="train", attempt=2, rank=3, local_rank=1, pid=os.getpid())
valid = RankMessage(kind=MessageKind.PROGRESS, ts=1001.25, step=7, metrics={"loss": 0.125, "lr": 3e-4}, **common).encode()
garbage = [
    b"not json at all",
    b"\\xff\\xfe\\x00",
    b"[1, 2, 3]",
    b"42",
    b"null",
    b"{}",
    b'{"kind": "progress"}',
    valid.replace(b'"progress"', b'"exploded"'),
    valid[: len(valid) // 2],
    valid.replace(b'"ts":1001.25', b'"ts":"soon"'),
    valid.replace(b'"job":"train"', b'"job":["train"]'),
    valid.replace(b'"step":7', b'"step":"seven"'),
    valid.replace(b'"loss":0.125', b'"loss":"low"'),
    valid.replace(b'"rank":3', b'"rank":3,"extra":1'),
]

def send_garbage():
    for data in garbage:
        raw.sendto(data, address)

def send(message):
    # The kernel queue may be short (net.unix.max_dgram_qlen): a full one drops, so retry until the
    # agent (the test) has drained. Not what a rank does; here every message must get through.
    deadline = time.monotonic() + 20
    while not sender.send(message):
        if time.monotonic() > deadline:
            sys.exit("agent queue stayed full")
        time.sleep(0.001)

send_garbage()
send(RankMessage(kind=MessageKind.HELLO, ts=1000.5, **common))
send_garbage()
send(RankMessage(kind=MessageKind.PROGRESS, ts=1001.25, step=7, metrics={"loss": 0.125, "lr": 3e-4}, **common))
# Over MAX_DATAGRAM: truncated by the sender, so unreadable and skipped by the agent.
send(RankMessage(kind=MessageKind.PROGRESS, ts=1001.5, step=8, metrics={f"m{i}": float(i) for i in range(2000)}, **common))
send(RankMessage(kind=MessageKind.RESTORED, ts=1002.0, step=6, **common))
send_garbage()
print(json.dumps({"pid": os.getpid()}), flush=True)
"""


def test_receiver_gets_messages_sent_from_another_process_and_skips_garbage(tmp_path: Path) -> None:
    receiver = AgentReceiver(agent_socket(tmp_path / "node-1"))
    proc = subprocess.Popen([sys.executable, "-c", SENDER, str(receiver.path)], cwd=tmp_path, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    got: list[RankMessage] = []
    try:
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:  # drain like the agent loop does
            got.extend(receiver.drain())
            time.sleep(0.005)
        got.extend(receiver.drain())  # datagrams are queued by the time sendto returns
        stdout, stderr = proc.communicate(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        receiver.close()

    assert proc.returncode == 0, f"sender exited {proc.returncode}:\n{stdout}\n{stderr}"
    pid = json.loads(stdout)["pid"]
    common = dict(job="train", attempt=2, rank=3, local_rank=1, pid=pid)
    assert got == [
        RankMessage(kind=MessageKind.HELLO, ts=1000.5, **common),
        RankMessage(kind=MessageKind.PROGRESS, ts=1001.25, step=7, metrics={"loss": 0.125, "lr": 3e-4}, **common),
        RankMessage(kind=MessageKind.RESTORED, ts=1002.0, step=6, **common),
    ]
    assert all(type(m.kind) is MessageKind for m in got)


def test_message_round_trips_through_encode_and_fits_a_datagram() -> None:
    message = msg(MessageKind.PROGRESS, 5, 1234.5, 99, loss=1.5, tokens_per_s=2e6)
    assert RankMessage.decode(message.encode()) == message
    assert len(message.encode()) < MAX_DATAGRAM


def test_wrongly_typed_message_is_rejected_by_decode() -> None:
    good = json.loads(msg(MessageKind.PROGRESS, 0, 10.0, 1).encode())
    assert RankMessage.decode(json.dumps(good).encode()).ts == 10.0
    assert RankMessage.decode(json.dumps({**good, "ts": 10}).encode()).ts == 10, "an integral timestamp is fine"
    for field, value in [("ts", "soon"), ("job", ["j"]), ("step", 1.5), ("rank", None), ("pid", True),
                         ("metrics", [1]), ("metrics", {"loss": "x"})]:
        with pytest.raises((TypeError, ValueError)):
            RankMessage.decode(json.dumps({**good, field: value}).encode())


# -- progress book ---------------------------------------------------------------------


def test_progress_book_folds_ranks_into_one_worker_report() -> None:
    book = ProgressBook()
    book.apply([msg(MessageKind.HELLO, 0, 100.0), msg(MessageKind.HELLO, 1, 100.1)])
    assert book.take_dirty() == [WorkerProgress(
        job="job", attempt=0, ranks=(RankInfo(rank=0, local_rank=0, pid=1000), RankInfo(rank=1, local_rank=1, pid=1001)),
    )]
    assert book.take_dirty() == [], "each change is reported once"

    book.apply([
        msg(MessageKind.PROGRESS, 0, 105.0, 5),
        msg(MessageKind.PROGRESS, 1, 106.0, 5),
        msg(MessageKind.PROGRESS, 0, 110.0, 6),
        msg(MessageKind.PROGRESS, 0, 115.0, 7),  # rank 1 is stuck at step 5
        msg(MessageKind.PROGRESS, 1, 104.0, 4),  # late datagram: an earlier report from rank 1
    ])
    [row] = book.take_dirty()
    assert row.last_step == 4, "the slowest rank's latest step"
    assert row.last_progress_at == 104.0, "the oldest of the ranks' latest reports: a stuck rank shows"
    assert row.first_step == 4 and row.first_progress_at == 104.0, "the earliest report"
    assert row.restored_step is None
    assert book.take_dirty() == []

    book.apply([msg(MessageKind.PROGRESS, 1, 120.0, 8)])
    [row] = book.take_dirty()
    assert row.last_step == 7 and row.last_progress_at == 115.0
    assert row.first_step == 4 and row.first_progress_at == 104.0

    book.apply([msg(MessageKind.RESTORED, 0, 121.0, 6)])
    [row] = book.take_dirty()
    assert row.restored_step == 6
    assert row.last_step == 7, "a restore is not progress"


def test_restarted_rank_with_a_new_pid_replaces_its_old_entry() -> None:
    book = ProgressBook()
    book.apply([
        msg(MessageKind.HELLO, 0, 1.0), msg(MessageKind.HELLO, 1, 1.0),
        msg(MessageKind.PROGRESS, 0, 10.0, 3), msg(MessageKind.PROGRESS, 1, 5.0, 1),
    ])
    assert book.take_dirty()[0].last_progress_at == 5.0

    book.apply([msg(MessageKind.HELLO, 1, 20.0, pid=4242)])
    [row] = book.take_dirty()
    assert row.ranks == (RankInfo(rank=0, local_rank=0, pid=1000), RankInfo(rank=1, local_rank=1, pid=4242))
    assert row.last_progress_at == 10.0 and row.last_step == 3, "the old process's reports are gone"

    book.apply([msg(MessageKind.PROGRESS, 1, 21.0, 4, pid=4242)])
    [row] = book.take_dirty()
    assert row.last_step == 3 and row.last_progress_at == 10.0


def test_progress_book_keeps_jobs_and_attempts_apart() -> None:
    book = ProgressBook()
    book.apply([
        msg(MessageKind.PROGRESS, 0, 1.0, 1, job="a", attempt=0),
        msg(MessageKind.PROGRESS, 0, 2.0, 9, job="a", attempt=1),
        msg(MessageKind.PROGRESS, 0, 3.0, 5, job="b", attempt=0),
    ])
    rows = by_worker(book.take_dirty())
    assert {key: row.last_step for key, row in rows.items()} == {("a", 0): 1, ("a", 1): 9, ("b", 0): 5}


def test_taking_a_finished_workers_report_ends_it_and_keeps_the_others_news() -> None:
    book = ProgressBook()
    book.apply([msg(MessageKind.PROGRESS, 0, 1.0, 1, job="a"), msg(MessageKind.PROGRESS, 0, 2.0, 3, job="b")])
    final = book.take("a", 0)
    assert final is not None and final.last_step == 1
    assert book.take("a", 0) is None, "a finished worker is gone from the book"
    assert by_worker(book.take_dirty()) == {("b", 0): WorkerProgress(
        job="b", attempt=0, ranks=(RankInfo(rank=0, local_rank=0, pid=1000),), first_step=3, first_progress_at=2.0,
        last_step=3, last_progress_at=2.0)}, "b's news was not lost by taking a"
    book.apply([msg(MessageKind.PROGRESS, 0, 4.0, 2, job="a", attempt=0)])
    assert book.take_dirty()[0].first_step == 2, "a worker taken out starts over"


def test_the_current_report_repeats_a_silent_workers_last_step_and_forgets_older_attempts() -> None:
    """What the Kubernetes agent writes into its Lease every renewal: a stopped rank's worker must keep
    showing its last progress (the operator times the hang from it), not vanish once reported."""
    book = ProgressBook()
    book.apply([msg(MessageKind.PROGRESS, 0, 1.0, 4, job="a", attempt=0), msg(MessageKind.PROGRESS, 0, 2.0, 7, job="b")])
    first = book.current()
    assert [(r.job, r.attempt, r.last_step) for r in first] == [("a", 0, 4), ("b", 0, 7)]
    assert book.current() == first, "no news: the same report again"
    book.apply([msg(MessageKind.PROGRESS, 0, 9.0, 1, job="a", attempt=1)])
    assert [(r.job, r.attempt, r.last_step) for r in book.current()] == [("a", 1, 1), ("b", 0, 7)]


# -- the training API outside an agent --------------------------------------------------

INIT = """
import json, os, sys
from pathlib import Path
import unbroken

out = {}
ctx = unbroken.init(checkpoint_dir=sys.argv[1])
ctx.progress(1, loss=0.5)
ctx.progress(2)
import torch.distributed as dist
out["plain"] = dict(rank=ctx.rank, world=ctx.world_size, local_rank=ctx.local_rank, job=ctx.job,
                    attempt=ctx.attempt, node=ctx.node, is_main=ctx.is_main, dir=str(ctx.checkpoint.directory),
                    dist=dist.is_initialized(), uname=os.uname().nodename)
ctx.checkpoint.save(1, {"w": 1})
out["restored"] = ctx.checkpoint.restore().step

os.environ["TORCHELASTIC_RUN_ID"] = "run-42"
ctx = unbroken.init()
ctx.progress(1)
out["torchelastic"] = dict(job=ctx.job, dir=str(ctx.checkpoint.directory))

os.environ["UNBROKEN_CHECKPOINT_DIR"] = sys.argv[2]
out["env_dir"] = str(unbroken.init().checkpoint.directory)
print(json.dumps(out))
"""


def test_init_outside_an_agent(tmp_path: Path) -> None:
    out = json.loads(run_python(INIT, str(tmp_path / "ck-arg"), str(tmp_path / "ck-env"), cwd=tmp_path).stdout)
    plain = out["plain"]
    assert plain == dict(rank=0, world=1, local_rank=0, job="local", attempt=0, node=plain["uname"], is_main=True,
                         dir=str(tmp_path / "ck-arg"), dist=False, uname=plain["uname"])
    assert out["restored"] == 1
    assert (tmp_path / "ck-arg" / "step-000000001" / "manifest.json").exists()
    assert out["torchelastic"] == {"job": "run-42", "dir": "checkpoints"}
    assert out["env_dir"] == str(tmp_path / "ck-env")


def test_import_unbroken_does_not_import_torch(tmp_path: Path) -> None:
    code = """
    import sys
    import unbroken, unbroken.checkpoint, unbroken.rank.channel, unbroken.rank.env
    print("torch" in sys.modules, sorted(m for m in sys.modules if m.startswith("torch")))
    """
    assert run_python(code, cwd=tmp_path).stdout.strip() == "False []"
