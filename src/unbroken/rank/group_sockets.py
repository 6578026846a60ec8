"""The TCP connections a gloo process group opened, so that a rank leaving it can close them.

A rank that leaves a broken process group for an in-process restart must make every peer still
blocked on it see it go. ``abort`` does not do that under gloo in torch 2.13: the connections stay
open (whatever still refers to the group, such as the failed attempt's DDP, keeps them), and a
local peer blocked in a receive from this rank waits out its whole collective timeout. Measured on
this machine, 4 gloo ranks under DDP, two killed: a survivor left only at the 5 s timeout in 3
runs of 8 with ``abort`` (also in 2 of 8 after dropping every reference to DDP and the group), and
within 0.02 s in 14 of 14 once the leaving rank shut its connections down (docs/benchmarks-history.md).

``shutdown(SHUT_RDWR)`` on a duplicate of each connection's descriptor sends the peer its end of
stream now, whoever still holds the socket. Listening sockets are left alone: gloo's listener
thread terminates the process when its socket fails under it. A socket is known by its descriptor
*and* inode, so a descriptor the process reused later for something else (a data loader's
connection) is never touched.
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass


def _sockets() -> set[tuple[int, int]]:
    """(descriptor, inode) of this process's sockets now."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            info = os.stat(f"/proc/self/fd/{name}")
        except OSError:  # closed since the listing (or the listing's own descriptor)
            continue
        if stat.S_ISSOCK(info.st_mode):
            found.add((int(name), info.st_ino))
    return found


@dataclass(frozen=True)
class GroupSockets:
    """The sockets that appeared while a process group was formed: its peers' connections and the store's."""

    opened: frozenset[tuple[int, int]]

    @classmethod
    def opened_by(cls, form_group: Callable[[], None]) -> GroupSockets:
        """Run ``form_group`` (``init_process_group``: gloo connects its full mesh there) and note what it opened."""
        before = _sockets()
        form_group()
        return cls(frozenset(_sockets() - before))

    def shut_down(self) -> int:
        """End every connection of the group that is still this process's; return how many were shut."""
        current = _sockets()
        shut = 0
        for fd, inode in sorted(self.opened):
            if (fd, inode) not in current:
                continue
            try:
                with socket.socket(fileno=os.dup(fd)) as sock:
                    if sock.family not in (socket.AF_INET, socket.AF_INET6):
                        continue
                    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                        continue
                    sock.shutdown(socket.SHUT_RDWR)
                    shut += 1
            except OSError:  # closed meanwhile, or not connected: nothing to end
                continue
        return shut
