"""The ranks' agent socket inside the pod: each datagram is passed on to the node agent's, and read on the way.

The launcher learns from it when its ranks have stepped (``ctx.progress``), which
is when it may start warming a spare: importing torch takes a core for seconds,
and must not compete with a round's startup (the local agent waits for the same,
supervision/spare_pool.py). The ranks' ``UNBROKEN_AGENT_SOCKET`` points here; the node
agent's socket (from the pod's environment) gets every datagram as before, and
``checkpoint-endpoint`` beside this socket is a link to the one the agent writes
beside its own, so the tiered checkpoint finds its shard server as before.
A send here never blocks a rank either: a full queue drops, as at the agent.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from unbroken.rank.channel import AgentReceiver, MessageKind
from unbroken.rank.env import ENDPOINT_FILE
from unbroken.kubernetes.pod_launcher.hang import HangWatch


class ProgressRelay:
    def __init__(self, path: Path, agent_socket: Path | None) -> None:
        self._agent = str(agent_socket) if agent_socket is not None else None
        self._out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._out.setblocking(False)
        self._receiver = AgentReceiver(path, on_datagram=self._forward)
        self.path = path
        if agent_socket is not None:
            endpoint = path.parent / ENDPOINT_FILE
            endpoint.unlink(missing_ok=True)
            endpoint.symlink_to(agent_socket.parent / ENDPOINT_FILE)
        self._stepped: dict[int, float] = {}
        """Local rank -> when it sent its last step (its own time stamp)."""
        self.clock = HangWatch()
        """The ranks' step times, for the hang timeout (hang.py); fed by ``stepped_since``."""

    def stepped_since(self, since: float) -> int:
        """How many local ranks reported a step after ``since`` (a ``time.time()``: the ranks stamp their messages)."""
        for message in self._receiver.drain():
            if message.kind is MessageKind.PROGRESS:
                self._stepped[message.local_rank] = max(message.ts, self._stepped.get(message.local_rank, 0.0))
                self.clock.observe(message.local_rank, message.ts)
            elif message.kind is MessageKind.FINISHED:
                self.clock.finished(message.local_rank, message.ts)
        return sum(1 for at in self._stepped.values() if at > since)

    def close(self) -> None:
        self._receiver.close()
        self._out.close()

    def _forward(self, data: bytes) -> None:
        if self._agent is None:
            return
        try:
            self._out.sendto(data, self._agent)
        except OSError:
            pass  # a full agent queue, or no agent (yet): dropped, as a rank's own send would be


def relay_path(run_dir: Path) -> Path:
    """Where the relay binds; a socket path must fit in 107 bytes, so a long run folder falls back to /tmp."""
    path = run_dir / "agent.sock"
    if len(os.fsencode(path)) <= 100:
        return path
    short = Path(f"/tmp/unbroken-run-{os.getpid()}")
    short.mkdir(exist_ok=True)
    return short / "agent.sock"
