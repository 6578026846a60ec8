"""Picking a TCP port that is free now, for a rendezvous store or a process group.

The port is bound, read and released, so another process could take it before ours binds it;
every caller binds it within moments and fails loudly (the store or torchrun says the address is
in use) if it lost that race. A node's address that lives in another network namespace is not
bindable here, and ports are per namespace: one free here is as good as any there.
"""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port(address: str = LOOPBACK) -> int:
    """A port free on ``address`` now (or free here, where ``address`` is not bindable here)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            sock.bind(("", 0))
        return int(sock.getsockname()[1])
