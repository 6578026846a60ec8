"""When silence is a lost node, and when it is the observer that cannot see: the disruption guard.

A node is suspect when its heartbeat is older than ``NodeLostAfterSeconds``.
One silent node among many talking ones is a lost node. Most of the nodes
silent at once is almost never most of the machines dying together: it is the
agents paused or restarted together (a rolling update of the DaemonSet, a
stalled host), the path from the agents to the controller cut, or the
controller itself stalled. Declaring them all lost would restart every job and
send healthy machines to repair, turning a short blindness into an outage.

So, as Kubernetes' node lifecycle controller stops evicting when more than 55 %
of a zone's nodes go NotReady together, the controller holds while more than
half of the active nodes (and at least two: ``crowd.most_silent_at_once``)
are silent: no node is declared lost, no node is rebooted or replaced; an
Event and a metric say why, and decisions resume when the heartbeats return.
A node that is still silent then is lost as usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from unbroken.backends.crowd import most_silent_at_once
from unbroken.state.records import Node

CROWD_THRESHOLD_SHARE = 0.5
"""A node counts towards the crowd once silent for this share of ``NodeLostAfterSeconds`` (see :func:`hold`)."""


@dataclass(frozen=True)
class Hold:
    silent: tuple[str, ...]
    active: int

    @property
    def reason(self) -> str:
        shown = ", ".join(self.silent[:5]) + (f" and {len(self.silent) - 5} more" if len(self.silent) > 5 else "")
        return (f"{len(self.silent)} of {self.active} active nodes are silent at once ({shown}): more likely the agents "
                f"or the path to them than the machines; no node is declared lost, rebooted or replaced until "
                f"heartbeats return")


def silent(now: float, node: Node, lost_after: float) -> bool:
    """An active node whose heartbeat (or, with none yet, its last state change) is older than ``lost_after``."""
    if not node.state.is_active:
        return False
    last = node.heartbeat_at or node.state_changed_at
    return now - last > lost_after


def next_loss_at(now: float, nodes: Sequence[Node], lost_after: float) -> float | None:
    """When the first active node heard so far would turn silent if nothing more is heard from it (None: no such
    node). A loop that looks again then declares a dead node lost ``lost_after`` after its last heartbeat, not up
    to a pass later."""
    return min(((n.heartbeat_at or n.state_changed_at) + lost_after for n in nodes
                if n.state.is_active and not silent(now, n, lost_after)), default=None)


def hold(now: float, nodes: Sequence[Node], lost_after: float) -> Hold | None:
    """The hold in force, None when silence may be believed.

    The crowd is counted at half the loss threshold: agents that stop together stopped at different
    points of their beat, so one crosses ``lost_after`` up to a beat before the others; counted at the
    full threshold, that first one would be judged alone (and lost) a pass before the hold."""
    active = [n for n in nodes if n.state.is_active]
    quiet = tuple(sorted(n.name for n in active if silent(now, n, lost_after * CROWD_THRESHOLD_SHARE)))
    if most_silent_at_once(len(quiet), len(active)):
        return Hold(quiet, len(active))
    return None
