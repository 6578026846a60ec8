"""The ranks' agent socket inside the pod: each datagram is passed on to the node agent's, and read on the way.

The launcher learns from it when its ranks have stepped (``ctx.progress``), which
is when it may start warming a spare: importing torch takes a core for seconds,
and must not compete with a round's startup (the local agent waits for the same,
agent/spare_pool.py). The ranks' ``UNBROKEN_AGENT_SOCKET`` points here; the node
agent's socket (from the pod's environment) gets every datagram as before, and
``checkpoint-endpoint`` beside this socket is a link to the one the agent writes
beside its own, so the tiered checkpoint finds its shard server as before.
A send here never blocks a rank either: a full queue drops, as at the agent.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path

from unbroken.channel import MAX_DATAGRAM, MessageKind, RankMessage
from unbroken.launch_env import ENDPOINT_FILE

log = logging.getLogger("unbroken.pod_launcher.relay")


class ProgressRelay:
    def __init__(self, path: Path, agent_socket: Path | None) -> None:
        self.path = path
        self._agent = str(agent_socket) if agent_socket is not None else None
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024 * 1024)
        self._sock.bind(str(path))
        self._sock.settimeout(0.2)
        self._out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._out.setblocking(False)
        if agent_socket is not None:
            endpoint = path.parent / ENDPOINT_FILE
            endpoint.unlink(missing_ok=True)
            endpoint.symlink_to(agent_socket.parent / ENDPOINT_FILE)
        self._lock = threading.Lock()
        self._stepped: dict[int, float] = {}
        """Local rank -> when it last reported a step."""
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress-relay", daemon=True)
        self._thread.start()

    def stepped_since(self, since: float) -> int:
        """How many local ranks reported a step after ``since`` (a ``time.monotonic()``)."""
        with self._lock:
            return sum(1 for at in self._stepped.values() if at > since)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=1.0)
        self._sock.close()
        self._out.close()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                data = self._sock.recv(MAX_DATAGRAM)
            except TimeoutError:
                continue
            except OSError:
                return
            if self._agent is not None:
                try:
                    self._out.sendto(data, self._agent)
                except OSError:
                    pass  # a full agent queue, or no agent (yet): dropped, as a rank's own send would be
            try:
                message = RankMessage.decode(data)
            except (ValueError, TypeError, KeyError):
                continue
            if message.kind is MessageKind.PROGRESS:
                with self._lock:
                    self._stepped[message.local_rank] = time.monotonic()


def relay_path(run_dir: Path) -> Path:
    """Where the relay binds; a socket path must fit in 107 bytes, so a long run folder falls back to /tmp."""
    path = run_dir / "agent.sock"
    if len(os.fsencode(path)) <= 100:
        return path
    short = Path(f"/tmp/unbroken-run-{os.getpid()}")
    short.mkdir(exist_ok=True)
    return short / "agent.sock"
