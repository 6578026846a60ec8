"""Failure messages that name a symptom, not a cause: a peer went away, or a rank's end was unread.

Two readers share these: the controller, which must not blame a rank that only saw its peer die
(the cause is the peer) and names the cause in a JobRestartCause event once it is known; and a rank
under in-process restarts, which stays alive for the next attempt only when its error came from the
process group. The agent writes the unread-exit words, the controller reads them.
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


UNREAD_EXIT = "ended first; torchrun's log says how"
"""A rank that torchrun (or a warm spare's forkserver) reaped before its agent read its status: it
failed first (torchrun then stopped the others), but how is known only once torchrun logs it."""


TEARDOWN_EXIT = "exited with signal 15 (SIGTERM)"
"""torchrun stops the other ranks with SIGTERM once one failed. A rank seen ending so may be that
teardown, not the cause: the rank that failed first can end before its agent watched it (a rank
killed in its first moments) and torchrun's root cause then says which it was."""


def says_exit_unread(text: str) -> bool:
    """``text`` names a rank whose end does not name the cause yet: reaped unread (:data:`UNREAD_EXIT`),
    or stopped by torchrun's teardown (:data:`TEARDOWN_EXIT`)."""
    return UNREAD_EXIT in text or TEARDOWN_EXIT in text


def says_peer_lost(text: str) -> bool:
    """``text`` (a worker's last message, an event's reason) names a peer-lost symptom."""
    return PEER_LOST.search(text) is not None


def from_the_process_group(text: str) -> bool:
    """``text`` (a rank's exception) came from the process group: a peer died, hung past the
    collective timeout, or the group was aborted."""
    return says_peer_lost(text) or _COLLECTIVE_TRANSPORT.search(text) is not None
