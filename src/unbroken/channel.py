"""The one-way channel from training ranks to their node's agent.

Unix datagram sockets in Linux's abstract namespace: a send never blocks a
training step (a full queue or a missing agent drops the message, it does
not stall), there is no socket file to clean up or to exceed the 108-byte
path limit, and it is scoped to the network namespace, i.e. the node.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

MAX_DATAGRAM = 8192
MAX_BUFFERED = 100_000
"""Messages held between two drains; beyond that the oldest heartbeats go first."""
RETRY_SECONDS = 1.0


class MessageKind(StrEnum):
    HELLO = "hello"
    """A rank started: maps global rank to local rank and pid."""
    PROGRESS = "progress"
    """``ctx.progress(step)``: the heartbeat hang detection and goodput read."""
    RESTORED = "restored"
    """The rank resumed from a checkpoint of this step."""


@dataclass(frozen=True)
class RankMessage:
    kind: MessageKind
    job: str
    attempt: int
    rank: int
    local_rank: int
    pid: int
    ts: float
    step: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> "RankMessage":
        raw: dict[str, Any] = json.loads(data)
        raw["kind"] = MessageKind(raw["kind"])
        message = cls(**raw)
        message._check_types()
        return message

    def _check_types(self) -> None:
        """Reject well-formed JSON with the wrong field types: the agent compares and hashes them."""
        ints = [self.attempt, self.rank, self.local_rank, self.pid] + ([] if self.step is None else [self.step])
        numbers = [self.ts, *(self.metrics.values() if isinstance(self.metrics, dict) else [None])]
        if (
            not isinstance(self.job, str)
            or not all(type(v) is int for v in ints)
            or not all(type(v) in (int, float) for v in numbers)
            or not all(isinstance(k, str) for k in self.metrics)
        ):
            raise TypeError("rank message field of the wrong type")


def agent_address(cluster_dir: Path, node: str) -> bytes:
    """Abstract socket name of ``node``'s agent; unique per cluster directory."""
    digest = hashlib.sha1(str(cluster_dir.resolve()).encode()).hexdigest()[:16]
    return f"\0unbroken-{digest}-{node}".encode()


class RankSender:
    """Used inside training processes. Never raises, never blocks."""

    def __init__(self, address: bytes | None) -> None:
        self._address = address
        self._sock: socket.socket | None = None
        if address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)

    def send(self, message: RankMessage, *, must_arrive: bool = False) -> bool:
        """Fire and forget. ``must_arrive`` (hello, restored: once per process) retries
        for up to ``RETRY_SECONDS`` while the agent's queue is full."""
        if self._sock is None or self._address is None:
            return False
        data = message.encode()[:MAX_DATAGRAM]
        deadline = time.monotonic() + (RETRY_SECONDS if must_arrive else 0.0)
        while True:
            try:
                self._sock.sendto(data, self._address)
                return True
            except BlockingIOError:
                # Queue full. A lost heartbeat is harmless (the next step sends another);
                # blocking the training step is not.
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.005)
            except OSError:
                return False  # no agent listening (plain torchrun, or agent gone)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class AgentReceiver:
    """Bound by the node agent; a thread receives, ``drain()`` returns what arrived since.

    The kernel queues only ``net.unix.max_dgram_qlen`` datagrams (10 by default)
    per socket, so receiving in the agent's 0.1 s reconcile loop would drop
    messages from a few fast ranks. A dedicated thread blocked in ``recv``
    empties the queue as fast as ranks fill it.
    """

    def __init__(self, address: bytes) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
        self._sock.bind(address)
        self._sock.settimeout(0.2)
        self._received: deque[RankMessage] = deque(maxlen=MAX_BUFFERED)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._receive, name="rank-channel", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._closed.is_set():
            try:
                data = self._sock.recv(MAX_DATAGRAM)
            except TimeoutError:
                continue
            except OSError:
                return  # socket closed
            try:
                self._received.append(RankMessage.decode(data))
            except (ValueError, TypeError, KeyError):
                continue  # not ours or malformed; the channel is best-effort by design

    def drain(self) -> list[RankMessage]:
        messages = []
        while True:
            try:
                messages.append(self._received.popleft())
            except IndexError:
                return messages

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=1.0)
        self._sock.close()
