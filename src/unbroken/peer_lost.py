"""How an error message reads when a rank failed because a peer went away, not of its own accord.

Two readers share these patterns: the controller, which must not blame a rank that only saw its
peer die (the cause is the peer), and a rank under in-process restarts, which stays alive for
the next attempt only when its error came from the process group.
"""

from __future__ import annotations

import re

PEER_LOST = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|Connection refused|NCCL (error|communicator was aborted)|"
    r"ProcessGroup\w* .*(aborted|timed? ?out)|DistNetworkError|DistBackendError",
    re.IGNORECASE,
)
"""The message names a lost connection, an aborted communicator or a timed-out process group."""

_COLLECTIVE_TRANSPORT = re.compile(r"gloo|nccl|ProcessGroup|timed? ?out", re.IGNORECASE)
"""Broader: any error raised from a collective's transport. gloo reports a vanished or hung peer as
a plain RuntimeError naming its own source file ("[.../gloo/transport/tcp/pair.cc] ...")."""


def says_peer_lost(text: str) -> bool:
    """``text`` (a worker's last message, an event's reason) names a peer-lost symptom."""
    return PEER_LOST.search(text) is not None


def from_the_process_group(text: str) -> bool:
    """``text`` (a rank's exception) came from the process group: a peer died, hung past the
    collective timeout, or the group was aborted."""
    return says_peer_lost(text) or _COLLECTIVE_TRANSPORT.search(text) is not None
