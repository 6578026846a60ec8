"""A Secret in unbroken's namespace made and read by the operator alone.

The operator makes it when it first leads (:func:`ensure`); two replicas may
race, a create is atomic, so the first one's data wins and the loser reads the
winner's. There is no install step (a random key cannot be written in a
manifest). The agents may not read it (deploy/base/rbac-agent.yaml grants them no
Secret; deploy/admission/agent-policy.yaml refuses them any Secret write): what
they need of it the operator gives each for its node, which they wait for
(:func:`wait`, kubernetes/backend/node_credentials.py). Used for the cluster's
CA (kubernetes/backend/cluster_tls.py) and the heartbeat master key
(kubernetes/backend/heartbeats.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection
from typing import TypeVar

import kubernetes

from unbroken.errors import NotFoundError, StoreUnavailable
from unbroken.kubernetes.backend import names
from unbroken.kubernetes.backend.api import STRICT, ApiConflict, RequestRefused, call

log = logging.getLogger("unbroken.kubernetes.backend.shared_secret")

D = TypeVar("D")
T = TypeVar("T")
FIRST_POLL_SECONDS = 1.0
LAST_POLL_SECONDS = 10.0
"""How often a reader looks for a Secret the operator has not made yet: every second at first (agents started
beside the operator see it within a second of its first pass), backing off to every 10 s (an install whose operator
does not start costs 0.1 GET per node per second, a Lease renewal's rate)."""


def read(core: kubernetes.client.CoreV1Api, namespace: str, name: str, keys: Collection[str], *,
         remedy: str) -> dict[str, str] | None:
    """The Secret's data (base64 values, as served); None if it does not exist. StoreUnavailable when
    it may not be read (RBAC) or lacks one of ``keys`` (``remedy`` says what to do then)."""
    try:
        secret = call(lambda: core.read_namespaced_secret(name, namespace))
    except NotFoundError:
        return None
    except RequestRefused as exc:  # 403: the Role lacks it (deploy/base/rbac-*.yaml)
        raise StoreUnavailable(f"reading Secret {namespace}/{name}: {exc}") from None
    data = secret.data or {}
    missing = [k for k in keys if k not in data]
    if missing:
        raise StoreUnavailable(f"Secret {namespace}/{name} lacks {', '.join(missing)}: {remedy}")
    return dict(data)


def ensure(core: kubernetes.client.CoreV1Api, namespace: str, name: str, keys: Collection[str],
           make: Callable[[], dict[str, str]], *, remedy: str) -> dict[str, str]:
    """The Secret's data, created from ``make()`` (base64 values) if there is none yet."""
    data = read(core, namespace, name, keys, remedy=remedy)
    if data is not None:
        return data
    made = make()
    body = {"metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": names.COMPONENT}}, "type": "Opaque", "data": made}
    try:
        call(lambda: core.create_namespaced_secret(namespace, body, field_validation=STRICT))
        return made
    except ApiConflict:
        pass
    except RequestRefused as exc:
        raise StoreUnavailable(f"creating Secret {namespace}/{name}: {exc}") from None
    theirs = read(core, namespace, name, keys, remedy=remedy)  # another agent's create won: use its data
    if theirs is None:
        raise StoreUnavailable(f"Secret {namespace}/{name} was created and is gone again")
    return theirs


def wait(read: Callable[[], D | None], stopping: threading.Event, what: str, use: Callable[[D], T], *,
         absent: str = "does not exist yet: the operator makes it when it leads") -> T | None:
    """``use(data)`` once ``read()`` finds what it waits for (not None); None if ``stopping`` is set first. A refused or failed read
    (StoreUnavailable: RBAC, a key missing, the API server away) is logged and tried again: each is a state an
    administrator can fix while the agent runs."""
    delay = FIRST_POLL_SECONDS
    said = ""
    while True:
        try:
            data = read()
            problem = f"{what} {absent}"
        except StoreUnavailable as exc:
            data, problem = None, str(exc)
        if data is not None:
            if said:
                log.info("%s is there now", what)
            return use(data)
        if problem != said:
            log.warning("waiting: %s", problem)
            said = problem
        if stopping.wait(delay):
            return None
        delay = min(LAST_POLL_SECONDS, delay * 2)
