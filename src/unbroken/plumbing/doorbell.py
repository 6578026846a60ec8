"""A doorbell: a named pipe in the cluster directory that wakes the controller at once.

The controller reconciles every ``LOOP_SECONDS``; a node agent that has just
written something the controller must act on now (a rank died) rings the bell
and the controller starts its next pass without waiting out the interval. A
named pipe, not a socket: its path may be as long as the cluster directory's,
and agents in their own network namespaces reach it through the filesystem.
Ringing never blocks and never fails: with no controller listening, or the
pipe full of unanswered rings, the ring is dropped and the next pass sees the
change anyway.
"""

from __future__ import annotations

import os
import select
import stat
from pathlib import Path


class Doorbell:
    """The listening end, owned by the controller."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            if not stat.S_ISFIFO(os.stat(path).st_mode):
                path.unlink()  # something else by that name (a stale file): the bell is ours to make
        except FileNotFoundError:
            pass
        if not path.exists():
            os.mkfifo(path, 0o600)
        self._read = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        # Holding a writer open keeps the pipe from reading as end-of-file (readable forever) between rings.
        self._keep = os.open(path, os.O_WRONLY | os.O_NONBLOCK)

    def wait(self, timeout: float) -> bool:
        """Sleep until a ring or ``timeout``; True if it rang (every ring so far is taken)."""
        readable, _, _ = select.select([self._read], [], [], timeout)
        if not readable:
            return False
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass
        return True

    def close(self) -> None:
        os.close(self._read)
        os.close(self._keep)


def ring(path: Path) -> bool:
    """Wake the controller listening at ``path``; False if nobody listens (or the bell is full)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return False  # ENXIO: no controller has the pipe open; ENOENT: none ever made it
    try:
        os.write(fd, b"!")
        return True
    except OSError:
        return False  # EAGAIN: 64 KiB of rings unanswered, the controller is busy and will look anyway
    finally:
        os.close(fd)
