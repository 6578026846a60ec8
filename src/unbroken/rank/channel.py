"""The one-way channel from training ranks to their node's agent.

A unix datagram socket: a send never blocks a training step (a full queue or
a missing agent drops the message, it does not stall). The socket is a file,
``agent.sock`` in a directory the agent owns (mode 0700), and ranks find it
through ``UNBROKEN_AGENT_SOCKET``. A file, not an abstract name, because
abstract sockets belong to a network namespace: a rank in a pod (or in a
local node's own namespace) reaches a DaemonSet agent through a hostPath
mount of the directory, which an abstract name cannot cross.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

MAX_DATAGRAM = 8192
MAX_BUFFERED = 100_000
"""Messages held between two drains; beyond that the oldest heartbeats go first."""
RETRY_SECONDS = 1.0


SECTION_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
"""What ``ctx.section`` accepts as a name: a short word, safe as a metric label and an Event's text."""
SUSPECT_PREFIX = "suspect:"
"""A diverged message's metric ``suspect:<rank>``: that global rank's state differs from its replicas'."""
SECTION_PREFIX = "section:"
"""A progress metric ``section:<name>``: seconds this rank spent in that section since its last progress."""
WAIT_PREFIX = "wait:"
"""A progress metric ``wait:<name>``: the same, for a section that waits on peers (not scored)."""
HOST_PREFIX = "host:"
"""A progress metric ``host:<name>``: on a GPU, the host's seconds in a section, whose ``section:``/``wait:``
figure is then its CUDA-event time on the device (gpu_sections.py). Reported, not scored."""


class MessageKind(StrEnum):
    HELLO = "hello"
    """A rank started: maps global rank to local rank and pid."""
    PROGRESS = "progress"
    """``ctx.progress(step)``: the heartbeat hang detection and goodput read."""
    RESTORED = "restored"
    """The rank resumed from a checkpoint of this step (``detail``: from where; ``metrics["seconds"]``)."""
    SAVED = "saved"
    """The rank saved this step (``detail``: the tier; ``metrics``: ``stall_seconds``, ``bytes``)."""
    DIVERGED = "diverged"
    """The replicas' fingerprints differ at ``step`` (``ctx.watch_replicas``): ``metrics`` holds ``agreed_step`` (the
    last step they agreed on, -1 for none), ``majority`` (1: a strict majority agreed) and a ``suspect:<rank>`` key per
    suspect rank; ``detail`` the first differing tensor's path (or empty)."""
    FINISHED = "finished"
    """``ctx.run``'s training returned: the rank is on its way out, and its silence from now on is no hang
    (``unbroken run``'s launcher reads it; an exit can take seconds: the output, a last save, torch's teardown)."""


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
    detail: str = ""
    """A short word for the kind of message (a tier, a source), never free text."""

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
            or not isinstance(self.detail, str)
            or not all(type(v) is int for v in ints)
            or not all(type(v) in (int, float) for v in numbers)
            or not all(isinstance(k, str) for k in self.metrics)
        ):
            raise TypeError("rank message field of the wrong type")


SOCKET_NAME = "agent.sock"
MAX_PATH = 107
"""``sun_path`` holds 108 bytes including the terminating NUL."""


def agent_socket(directory: Path) -> Path:
    """The agent's socket in ``directory`` (the agent's own folder on the node)."""
    return directory / SOCKET_NAME


class RankSender:
    """Used inside training processes. Never raises, never blocks."""

    def __init__(self, address: Path | None) -> None:
        self._address = str(address) if address is not None else None
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

    def __init__(self, path: Path, on_datagram: Callable[[bytes], None] | None = None) -> None:
        """``on_datagram``: called (on the receiving thread) with each datagram as it came, before it is decoded."""
        if len(os.fsencode(path)) > MAX_PATH:
            raise ValueError(f"agent socket path {path} is longer than {MAX_PATH} bytes; use a shorter directory")
        # Only this user's processes (the agent's ranks) may send: the folder is 0700.
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
        path.unlink(missing_ok=True)  # left by an agent of this node that died: it is ours now
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
        self._sock.bind(str(path))
        self._sock.settimeout(0.2)
        self._received: deque[RankMessage] = deque(maxlen=MAX_BUFFERED)
        self._on_datagram = on_datagram
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
            if self._on_datagram is not None:
                self._on_datagram(data)
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
