"""When silence is a crowd's: the rule the disruption guard (controller/liveness.py) and the Kubernetes
store's reading of the heartbeat datagrams (kubernetes/backend/store.py) share."""

from __future__ import annotations

MASS_SILENCE_SHARE = 0.5
MASS_SILENCE_MIN = 2
"""Two silent nodes of three are a crowd; one of two is not (a two-node cluster loses a node as usual)."""


def most_silent_at_once(silent: int, total: int) -> bool:
    """More than ``MASS_SILENCE_SHARE`` of ``total`` nodes, and at least ``MASS_SILENCE_MIN``, silent together:
    more likely the agents or the path to them than the machines."""
    return silent >= MASS_SILENCE_MIN and silent > MASS_SILENCE_SHARE * total
