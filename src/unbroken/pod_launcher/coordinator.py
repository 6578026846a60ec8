"""The job's round coordinator, served by the launcher of node rank 0 (the Master pod).

It decides when the ranks of every pod form their next process group:

    Running(N) --a member reports round N broken--> Gathering(N): "hold" to every member
    Gathering(N) --every member ready--> Running(N+1): "join" with the new store's port
    any --a member's pod gone, a gather past its timeout, rounds used up--> GivenUp: "give_up" to every member

One thread, one ``selectors`` loop, one TCP connection per pod: at 1,000 nodes a
round is 2,000 lines of a few dozen bytes out and 2,000 in, and nothing touches
the API server. Anyone who can reach the port can send messages, as anyone who
can reach MASTER_PORT can write torch's store: the pod network is trusted here
as it is by torch.distributed.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum

from unbroken.pod_launcher.protocol import Kind, Message
from unbroken.ports import free_port

log = logging.getLogger("unbroken.pod_launcher.coordinator")

SEND_TIMEOUT_SECONDS = 1.0
TICK_SECONDS = 0.05
"""How often the loop looks at the clock when no message comes: the gather timeout's resolution."""


class Phase(StrEnum):
    RUNNING = "Running"
    GATHERING = "Gathering"
    GIVEN_UP = "GivenUp"


@dataclass
class _Member:
    sock: socket.socket
    buffer: bytes = b""
    node_rank: int | None = None
    done: bool = False


@dataclass
class RoundState:
    """What the coordinator knows of the job's rounds; changed only by the loop's thread."""

    nnodes: int
    max_restarts: int
    gather_timeout: float
    round: int = 0
    phase: Phase = Phase.RUNNING
    ready: set[int] = field(default_factory=set)
    gather_started: float = 0.0
    cause: str = ""
    """What broke the current round (or why the coordinator gave up): a failed rank's pod's word when it came."""
    fault_known: bool = False
    lost: set[int] = field(default_factory=set)
    """Node ranks whose launcher went away without saying done: their pod (or its node) is gone."""
    seen: set[int] = field(default_factory=set)


class Coordinator:
    """Listens on ``port`` (all addresses); ``start()`` runs the loop in a thread, ``close()`` ends it."""

    def __init__(self, nnodes: int, port: int, *, max_restarts: int, gather_timeout: float, host: str = "") -> None:
        self.state = RoundState(nnodes=nnodes, max_restarts=max_restarts, gather_timeout=gather_timeout)
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._members: dict[int, _Member] = {}  # by fd
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="round-coordinator", daemon=True)

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)
        for member in self._members.values():
            member.sock.close()
        self._listener.close()
        self._selector.close()

    def _run(self) -> None:
        while not self._stopping.is_set():
            for key, _ in self._selector.select(TICK_SECONDS):
                if key.fileobj is self._listener:
                    self._accept()
                else:
                    self._read(self._members[key.fd])
            self._check_gather_timeout()

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self._members[sock.fileno()] = _Member(sock)
        self._selector.register(sock, selectors.EVENT_READ)

    def _read(self, member: _Member) -> None:
        try:
            data = member.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(member)
            return
        member.buffer += data
        while b"\n" in member.buffer:
            line, member.buffer = member.buffer.split(b"\n", 1)
            try:
                self._handle(member, Message.parse(line))
            except ValueError as exc:
                log.warning("ignored a line from a launcher: %s", exc)

    def _drop(self, member: _Member) -> None:
        self._selector.unregister(member.sock)
        del self._members[member.sock.fileno()]
        member.sock.close()
        if member.node_rank is None or member.done:
            return
        self.state.lost.add(member.node_rank)
        log.warning("the launcher of node rank %d went away (its pod or node is gone)", member.node_rank)
        if self.state.phase is Phase.GATHERING:
            self._give_up(f"the pod of node rank {member.node_rank} is gone")

    def _handle(self, member: _Member, message: Message) -> None:
        state = self.state
        if message.kind is Kind.HELLO:
            if message.node_rank is None or not 0 <= message.node_rank < state.nnodes:
                log.warning("ignored a hello with node rank %s (the job has %d nodes)", message.node_rank, state.nnodes)
                return
            member.node_rank = message.node_rank
            if message.node_rank in state.seen:
                # a launcher started again in its pod (the container restarted): its ranks are new processes of
                # round 0, and the others' group is gone with the old ones: only a full restart brings them together
                self._give_up(f"the launcher of node rank {message.node_rank} started again")
            state.seen.add(message.node_rank)
            if state.phase is Phase.GIVEN_UP:
                self._send(member, Message(Kind.GIVE_UP, why=state.cause))
            return
        if message.kind is Kind.DONE:
            member.done = True
        elif message.kind is Kind.BROKEN and message.round == state.round and state.phase is Phase.RUNNING:
            self._gather(f"node rank {member.node_rank}: {message.why}", fault=message.fault)
        elif message.kind is Kind.BROKEN and message.round == state.round and state.phase is Phase.GATHERING \
                and message.fault and not state.fault_known:
            # the ranks of another pod saw the group fail before this pod saw its rank die: name the cause
            state.cause, state.fault_known = f"node rank {member.node_rank}: {message.why}", True
            log.warning("round %d: the cause: %s", state.round, state.cause, extra={"round": state.round})
        elif message.kind is Kind.READY and message.round == state.round and state.phase is Phase.GATHERING:
            assert member.node_rank is not None
            state.ready.add(member.node_rank)
            if len(state.ready) == state.nnodes:
                self._next_round()

    def _gather(self, cause: str, *, fault: bool) -> None:
        state = self.state
        if state.lost:
            self._give_up(f"{cause}; and the pod of node rank {min(state.lost)} is gone")
            return
        if state.round >= state.max_restarts:
            self._give_up(f"{cause}; the {state.max_restarts} in-place restarts allowed (--max-restarts) are used")
            return
        state.phase, state.ready, state.gather_started, state.cause = Phase.GATHERING, set(), time.monotonic(), cause
        state.fault_known = fault
        log.warning("round %d broken (%s): every pod leaves it", state.round, cause, extra={"round": state.round})
        self._broadcast(Message(Kind.HOLD, round=state.round, why=cause))

    def _next_round(self) -> None:
        state = self.state
        state.round += 1
        state.phase = Phase.RUNNING
        port = free_port("0.0.0.0")
        log.info("round %d: every pod is ready after %.2f s; the store is on port %d", state.round,
                 time.monotonic() - state.gather_started, port, extra={"round": state.round})
        self._broadcast(Message(Kind.JOIN, round=state.round, port=port))

    def _check_gather_timeout(self) -> None:
        state = self.state
        if state.phase is Phase.GATHERING and time.monotonic() - state.gather_started > state.gather_timeout:
            missing = sorted(set(range(state.nnodes)) - state.ready)
            self._give_up(f"node ranks {missing} were not ready for round {state.round + 1} within {state.gather_timeout:g} s")

    def _give_up(self, why: str) -> None:
        if self.state.phase is Phase.GIVEN_UP:
            return
        self.state.phase, self.state.cause = Phase.GIVEN_UP, why
        log.error("no in-place restart: %s; every launcher exits for a full restart", why)
        self._broadcast(Message(Kind.GIVE_UP, why=why))

    def _broadcast(self, message: Message) -> None:
        for member in list(self._members.values()):
            if member.node_rank is not None:
                self._send(member, message)

    def _send(self, member: _Member, message: Message) -> None:
        # A few dozen bytes into an idle socket's buffer: the send returns at once. One that fails (or a
        # member that stopped reading) means the member is gone, which its read side reports.
        try:
            member.sock.settimeout(SEND_TIMEOUT_SECONDS)
            member.sock.sendall(message.line())
        except OSError:
            pass
        finally:
            try:
                member.sock.setblocking(False)
            except OSError:
                pass
