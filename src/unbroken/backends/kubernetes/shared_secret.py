"""A Secret in unbroken's namespace made by whichever agent needs it first.

Agents race to create it: a create is atomic, so the first one's data wins and
the losers read the winner's. There is no install step and no operator
dependency (the operator is granted ``get`` on such Secrets by name, never
``create``). Used for the memory tier's TLS credentials (agent/cluster_tls.py)
and the heartbeat key (backends/kubernetes/heartbeats.py).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import kubernetes

from unbroken.errors import NotFoundError, StoreUnavailable
from unbroken.backends.kubernetes import names
from unbroken.backends.kubernetes.api import STRICT, ApiConflict, RequestRefused, call


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
