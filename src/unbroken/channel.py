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
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

MAX_DATAGRAM = 8192


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
        return cls(**raw)


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

    def send(self, message: RankMessage) -> bool:
        if self._sock is None:
            return False
        try:
            self._sock.sendto(message.encode()[:MAX_DATAGRAM], self._address)
            return True
        except OSError:
            # Agent gone or its queue full: losing a heartbeat is harmless,
            # blocking or crashing the training step is not.
            return False

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class AgentReceiver:
    """Bound by the node agent; ``drain()`` returns whatever arrived since the last call."""

    def __init__(self, address: bytes) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
        self._sock.bind(address)
        self._sock.setblocking(False)

    def drain(self, limit: int = 100_000) -> list[RankMessage]:
        messages = []
        for _ in range(limit):
            try:
                data = self._sock.recv(MAX_DATAGRAM)
            except BlockingIOError:
                break
            try:
                messages.append(RankMessage.decode(data))
            except (ValueError, TypeError, KeyError):
                continue  # not ours or truncated; the channel is best-effort by design
        return messages

    def close(self) -> None:
        self._sock.close()
