"""A launcher's connection to its job's coordinator: connect (and keep trying), say hello, hand over what comes."""

from __future__ import annotations

import logging
import queue
import socket
import threading

from unbroken.kubernetes.pod_launcher.protocol import Kind, Message

log = logging.getLogger("unbroken.kubernetes.pod_launcher.link")

RETRY_SECONDS = 0.2
"""Between two tries to reach the coordinator while node rank 0's pod starts (Service name not resolving yet,
nothing listening yet)."""


class CoordinatorLink:
    """Messages from the coordinator land in ``inbox``; ``lost`` is set once a connection made has ended."""

    def __init__(self, host: str, port: int, node_rank: int) -> None:
        self.host, self.port, self.node_rank = host, port, node_rank
        self.inbox: queue.Queue[Message] = queue.Queue()
        self.lost = threading.Event()
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._pending: list[Message] = []
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="coordinator-link", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def send(self, message: Message) -> None:
        """Now if connected, else once connected (in order); lost if the connection is gone."""
        with self._lock:
            if self._sock is None:
                self._pending.append(message)
                return
            try:
                self._sock.sendall(message.line())
            except OSError:
                self.lost.set()

    def close(self) -> None:
        self._closing.set()
        with self._lock:
            if self._sock is not None:
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                self._sock.close()

    def _run(self) -> None:
        sock = self._connect()
        if sock is None:
            return
        buffer = b""
        while True:
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                if not self._closing.is_set():
                    log.info("the coordinator at %s:%d closed (node rank 0's pod ended, or is gone)", self.host, self.port)
                self.lost.set()
                return
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                try:
                    self.inbox.put(Message.parse(line))
                except ValueError as exc:
                    log.warning("ignored a line from the coordinator: %s", exc)

    def _connect(self) -> socket.socket | None:
        while not self._closing.is_set():
            try:
                sock = socket.create_connection((self.host, self.port), timeout=5)
            except OSError:
                self._closing.wait(RETRY_SECONDS)
                continue
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sock = sock
                try:
                    for message in [Message(Kind.HELLO, node_rank=self.node_rank), *self._pending]:
                        sock.sendall(message.line())
                except OSError:
                    self.lost.set()
                self._pending.clear()
            return sock
        return None
