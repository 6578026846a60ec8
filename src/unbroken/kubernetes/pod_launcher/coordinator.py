"""The job's round coordinator, served by the launcher of node rank 0 (the Master pod).

It decides which pods train in each round, and when they form their next process group:

    Forming --(elastic, or with spare pods) node ranks 0..size-1 said hello, or enough did and no pod came for
              LAST_CALL_SECONDS--> Running(0)
    Running(N) --a pod reports round N broken, or a training pod is gone--> Gathering(N): "hold" to every training pod
    Running(N) --a warm spare pod and the job below its size--> Gathering(N): a grow (no fault, not a restart)
    Gathering(N) --every training pod left is ready--> Running(N+1): "join" to each pod of the new round, with its group rank
    any --too few pods for the job (no spare pod, below an elastic job's min), a gather past its timeout, restarts used
          up, a training pod's launcher started again--> GivenUp: "give_up" to every pod

Which pods train. Round 0 is the pods of node ranks 0 .. size-1 (size: ``--nnodes``, an elastic job's max):
the hello of each is answered with round 0's "join" (its store at MASTER_PORT). A job with spare pods, or an
elastic one (``--nnodes MIN:MAX``), answers them together (Forming), as torchrun's elastic rendezvous does: at
once when those pods all said hello, else once no pod came for ``LAST_CALL_SECONDS`` and enough did (node rank
0 among them): then a spare pod takes the place of a pod not there (not scheduled: its node is missing), and an
elastic job whose replicas are fewer than its max starts smaller and grows when more come. Every
other hello (node ranks past the size, a lost pod recreated later, an elastic pod after round 0) is answered
"stand_by": a *spare pod*, scheduled, warm,
without ranks, which says "standby" once its warm spare is ready. A training pod that is lost gives
its place (its group rank) to a warm spare pod. With none, an elastic job goes on with the pods left, renumbered
in order, never fewer than its min; a fixed-size job gives up (the operator recreates the pods). A spare pod
that turns up later (a lost pod recreated by its controller, on a node that came back) grows a job below its
size at once: the ranks leave their group at their next step (``rejoin.request_leave``) and the new round takes
the model from their memory, so a grow costs a step, not a checkpoint interval.

Node rank 0's pod hosts this coordinator and round 0's store: losing it is a full restart.

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

from unbroken.kubernetes.pod_launcher.protocol import Kind, Message
from unbroken.plumbing.ports import free_port

log = logging.getLogger("unbroken.kubernetes.pod_launcher.coordinator")

SEND_TIMEOUT_SECONDS = 1.0
TICK_SECONDS = 0.05
"""How often the loop looks at the clock when no message comes: the gather timeout's resolution."""
LAST_CALL_SECONDS = 30.0
"""Round 0 of an elastic job, or of one with spare pods, waits this long for a pod missing from node ranks
0..size-1 (torchrun's elastic rendezvous waits as long, its ``last_call_timeout``): pods created together say hello
within seconds."""


class Phase(StrEnum):
    FORMING = "Forming"
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

    size: int
    """The most pods that train (``--nnodes``, an elastic job's max)."""
    fewest: int
    """The fewest pods the job trains on (an elastic job's min; else ``size``)."""
    max_restarts: int
    gather_timeout: float
    round: int = 0
    restarts: int = 0
    """Rounds begun after a fault: grows are not counted against ``--max-restarts``."""
    phase: Phase = Phase.RUNNING
    training: list[int] = field(default_factory=list)
    """The node ranks of this round's pods, by group rank."""
    standby: list[int] = field(default_factory=list)
    """Spare pods with a warm spare, in the order they said so: the next to take a place first."""
    gone: set[int] = field(default_factory=set)
    """Training pods of this round whose launcher went away without saying done: the pod (or its node) is gone."""
    ready: set[int] = field(default_factory=set)
    gather_started: float = 0.0
    cause: str = ""
    """What broke the current round (or why the coordinator gave up): a failed rank's pod's word when it came."""
    fault_known: bool = False
    seen: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    """Training pods whose ranks all exited 0."""
    spare_pods: int = 0
    """A fixed-size job's pods past its size (``--spare-pods``)."""
    arrived: dict[int, float] = field(default_factory=dict)
    """Forming (round 0 of an elastic job or of one with spare pods): the pods that said hello, with when."""

    @property
    def finished(self) -> bool:
        """Every training pod is done: the job is over, and its spare pods are told so."""
        return self.phase is Phase.RUNNING and bool(self.training) and set(self.training) <= self.done

    def __post_init__(self) -> None:
        if self.fewest < self.size or self.spare_pods:
            self.phase = Phase.FORMING  # round 0's pods are those that come (``formed``)
        elif not self.training:
            self.training = list(range(self.size))

    def formed(self, now: float, last_call: float) -> list[int] | None:
        """Forming: round 0's pods once they are known, by node rank (node rank 0 first: it hosts the store). Node
        ranks 0 .. size-1 at once when all came; else, once no pod came for ``last_call`` and at least ``fewest`` did
        (node rank 0 among them), those that came, the missing places filled from the pods past the size (spare pods,
        an elastic job's pods past its max)."""
        own = [n for n in range(self.size) if n in self.arrived]
        if len(own) == self.size:
            return own
        if 0 not in self.arrived or len(self.arrived) < self.fewest or now - max(self.arrived.values()) < last_call:
            return None
        extra = sorted(n for n in self.arrived if n >= self.size)
        return sorted(own + extra[: self.size - len(own)])

    def staying(self) -> set[int]:
        return {n for n in self.training if n not in self.gone}

    def plan(self) -> list[int] | None:
        """The next round's pods by group rank, or None if too few are left: a lost pod's place goes to the first
        warm spare pod; a job below its size takes spare pods up to it; an elastic one closes up its gaps."""
        spares = list(self.standby)
        places = [n if n not in self.gone else (spares.pop(0) if spares else None) for n in self.training]
        pods = [n for n in places if n is not None]
        pods += spares[: max(0, self.size - len(pods))]
        return pods if len(pods) >= self.fewest else None


class Coordinator:
    """Listens on ``port`` (all addresses); ``start()`` runs the loop in a thread, ``close()`` ends it."""

    def __init__(self, size: int, port: int, *, max_restarts: int, gather_timeout: float, fewest: int | None = None,
                 first_port: int = 0, host: str = "", last_call: float = LAST_CALL_SECONDS, spare_pods: int = 0) -> None:
        """``first_port``: round 0's store port (MASTER_PORT); ``last_call``: round 0's wait for a missing pod (an
        elastic job's, or one with ``spare_pods``)."""
        self.state = RoundState(size=size, fewest=size if fewest is None else fewest, max_restarts=max_restarts,
                                gather_timeout=gather_timeout, spare_pods=spare_pods)
        self.first_port = first_port
        self.last_call = last_call
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
            self._check_formed()

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
        state, node_rank = self.state, member.node_rank
        if node_rank is None or member.done:
            return
        if state.phase is Phase.FORMING:
            state.arrived.pop(node_rank, None)
            return
        if node_rank in state.standby:
            state.standby.remove(node_rank)
            log.warning("spare pod (node rank %d) went away", node_rank)
            return
        if node_rank not in state.staying():
            return
        state.gone.add(node_rank)
        log.warning("the launcher of node rank %d went away (its pod or node is gone)", node_rank)
        if state.phase is Phase.RUNNING:
            self._gather(f"the pod of node rank {node_rank} is gone", fault=True)
        elif state.phase is Phase.GATHERING:
            if state.plan() is None:
                self._give_up(f"{state.cause}; and the pod of node rank {node_rank} is gone; {self._too_few()}")
            else:
                self._check_ready()

    def _handle(self, member: _Member, message: Message) -> None:
        state = self.state
        if message.kind is Kind.HELLO:
            if message.node_rank is None or message.node_rank < 0 or member.node_rank is not None:
                log.warning("ignored a hello with node rank %s%s", message.node_rank,
                            "" if member.node_rank is None else f" from the launcher of node rank {member.node_rank}")
                return
            node_rank = member.node_rank = message.node_rank
            if node_rank in state.seen and node_rank in state.staying():
                # a launcher started again in its pod (the container restarted) while its place is still taken
                # by the ranks it had: those are gone with the old launcher, and the others' group with them
                self._give_up(f"the launcher of node rank {node_rank} started again")
            first = node_rank not in state.seen
            state.seen.add(node_rank)
            if state.phase is Phase.GIVEN_UP:
                self._send(member, Message(Kind.GIVE_UP, why=state.cause))
            elif state.phase is Phase.FORMING:
                state.arrived[node_rank] = time.monotonic()
                self._check_formed()
            elif first and state.round == 0 and state.phase is Phase.RUNNING and node_rank in state.training:
                self._send(member, self._round_0_join(node_rank))
            else:
                self._send(member, Message(Kind.STAND_BY))
            return
        if member.node_rank is None:
            log.warning("ignored a %s from a launcher that did not say hello", message.kind.value)
            return
        if message.kind is Kind.DONE:
            member.done = True
            state.done.add(member.node_rank)
            if state.finished:
                log.info("every pod's ranks are done: the spare pods %s end too", state.standby)
                for other in list(self._members.values()):
                    if other.node_rank is not None and other.node_rank not in state.training:
                        self._send(other, Message(Kind.DONE))
        elif message.kind is Kind.STANDBY and member.node_rank not in state.staying() and member.node_rank not in state.standby:
            state.standby.append(member.node_rank)
            log.info("spare pod (node rank %d) is warm and stands by", member.node_rank)
            if state.phase is Phase.GATHERING:
                self._check_ready()
            else:
                self._maybe_grow()
        elif message.kind is Kind.BROKEN and message.round == state.round and state.phase is Phase.RUNNING:
            self._gather(f"node rank {member.node_rank}: {message.why}", fault=message.fault)
        elif message.kind is Kind.BROKEN and message.round == state.round and state.phase is Phase.GATHERING \
                and message.fault and not state.fault_known:
            # the ranks of another pod saw the group fail before this pod saw its rank die: name the cause
            state.cause, state.fault_known = f"node rank {member.node_rank}: {message.why}", True
            log.warning("round %d: the cause: %s", state.round, state.cause, extra={"round": state.round})
        elif message.kind is Kind.READY and message.round == state.round and state.phase is Phase.GATHERING:
            state.ready.add(member.node_rank)
            self._check_ready()

    def _gather(self, cause: str, *, fault: bool, grow: bool = False) -> None:
        state = self.state
        if not grow and state.restarts >= state.max_restarts:
            self._give_up(f"{cause}; the {state.max_restarts} in-place restarts allowed (--max-restarts) are used")
            return
        if state.plan() is None:
            self._give_up(f"{cause}; {self._too_few()}")
            return
        if finished := sorted(state.done & set(state.training)):
            # their ranks are gone (exited 0): no round can have them again; waiting for them would end the same way,
            # only after the gather timeout
            self._give_up(f"{cause}; node ranks {finished} are done (every rank there exited 0) and cannot join a next round")
            return
        state.restarts += 0 if grow else 1
        state.phase, state.ready, state.gather_started, state.cause = Phase.GATHERING, set(), time.monotonic(), cause
        state.fault_known = fault
        log.warning("round %d %s (%s): every pod leaves it", state.round, "ends" if grow else "broken", cause,
                    extra={"round": state.round})
        for member in self._members.values():
            if member.node_rank in state.staying():
                self._send(member, Message(Kind.HOLD, round=state.round, why=cause))
        self._check_ready()

    def _maybe_grow(self) -> None:
        state = self.state
        if state.phase is Phase.RUNNING and state.standby and len(state.training) < state.size and not state.done:
            grown = min(state.size, len(state.training) + len(state.standby))
            self._gather(f"spare pod (node rank {state.standby[0]}) is warm: growing from {len(state.training)} to "
                         f"{grown} pods", fault=False, grow=True)

    def _too_few(self) -> str:
        state = self.state
        left = len(state.staying())
        if state.fewest == state.size:
            return f"{left} of the job's {state.size} pods are left and no spare pod is warm"
        pods = "1 pod is" if left == 1 else f"{left} pods are"
        return f"{pods} left, no spare pod is warm, and the job needs at least {state.fewest} (--nnodes {state.fewest}:{state.size})"

    def _check_ready(self) -> None:
        state = self.state
        if state.phase is Phase.GATHERING and state.staying() <= state.ready:
            self._next_round()

    def _next_round(self) -> None:
        state = self.state
        pods = state.plan()
        if pods is None:
            self._give_up(f"{state.cause}; {self._too_few()}")
            return
        state.round += 1
        state.phase = Phase.RUNNING
        state.standby = [n for n in state.standby if n not in pods]
        state.training, state.gone = pods, set()
        port = free_port("0.0.0.0")
        log.info("round %d: %d pods (node ranks %s) are ready after %.2f s; the store is on port %d", state.round,
                 len(pods), pods, time.monotonic() - state.gather_started, port, extra={"round": state.round})
        by_rank = {m.node_rank: m for m in self._members.values() if m.node_rank is not None}
        for group_rank, node_rank in enumerate(pods):
            if (member := by_rank.get(node_rank)) is not None:
                self._send(member, Message(Kind.JOIN, round=state.round, port=port, group_rank=group_rank, nnodes=len(pods)))

    def _round_0_join(self, node_rank: int) -> Message:
        training = self.state.training
        return Message(Kind.JOIN, round=0, port=self.first_port, group_rank=training.index(node_rank), nnodes=len(training))

    def _check_formed(self) -> None:
        state = self.state
        if state.phase is not Phase.FORMING or (pods := state.formed(time.monotonic(), self.last_call)) is None:
            return
        state.phase, state.training = Phase.RUNNING, pods
        size = f"{state.fewest}:{state.size}" if state.fewest < state.size else f"{state.size}, {state.spare_pods} spare"
        log.info("round 0: %d pods (node ranks %s) form the job (--nnodes %s)%s", len(pods), pods, size,
                 "" if pods == list(range(state.size)) else f"; no other pod came within {self.last_call:g} s",
                 extra={"round": 0})
        for member in self._members.values():
            if member.node_rank in pods:
                self._send(member, self._round_0_join(member.node_rank))
            elif member.node_rank in state.arrived:
                self._send(member, Message(Kind.STAND_BY))

    def _check_gather_timeout(self) -> None:
        state = self.state
        if state.phase is Phase.GATHERING and time.monotonic() - state.gather_started > state.gather_timeout:
            missing = sorted(state.staying() - state.ready)
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
