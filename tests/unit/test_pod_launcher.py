"""``unbroken run``'s arguments and its round coordinator (kubernetes/pod_launcher/), the coordinator over real TCP sockets.

The launcher end to end (two launchers, a killed rank, the same final model) is in
tests/integration/test_unbroken_run.py; on the real control plane in test_kubernetes_launcher.py.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from helpers import run_cli
from unbroken.rank.channel import AgentReceiver, MessageKind, RankMessage, RankSender
from unbroken.errors import ConfigError
from unbroken.rank.env import AGENT_SOCKET, ENDPOINT_FILE, LaunchEnv
from unbroken.kubernetes.pod_launcher import arguments
from unbroken.kubernetes.pod_launcher.coordinator import Coordinator, Phase
from unbroken.kubernetes.pod_launcher.protocol import Kind, Message
from unbroken.kubernetes.pod_launcher.relay import ProgressRelay, relay_path
from unbroken.plumbing.ports import free_port
from unbroken.plumbing.waiting import wait_until

PET = {"PET_NNODES": "4", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "2", "PET_MASTER_ADDR": "llama-master-0",
       "PET_MASTER_PORT": "23456"}


def test_the_pods_environment_is_read_as_torchrun_reads_it_and_the_command_line_wins() -> None:
    run = arguments.parse(["train.py", "--lr", "3e-4"], PET)
    assert (run.nnodes, run.nproc_per_node, run.node_rank, run.master_addr, run.master_port) == (4, 8, 2, "llama-master-0", 23456)
    assert run.command == ["train.py", "--lr", "3e-4"] and run.coordinator_port == 23457
    assert arguments.parse(["--nproc-per-node=2", "--node_rank", "0", "-m", "pkg.train", "--steps", "5"], PET).command == \
        ["-m", "pkg.train", "--steps", "5"]
    # torchrun's rendezvous and logging options are accepted (a pod's command may carry them) and not used
    run = arguments.parse(["--rdzv-backend", "c10d", "--rdzv_endpoint", "x:1", "--tee", "3", "--max-restarts", "2", "t.py"], PET)
    assert run.max_restarts == 2 and run.command == ["t.py"]
    assert (run.hang_in_place, run.hang_timeout) == (True, None)  # hangs in place, timed from the ranks' steps
    assert (lambda r: (r.hang_in_place, r.hang_timeout))(arguments.parse(["--hang-timeout", "off", "t.py"], PET)) == (False, None)
    assert arguments.parse(["--hang-timeout", "120", "t.py"], PET).hang_timeout == 120.0


@pytest.mark.parametrize(("argv", "words"), [
    (["--nnodes", "3:2", "t.py"], "--nnodes 3:2: MIN is more than MAX (valid: e.g. 2:4)"),
    (["--spare-pods", "4", "t.py"], "--spare-pods 4: must be fewer than --nnodes 4 (some pod must train)"),
    (["--nnodes", "2:3", "--spare-pods", "1", "t.py"], "--spare-pods 1 with --nnodes 2:3: an elastic job's spare pods are"),
    (["--node-rank", "4", "t.py"], "--node-rank 4: must be below --nnodes 4"),
    (["--nproc-per-node", "eight", "t.py"], "--nproc-per-node eight: must be a whole number, at least 1"),
    (["--max-restarts", "-1", "t.py"], "--max-restarts -1: must be a whole number, at least 0"),
    (["--abort-timeout", "0", "t.py"], "--abort-timeout 0: must be a number of seconds above 0"),
    (["--hang-timeout", "soon", "t.py"], "--hang-timeout soon: must be off, auto, or a number of seconds above 0"),
    (["--no-python", "t.sh"], "--no-python: the ranks must be Python processes"),
])
def test_a_bad_argument_is_named_with_what_would_be_valid(argv: list[str], words: str) -> None:
    with pytest.raises(ConfigError, match="unbroken run " + words.replace("(", r"\(").replace(")", r"\)")):
        arguments.parse(argv, PET)


def test_unbroken_run_with_a_bad_argument_exits_2_with_one_line_and_no_traceback() -> None:
    result = run_cli("run", "--nnodes", "3:2", "train.py", check=False)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: unbroken run --nnodes 3:2: MIN is more than MAX (valid: e.g. 2:4)"


def test_spare_pods_and_elastic_sizes_are_read_from_the_pods_environment() -> None:
    # a fixed job of 4 replicas with 1 spare pod: 3 train (node rank 3 is told to stand by: coordinator.py)
    run = arguments.parse(["--spare-pods", "1", "t.py"], {**PET, "PET_NODE_RANK": "3"})
    assert (run.nnodes, run.fewest, run.node_rank) == (3, 3, 3)
    # training-operator's elastic job: PET_NNODES is min:max
    elastic = {**PET, "PET_NNODES": "2:3"}
    assert (lambda r: (r.fewest, r.nnodes))(arguments.parse(["t.py"], elastic)) == (2, 3)
    # without a Master, training-operator sets no PET_NODE_RANK: said plainly, not guessed
    without_rank = {k: v for k, v in elastic.items() if k != "PET_NODE_RANK"}
    with pytest.raises(ConfigError, match=r"no --node-rank and no PET_NODE_RANK: node rank 0 hosts the job's coordinator"):
        arguments.parse(["t.py"], without_rank)


def test_a_message_survives_the_wire_and_junk_is_refused() -> None:
    message = Message(Kind.BROKEN, round=3, why="rank 5 exited with signal 9", fault=True)
    assert Message.parse(message.line().strip()) == message
    for junk in (b"not json", b'{"kind": "reboot"}', b'{"kind": "join", "round": "1"}', b"[1, 2]"):
        with pytest.raises(ValueError):
            Message.parse(junk)


class Member:
    """A launcher as the coordinator sees it: a TCP connection that says hello and reads what comes; ``first``: the
    answer to its hello (round 0's "join", or "stand_by"), read when first asked for (an elastic job's round 0
    answers only once it forms)."""

    def __init__(self, port: int, node_rank: int, *, answered_now: bool = True) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.file = self.sock.makefile("rb")
        self.send(Message(Kind.HELLO, node_rank=node_rank))
        self._first: Message | None = self.receive() if answered_now else None

    @property
    def first(self) -> Message:
        if self._first is None:
            self._first = self.receive()
        return self._first

    def send(self, message: Message) -> None:
        self.sock.sendall(message.line())

    def receive(self) -> Message:
        line = self.file.readline()
        assert line, "the coordinator closed the connection"
        return Message.parse(line)

    def close(self) -> None:
        self.file.close()
        self.sock.close()


@contextmanager
def running(coordinator: Coordinator) -> Iterator[Coordinator]:
    coordinator.start()
    try:
        yield coordinator
    finally:
        coordinator.close()


@pytest.fixture
def coordinator() -> Iterator[Coordinator]:
    result = Coordinator(3, free_port(), max_restarts=2, gather_timeout=30, first_port=29500)
    result.start()
    yield result
    result.close()


def members(coordinator: Coordinator, n: int = 3) -> list[Member]:
    joined = [Member(coordinator.port, rank, answered_now=False) for rank in range(n)]  # an elastic job answers all at once
    wait_until(lambda: coordinator.state.seen == set(range(n)), 5, "every hello")
    for member in joined:
        assert member.first.kind is Kind.JOIN
    return joined


def test_a_broken_round_holds_every_pod_then_all_join_the_next_on_a_new_port(coordinator: Coordinator) -> None:
    pods = members(coordinator)
    # each first-round pod's hello is answered with round 0's place: its store at MASTER_PORT
    assert [p.first for p in pods] == [Message(Kind.JOIN, round=0, port=29500, group_rank=r, nnodes=3) for r in range(3)]
    pods[0].send(Message(Kind.BROKEN, round=0, why="rank 0: RuntimeError: Connection reset by peer"))
    assert [p.receive() for p in pods] == [Message(Kind.HOLD, round=0, why="node rank 0: rank 0: RuntimeError: Connection "
                                                                           "reset by peer")] * 3
    # the pod whose rank failed reports later than a survivor that saw the group fail: its word is the cause
    pods[2].send(Message(Kind.BROKEN, round=0, why="rank 2 (local rank 0) exited with signal 9 (SIGKILL)", fault=True))
    wait_until(lambda: coordinator.state.cause.startswith("node rank 2: rank 2"), 5, "the cause named")
    for pod in pods[:2]:
        pod.send(Message(Kind.READY, round=0))
    pods[1].send(Message(Kind.READY, round=0))  # twice: counted once
    pods[2].send(Message(Kind.READY, round=7))  # another round's: not counted
    assert coordinator.state.phase is Phase.GATHERING
    pods[2].send(Message(Kind.READY, round=0))
    joins = [p.receive() for p in pods]
    assert {(m.kind, m.round) for m in joins} == {(Kind.JOIN, 1)} and len({m.port for m in joins}) == 1 and joins[0].port
    assert coordinator.state.phase is Phase.RUNNING and coordinator.state.round == 1
    # a late report of the old round does not break the new one
    pods[0].send(Message(Kind.BROKEN, round=0, why="late"))
    pods[0].send(Message(Kind.BROKEN, round=1, why="again"))
    assert pods[1].receive() == Message(Kind.HOLD, round=1, why="node rank 0: again")


def test_a_pod_gone_while_gathering_gives_up_for_a_full_restart(coordinator: Coordinator) -> None:
    pods = members(coordinator)
    pods[1].send(Message(Kind.BROKEN, round=0, why="rank 1 exited with code 1", fault=True))
    assert [p.receive().kind for p in pods] == [Kind.HOLD] * 3
    pods[2].close()  # its node went down with it
    assert pods[0].receive() == Message(Kind.GIVE_UP, why="node rank 1: rank 1 exited with code 1; and the pod of node rank 2 "
                                                          "is gone; 2 of the job's 3 pods are left and no spare pod is warm")
    assert pods[1].receive().kind is Kind.GIVE_UP


def test_a_pod_gone_while_running_without_a_spare_pod_is_a_full_restart_at_once(coordinator: Coordinator) -> None:
    pods = members(coordinator)
    pods[0].send(Message(Kind.DONE))
    pods[0].close()  # finished: not lost
    pods[2].close()
    assert pods[1].receive() == Message(Kind.GIVE_UP, why="the pod of node rank 2 is gone; 2 of the job's 3 pods are left "
                                                          "and no spare pod is warm")


def held_then_joined(pods: dict[int, Member], ready: list[int], round_number: int = 0) -> dict[int, Message]:
    """Every pod of ``ready`` gets "hold" and says ready; what each of ``pods`` is told next."""
    for node_rank in ready:
        assert pods[node_rank].receive().kind is Kind.HOLD
        pods[node_rank].send(Message(Kind.READY, round=round_number))
    return {node_rank: pod.receive() for node_rank, pod in pods.items()}


def test_a_lost_pods_place_goes_to_a_warm_spare_pod_and_a_cold_one_is_not_counted(coordinator: Coordinator) -> None:
    pods = dict(enumerate(members(coordinator)))
    spare, cold = Member(coordinator.port, 3), Member(coordinator.port, 4)  # spare pods: node ranks past the size
    assert spare.first == cold.first == Message(Kind.STAND_BY)
    spare.send(Message(Kind.STANDBY))
    wait_until(lambda: coordinator.state.standby == [3], 5, "the warm spare pod counted")
    pods[1].close()  # its node is gone
    joins = held_then_joined({0: pods[0], 2: pods[2], 3: spare}, ready=[0, 2])
    # the spare takes group rank 1, the lost pod's; the others keep theirs; the cold spare pod gets nothing
    assert {n: (m.kind, m.round, m.group_rank, m.nnodes) for n, m in joins.items()} == \
        {0: (Kind.JOIN, 1, 0, 3), 2: (Kind.JOIN, 1, 2, 3), 3: (Kind.JOIN, 1, 1, 3)}
    assert coordinator.state.training == [0, 3, 2] and coordinator.state.standby == []
    assert "the pod of node rank 1 is gone" in coordinator.state.cause
    # the next loss finds no warm spare pod (node rank 4 never said standby): a full restart
    spare.close()
    assert pods[0].receive().why == "the pod of node rank 3 is gone; 2 of the job's 3 pods are left and no spare pod is warm"
    cold.close()


def test_a_spare_pod_never_needed_is_told_when_every_training_pod_is_done(coordinator: Coordinator) -> None:
    pods = members(coordinator)
    spare = Member(coordinator.port, 3)
    for pod in pods[:2]:
        pod.send(Message(Kind.DONE))
    wait_until(lambda: coordinator.state.done == {0, 1}, 5, "two pods done")
    assert not coordinator.state.finished
    pods[2].send(Message(Kind.DONE))
    assert spare.receive() == Message(Kind.DONE) and coordinator.state.finished


def test_an_elastic_job_with_fewer_pods_than_its_max_starts_after_the_last_call_and_grows_when_one_comes() -> None:
    """``--nnodes 2:3`` and two replicas (an elasticPolicy whose max is above the replicas): round 0 cannot wait for
    a third pod that may never come. It forms with two once the last call passed with no more; a pod that comes
    later stands by and grows the job."""
    with running(Coordinator(3, free_port(), max_restarts=2, gather_timeout=30, fewest=2, first_port=29500, last_call=0.5)) as coordinator:
        pods = [Member(coordinator.port, 1, answered_now=False)]
        wait_until(lambda: coordinator.state.arrived.keys() == {1}, 5, "node rank 1's hello")
        pods.insert(0, Member(coordinator.port, 0))
        assert [p.first for p in pods] == [Message(Kind.JOIN, round=0, port=29500, group_rank=r, nnodes=2) for r in range(2)]
        assert coordinator.state.training == [0, 1] and coordinator.state.phase is Phase.RUNNING
        late = Member(coordinator.port, 2)
        assert late.first == Message(Kind.STAND_BY)
        late.send(Message(Kind.STANDBY))
        joins = held_then_joined({0: pods[0], 1: pods[1], 2: late}, ready=[0, 1])
        assert {n: (m.kind, m.group_rank, m.nnodes) for n, m in joins.items()} == \
            {0: (Kind.JOIN, 0, 3), 1: (Kind.JOIN, 1, 3), 2: (Kind.JOIN, 2, 3)}


def test_an_elastic_job_waits_for_node_rank_0_and_forms_at_once_with_its_max() -> None:
    with running(Coordinator(2, free_port(), max_restarts=2, gather_timeout=30, fewest=1, last_call=60)) as coordinator:
        worker = Member(coordinator.port, 1, answered_now=False)
        wait_until(lambda: coordinator.state.arrived.keys() == {1}, 5, "node rank 1's hello")
        assert coordinator.state.phase is Phase.FORMING, "min 1 reached, but without node rank 0 (the store's host)"
        master = Member(coordinator.port, 0)  # the max: no last call
        assert master.first == Message(Kind.JOIN, round=0, port=0, group_rank=0, nnodes=2)
        assert worker.first == Message(Kind.JOIN, round=0, port=0, group_rank=1, nnodes=2)


def test_a_spare_pod_takes_the_place_of_a_pod_not_there_at_the_start() -> None:
    """``--nnodes 3 --spare-pods 1`` (2 train): node rank 1's pod is not scheduled (its node is missing). Round 0 forms
    after the last call with the spare pod (node rank 2) in its place, not a full restart; node rank 1's pod, when it
    comes, stands by."""
    with running(Coordinator(2, free_port(), max_restarts=2, gather_timeout=30, first_port=29500, last_call=0.5, spare_pods=1)) as coordinator:
        spare = Member(coordinator.port, 2, answered_now=False)
        master = Member(coordinator.port, 0, answered_now=False)
        assert master.first == Message(Kind.JOIN, round=0, port=29500, group_rank=0, nnodes=2)
        assert spare.first == Message(Kind.JOIN, round=0, port=29500, group_rank=1, nnodes=2)
        assert coordinator.state.training == [0, 2]
        assert Member(coordinator.port, 1).first == Message(Kind.STAND_BY)


def test_with_every_pod_there_round_0_is_node_ranks_below_the_size_at_once_and_the_spare_pod_stands_by() -> None:
    with running(Coordinator(2, free_port(), max_restarts=2, gather_timeout=30, last_call=60, spare_pods=1)) as coordinator:
        spare = Member(coordinator.port, 2, answered_now=False)  # first to come, still the spare pod
        pods = [Member(coordinator.port, n, answered_now=False) for n in (1, 0)]
        assert [p.first.group_rank for p in pods] == [1, 0] and spare.first == Message(Kind.STAND_BY)


def test_a_round_broken_after_a_pod_is_done_gives_up_at_once(coordinator: Coordinator) -> None:
    """The end of a job: one pod's ranks exited 0, another pod's launcher then declares a hang (its ranks' exit is
    slow). The done pod cannot join a next round, so the coordinator says so now, not after the gather timeout."""
    pods = members(coordinator)
    pods[1].send(Message(Kind.DONE))
    wait_until(lambda: coordinator.state.done == {1}, 5, "a pod done")
    pods[0].send(Message(Kind.BROKEN, round=0, why="no step from this pod's ranks for 1.5 s (a hang)"))
    assert pods[0].receive() == Message(Kind.GIVE_UP, why="node rank 0: no step from this pod's ranks for 1.5 s (a hang); "
                                                          "node ranks [1] are done (every rank there exited 0) and cannot "
                                                          "join a next round")


def test_an_elastic_job_shrinks_down_to_its_min_and_grows_back_when_a_pod_returns_without_a_restart_counted() -> None:
    with running(Coordinator(3, free_port(), max_restarts=2, gather_timeout=30, fewest=2)) as coordinator:
        pods = dict(enumerate(members(coordinator)))
        pods[1].close()
        joins = held_then_joined({0: pods[0], 2: pods[2]}, ready=[0, 2])
        assert {n: (m.group_rank, m.nnodes) for n, m in joins.items()} == {0: (0, 2), 2: (1, 2)}  # closed up, in order
        # node rank 1's pod, recreated on a node that came back, warms and stands by: the job grows at once
        back = Member(coordinator.port, 1)
        assert back.first == Message(Kind.STAND_BY)  # not round 0's join: its place was given up
        back.send(Message(Kind.STANDBY))
        joins = held_then_joined({0: pods[0], 2: pods[2], 1: back}, ready=[0, 2], round_number=1)
        assert {n: (m.round, m.group_rank, m.nnodes) for n, m in joins.items()} == {0: (2, 0, 3), 2: (2, 1, 3), 1: (2, 2, 3)}
        assert coordinator.state.restarts == 1  # the grow is not a restart
        assert coordinator.state.cause == "spare pod (node rank 1) is warm: growing from 2 to 3 pods"
        pods[2].close()  # shrinks again, to its min: the second restart of --max-restarts 2
        joins = held_then_joined({0: pods[0], 1: back}, ready=[0, 1], round_number=2)
        assert {n: (m.round, m.group_rank, m.nnodes) for n, m in joins.items()} == {0: (3, 0, 2), 1: (3, 1, 2)}
        back.close()
        assert pods[0].receive().why == "the pod of node rank 1 is gone; the 2 in-place restarts allowed (--max-restarts) are used"


def test_below_an_elastic_jobs_min_is_a_full_restart() -> None:
    with running(Coordinator(3, free_port(), max_restarts=5, gather_timeout=30, fewest=3 - 1)) as coordinator:
        pods = members(coordinator)
        pods[1].send(Message(Kind.BROKEN, round=0, why="rank 1 exited with code 1", fault=True))
        assert pods[0].receive().kind is Kind.HOLD
        pods[1].close()
        pods[2].close()
        assert pods[0].receive().why == ("node rank 1: rank 1 exited with code 1; and the pod of node rank 2 is gone; 1 pod "
                                         "is left, no spare pod is warm, and the job needs at least 2 (--nnodes 2:3)")


def test_restarts_past_max_restarts_and_a_launcher_started_again_give_up(coordinator: Coordinator) -> None:
    pods = members(coordinator)
    for round_number in range(2):
        pods[0].send(Message(Kind.BROKEN, round=round_number, why="boom", fault=True))
        for pod in pods:
            assert pod.receive().kind is Kind.HOLD
            pod.send(Message(Kind.READY, round=round_number))
        assert {p.receive().kind for p in pods} == {Kind.JOIN}
    pods[0].send(Message(Kind.BROKEN, round=2, why="boom", fault=True))
    assert pods[1].receive().why == "node rank 0: boom; the 2 in-place restarts allowed (--max-restarts) are used"

    other = Coordinator(2, free_port(), max_restarts=2, gather_timeout=30)
    other.start()
    try:
        first = Member(other.port, 0)
        old = Member(other.port, 1)
        wait_until(lambda: other.state.seen == {0, 1}, 5, "both hellos")
        again = Member(other.port, 1)  # node rank 1's container restarted: its ranks are new, round 0
        assert first.receive() == Message(Kind.GIVE_UP, why="the launcher of node rank 1 started again")
        assert again.receive().kind is Kind.GIVE_UP
        old.close()
    finally:
        other.close()


def test_pods_not_ready_within_the_gather_timeout_are_named_and_junk_is_ignored() -> None:
    with running(Coordinator(3, free_port(), max_restarts=2, gather_timeout=0.3)) as coordinator:
        pods = members(coordinator)
        pods[1].sock.sendall(b"this is no message\n" + json.dumps({"kind": "hello", "node_rank": 9}).encode() + b"\n")
        pods[0].send(Message(Kind.BROKEN, round=0, why="x"))
        assert pods[1].receive().kind is Kind.HOLD
        pods[0].send(Message(Kind.READY, round=0))
        assert pods[1].receive() == Message(Kind.GIVE_UP, why="node ranks [1, 2] were not ready for round 1 within 0.3 s")


def test_the_relay_passes_every_datagram_to_the_agent_and_counts_the_ranks_that_stepped(tmp_path: Path) -> None:
    agent_dir = tmp_path / "agent"
    receiver = AgentReceiver(agent_dir / "agent.sock")
    (agent_dir / ENDPOINT_FILE).write_text("10.0.0.7:9402")
    relay = ProgressRelay(tmp_path / "run" / "agent.sock", agent_dir / "agent.sock")
    try:
        started = time.time()
        sender = RankSender(relay.path)
        for local_rank, kind in ((0, MessageKind.HELLO), (0, MessageKind.PROGRESS), (1, MessageKind.PROGRESS), (0, MessageKind.PROGRESS)):
            sender.send(RankMessage(kind=kind, job="ns/llama", attempt=2, rank=8 + local_rank, local_rank=local_rank, pid=100 + local_rank,
                                    ts=time.time(), step=None if kind is MessageKind.HELLO else 7))
        got: list[RankMessage] = []
        wait_until(lambda: len(got) == 4 or got.extend(receiver.drain()), 5, "the four datagrams at the agent")
        assert [(m.kind, m.local_rank) for m in got] == [(MessageKind.HELLO, 0), (MessageKind.PROGRESS, 0), (MessageKind.PROGRESS, 1),
                                                         (MessageKind.PROGRESS, 0)]
        assert relay.stepped_since(started) == 2 and relay.stepped_since(time.time() + 1) == 0
        # the ranks find the agent's shard server beside the socket they send to, as without the relay
        assert LaunchEnv.from_environ({AGENT_SOCKET: str(relay.path)}).advertised_endpoint == "10.0.0.7:9402"
    finally:
        relay.close()
        receiver.close()


def test_without_a_node_agent_the_relay_still_counts_and_a_long_run_folder_gets_a_short_socket(tmp_path: Path) -> None:
    relay = ProgressRelay(tmp_path / "agent.sock", None)
    try:
        RankSender(relay.path).send(RankMessage(kind=MessageKind.PROGRESS, job="j", attempt=0, rank=0, local_rank=0, pid=1,
                                                ts=time.time(), step=1))
        wait_until(lambda: relay.stepped_since(0) == 1, 5, "the step counted")
    finally:
        relay.close()
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    assert len(str(relay_path(deep))) <= 100 and relay_path(deep).name == "agent.sock"


def test_node_rank_0_whose_coordinator_port_is_taken_exits_2_naming_the_port() -> None:
    with socket.create_server(("", 0)) as taken:
        port = taken.getsockname()[1]
        result = run_cli("run", "--nnodes", "2", "--node-rank", "0", "--coordinator-port", str(port), "train.py", check=False, timeout=60)
    assert result.returncode == 2
    assert f"error: unbroken run --coordinator-port {port}: cannot listen there (Address already in use)" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_hang_watch_times_a_hang_at_half_the_operators_timeout_and_a_leave_in_a_few_steps() -> None:
    from unbroken.kubernetes.pod_launcher.hang import HangWatch

    clock = HangWatch()
    clock.new_round(1000.0)
    assert clock.timeout() is None and clock.silent_for(1001.0) is None  # nothing measured: no hang declared
    assert clock.leave_timeout(10.0) == 10.0
    for step in range(12):  # 50 ms steps on local ranks 0 and 1; one pause of 0.4 s (a checkpoint)
        at = 1000.1 + step * 0.05 + (0.4 if step >= 6 else 0.0)
        clock.observe(0, at)
        clock.observe(1, at + 0.01)
    assert clock.median_step() == pytest.approx(0.05)
    # the operator's rule at half its size, floor included: max(3 s, 20 x 50 ms, 2 x the 0.45 s pause) / 2
    assert clock.timeout() == pytest.approx(1.5) and clock.timeout(job_timeout=60.0) == 30.0
    assert clock.silent_for(1000.1 + 11 * 0.05 + 0.4 + 2.0) == pytest.approx(2.0 - 0.01)
    assert clock.leave_timeout(10.0) == 0.5 and clock.leave_timeout(0.2) == 0.2
    # a new round forgets the last one's steps (the restart's pause is not the job's) but not its pauses, and
    # declares no hang before it took 10 steps of its own (a restore, a spare warming beside it)
    clock.new_round(2000.0)
    clock.observe(0, 1999.0)
    assert clock.silent_for(2001.0) is None and clock.timeout() is None
    for step in range(11):
        clock.observe(0, 2000.1 + step * 0.05)
    assert clock.timeout() == pytest.approx(1.5)
    clock.observe(0, 2000.1 + 10 * 0.05 + 2.0)  # a 2 s pause: its double is past the operator's floor
    assert clock.timeout() == pytest.approx(2.0)
    # a rank whose training returned (MessageKind.FINISHED) is exiting, not hung: its silence is not counted
    clock.observe(1, 2002.5)
    clock.finished(0, 2002.7)
    assert clock.silent_for(2010.0) == pytest.approx(7.5)
    clock.finished(1, 2002.8)
    assert clock.silent_for(2010.0) is None


def test_the_hang_watch_says_when_the_last_of_the_pods_ranks_finished_this_round() -> None:
    """What ``unbroken run`` times a finished pod's lingering teardown from (member.py ``_lingering``): None until every
    local rank said it finished in this round; a finish from before the round does not count."""
    from unbroken.kubernetes.pod_launcher.hang import HangWatch

    clock = HangWatch()
    clock.new_round(1000.0)
    clock.finished(0, 999.0)  # the last round's
    clock.finished(1, 1010.0)
    assert clock.all_finished_at(2) is None
    clock.finished(0, 1012.5)
    assert clock.all_finished_at(2) == 1012.5 and clock.all_finished_at(3) is None
    clock.new_round(2000.0)
    assert clock.all_finished_at(2) is None
