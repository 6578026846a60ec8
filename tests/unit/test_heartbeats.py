"""Heartbeat datagrams (kubernetes/backend/heartbeats.py) over real UDP sockets on loopback, signed with per-node keys
made from a master key in a real Secret on the real API server, and how the Kubernetes store turns datagrams and Leases into a node's heartbeat."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import kubernetes
import pytest

from unbroken.kubernetes.backend import heartbeats, names
from unbroken.kubernetes.backend.client import api_client
from unbroken.kubernetes.backend.heartbeats import Beat, HeartbeatBoard, HeartbeatSender
from unbroken.kubernetes.backend.store import KubernetesStore
from unbroken.state.records import RankInfo, RankTiming, StepTiming, WorkerProgress
from unbroken.plumbing.waiting import wait_until

pytestmark = pytest.mark.timeout(60)
MASTER = b"k" * 32
KEY = heartbeats.node_key(MASTER, "gpu-1")
"""gpu-1's key, as the operator gives it to gpu-1's agent."""
REPORT = WorkerProgress(job="ns/llama", attempt=1, ranks=(RankInfo(rank=0, local_rank=0, pid=42),), last_step=17,
                        last_progress_at=1_700_000_000.5)


@pytest.fixture
def board() -> Iterator[HeartbeatBoard]:
    board = HeartbeatBoard("127.0.0.1", 0)
    board.master = MASTER
    yield board
    board.close()


def sender_to(board: HeartbeatBoard, node: str = "gpu-1") -> HeartbeatSender:
    sender = HeartbeatSender(heartbeats.node_key(MASTER, node), node)
    sender.address = ("127.0.0.1", board.port)
    return sender


def test_a_beat_carries_the_ranks_progress_to_the_board(board: HeartbeatBoard) -> None:
    sender = sender_to(board)
    before = time.time()
    assert sender.send([REPORT])
    heard = wait_until(lambda: board.heard("gpu-1"), 5, "the beat to arrive")
    assert heard.progress == (REPORT,) and heard.at >= before and not heard.leaving
    assert sender.send([], leaving=True)
    assert wait_until(lambda: board.heard("gpu-1").leaving, 5, "the leaving beat")
    assert board.received == 2 and board.rejected == 0


def test_forged_replayed_and_skewed_datagrams_are_dropped_and_counted(board: HeartbeatBoard) -> None:
    now = time.time()
    good = heartbeats.encode(KEY, Beat("gpu-1", "agent-a", 5, now))
    assert board.accept(good, now)
    assert not board.accept(heartbeats.encode(b"x" * 32, Beat("gpu-2", "agent-b", 1, now)), now), "another key"
    assert not board.accept(good, now + 1), "a replay of sequence 5"
    assert not board.accept(heartbeats.encode(KEY, Beat("gpu-1", "agent-a", 4, now)), now + 1), "an older sequence"
    assert not board.accept(heartbeats.encode(KEY, Beat("gpu-1", "agent-c", 1, now - 120)), now), "sent 2 minutes ago"
    assert not board.accept(good[:-3], now), "truncated"
    assert not board.accept(b"", now)
    assert board.accept(heartbeats.encode(KEY, Beat("gpu-1", "agent-c", 1, now)), now + 2), "a restarted agent starts at 1"
    assert board.rejected == 6 and board.received == 2
    assert board.heard("gpu-2") is None and board.heard("gpu-1").at == now + 2


def test_a_node_signs_for_itself_alone(board: HeartbeatBoard) -> None:
    """A compromised node holds its own key: a beat it signs for another node is dropped, so it cannot keep a dead
    node alive."""
    now = time.time()
    assert not board.accept(heartbeats.encode(KEY, Beat("gpu-2", "agent-b", 1, now)), now), "gpu-1's key for gpu-2"
    assert not board.accept(heartbeats.encode(MASTER, Beat("gpu-2", "agent-b", 1, now)), now), "the master key itself"
    assert not board.accept(b"\0" * 32 + b"not json", now), "no node named"
    assert board.heard("gpu-2") is None and board.rejected == 3
    assert board.accept(heartbeats.encode(heartbeats.node_key(MASTER, "gpu-2"), Beat("gpu-2", "agent-b", 1, now)), now)


def test_a_board_without_the_key_drops_everything(board: HeartbeatBoard) -> None:
    board.master = None
    assert not board.accept(heartbeats.encode(KEY, Beat("gpu-1", "agent-a", 1, time.time())), time.time())


def test_a_beat_too_large_for_a_datagram_goes_without_its_progress(board: HeartbeatBoard) -> None:
    many = [WorkerProgress(job=f"ns/job-{i:05d}-{'x' * 40}", attempt=i, last_step=i) for i in range(1000)]
    datagram = heartbeats.encode(KEY, Beat("gpu-1", "agent-a", 1, time.time(), tuple(many)))
    assert len(datagram) <= heartbeats.MAX_DATAGRAM
    sender_to(board).send(many)
    heard = wait_until(lambda: board.heard("gpu-1"), 5, "the beat to arrive")
    assert heard.progress == ()


def test_a_beat_carries_step_timing_and_sheds_it_before_its_progress(board: HeartbeatBoard) -> None:
    timing = StepTiming(steps=30, median_s=0.1, longest_s=0.4, work_s=0.05, sections={"compute": 0.04},
                        slowest=RankTiming(0, 0.05, {"compute": 0.04}))
    timed = replace(REPORT, step_timing=timing)
    assert sender_to(board).send([timed])
    assert wait_until(lambda: board.heard("gpu-1"), 5, "the beat").progress == (timed,)
    # a timing too big for a datagram (a foreign agent's: ours sums its ranks up in a few hundred bytes)
    # goes; the progress stays
    wide = StepTiming(steps=30, median_s=0.1, longest_s=0.4, work_s=0.05, sections={f"section-{s:05d}": 0.01 for s in range(4000)},
                      slowest=RankTiming(0, 0.05))
    assert sender_to(board, node="gpu-2").send([replace(REPORT, step_timing=wide)])
    assert wait_until(lambda: board.heard("gpu-2"), 5, "the big beat").progress == (REPORT,)


def test_a_beat_to_nowhere_is_not_an_error() -> None:
    free = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    sender = HeartbeatSender(KEY, "gpu-1")
    assert not sender.send([]), "no leader address known"
    sender.address = ("127.0.0.1", port)
    for _ in range(3):
        sender.send([])  # nobody listens: UDP drops it; the next beat tries again


# --- against the real API server ----------------------------------------------------------------


@pytest.fixture
def api(kubeconfig: Path, namespace: str) -> kubernetes.client.ApiClient:
    return api_client(kubeconfig)


def test_the_operator_makes_the_master_key_once_and_each_node_gets_its_own(api: kubernetes.client.ApiClient,
                                                                          namespace: str) -> None:
    first = heartbeats.ensure_key(api, namespace)
    assert len(first) == 32
    assert heartbeats.ensure_key(api, namespace) == first, "a second leader keeps the key"
    one, two = heartbeats.node_key(first, "gpu-1"), heartbeats.node_key(first, "gpu-2")
    assert one != two and one != first and heartbeats.node_key(first, "gpu-1") == one


def make_node(api: kubernetes.client.ApiClient) -> str:
    name = f"node-{uuid.uuid4().hex[:6]}"
    kubernetes.client.CoreV1Api(api).create_node({"metadata": {"name": name},
                                                  "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    return name


def test_datagrams_are_the_heartbeat_and_the_lease_the_backstop(api: kubernetes.client.ApiClient, namespace: str,
                                                                board: HeartbeatBoard) -> None:
    store = KubernetesStore(api, namespace)
    store.heartbeats = board
    store.lease_renew_seconds, store.heartbeat_interval = 10.0, 1.0
    node = make_node(api)
    now = time.time()

    store.renew_lease(node, at=now - 30)
    assert store.get_node(node).heartbeat_at == pytest.approx(now - 20, abs=0.5), \
        "heard nothing yet (a new leader): the Lease vouches until its next renewal is due"
    assert board.accept(heartbeats.encode(heartbeats.node_key(MASTER, node), Beat(node, "a", 1, now, (REPORT,))), now - 2)
    assert store.get_node(node).heartbeat_at == pytest.approx(now - 2), "the datagram is newer: it is the heartbeat"
    assert store.lease_progress()[("ns/llama", 1, node)] == REPORT
    store.renew_lease(node, at=now - 1.5)
    assert store.get_node(node).heartbeat_at == pytest.approx(now - 2), \
        "a renewal within a beat of the last datagram is the same agent's: the datagrams decide"
    store.renew_lease(node, at=now)
    assert store.get_node(node).heartbeat_at == pytest.approx(now, abs=0.5), \
        "renewed well after the last datagram (its beats do not get through): the Lease vouches"
    assert board.accept(heartbeats.encode(heartbeats.node_key(MASTER, node), Beat(node, "a", 2, now - 100, leaving=True)), now - 100)
    assert store.get_node(node).heartbeat_at == pytest.approx(now - 100 + heartbeats.AGENT_RESTART_GRACE_SECONDS), \
        "an agent that said it leaves vouches for its node through its restart"

    reader = KubernetesStore(api, namespace)  # the CLI: no datagrams, the Lease as written
    assert reader.get_node(node).heartbeat_at == pytest.approx(now, abs=0.01)
    lease = kubernetes.client.CoordinationV1Api(api).read_namespaced_lease(names.LEASE_PREFIX + node, namespace)
    assert lease.spec.lease_duration_seconds == 40


def test_when_most_datagrams_stop_at_once_the_leases_vouch_only_after_two_renewals(
        api: kubernetes.client.ApiClient, namespace: str, board: HeartbeatBoard) -> None:
    """A cut between the agents and the operator: every node's datagrams stop together. At first the last datagram
    alone is each node's heartbeat, Leases or not, so the disruption guard sees the whole crowd silent and holds
    (a node that renewed its Lease must not leave the last to renew judged alone). After two renewal periods the
    Leases are the evidence: a node whose agent renewed is alive, one whose Lease is old is not."""
    store = KubernetesStore(api, namespace)
    store.heartbeats = board
    store.lease_renew_seconds, store.heartbeat_interval = 2.0, 1.0  # the fallback after 4 s, not 20
    a, b, c = make_node(api), make_node(api), make_node(api)
    now = time.time()
    for seq, node in enumerate((a, b, c), 1):
        assert board.accept(heartbeats.encode(heartbeats.node_key(MASTER, node), Beat(node, f"agent-{node}", seq, now - 5)), now - 5)
    store.renew_lease(a, at=now - 0.5)
    store.renew_lease(b, at=now - 0.5)
    store.renew_lease(c, at=now - 60)

    beats = {n.name: n.heartbeat_at for n in store.list_nodes() if n.name in (a, b, c)}
    assert beats == {a: pytest.approx(now - 5), b: pytest.approx(now - 5), c: pytest.approx(now - 5)}, \
        "datagrams stopped for most: the last datagram alone, though a and b renewed since"

    def vouched() -> dict[str, float | None]:
        return {n.name: n.heartbeat_at for n in store.list_nodes() if n.name in (a, b, c)}
    beats = wait_until(lambda: (v := vouched())[a] > now - 1 and v, 10, "the Leases to vouch after two renewals")
    assert beats[b] > now - 1 and beats[c] == pytest.approx(now - 5), "b renewed: alive; c's Lease is old: silent"

    later = time.time()
    for seq, node in enumerate((a, b, c), 10):
        assert board.accept(heartbeats.encode(heartbeats.node_key(MASTER, node), Beat(node, f"agent-{node}", seq, later)), later)
    assert {n.name: n.heartbeat_at for n in store.list_nodes() if n.name in (a, b, c)} == {
        a: pytest.approx(later), b: pytest.approx(later), c: pytest.approx(later)}, "datagrams back: they decide again"
