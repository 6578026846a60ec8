"""Leader election through a coordination.k8s.io Lease: one operator acts, the others wait.

The holder renews every pass; a Lease not renewed for ``duration`` seconds may be
taken by anyone. Takeover and renewal are replaces carrying the Lease's
``resourceVersion``, so two candidates racing for an expired Lease cannot both
win: the API server accepts one write and answers the other 409.
"""

from __future__ import annotations

import json
import logging
import time

import kubernetes
from unbroken.errors import NotFoundError, StoreUnavailable
from unbroken.kubernetes.backend.api import STRICT, ApiConflict, RequestRefused, call, format_time, parse_time

log = logging.getLogger("unbroken.kubernetes.backend.leader")


class LeaderLease:
    def __init__(self, api: kubernetes.client.ApiClient, namespace: str, name: str, identity: str, *, duration: float = 15.0,
                 annotations: dict[str, str] | None = None) -> None:
        self.leases = kubernetes.client.CoordinationV1Api(api)
        self.annotations = dict(annotations or {})
        """Written with every renewal while leading (the heartbeat address: kubernetes/backend/heartbeats.py)."""
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.duration = duration
        self.leading = False
        self.holder: str | None = None
        """Who held the Lease when it was last read (None before the first read)."""

    def hold(self, now: float | None = None) -> bool:
        """Acquire or renew; True while this process leads. API trouble counts as not leading."""
        now = time.time() if now is None else now
        try:
            leading = self._try(now)
        except (ApiConflict, StoreUnavailable, RequestRefused) as exc:
            # RequestRefused: an API server just restarted answers 403 until its RBAC caches fill
            log.warning("leader lease %s/%s: %s", self.namespace, self.name, exc)
            leading = False
        if leading != self.leading:
            log.info("leading" if leading else "not leading", extra={"identity": self.identity, "lease": self.name})
        self.leading = leading
        return leading

    def _try(self, now: float) -> bool:
        spec = {"holderIdentity": self.identity, "leaseDurationSeconds": int(self.duration), "renewTime": format_time(now, micro=True)}
        try:
            response = call(lambda: self.leases.read_namespaced_lease(self.name, self.namespace, _preload_content=False))
        except NotFoundError:
            body = {"metadata": {"name": self.name, "namespace": self.namespace, "annotations": self.annotations},
                    "spec": {**spec, "acquireTime": format_time(now, micro=True), "leaseTransitions": 0}}
            try:
                call(lambda: self.leases.create_namespaced_lease(self.namespace, body, field_validation=STRICT))
            except ApiConflict:
                return False  # someone else created it first
            self.holder = self.identity
            return True
        lease = json.loads(response.data)
        current = lease.get("spec") or {}
        holder = self.holder = current.get("holderIdentity")
        renewed = parse_time(current.get("renewTime")) or 0.0
        expired = now - renewed > float(current.get("leaseDurationSeconds") or self.duration)
        if holder != self.identity and not expired:
            return False
        if holder != self.identity:
            spec["acquireTime"] = format_time(now, micro=True)
            spec["leaseTransitions"] = int(current.get("leaseTransitions") or 0) + 1
            log.warning("taking over the leader lease", extra={"previous": holder, "silent_s": round(now - renewed, 1)})
        metadata = lease["metadata"]
        metadata["annotations"] = {**(metadata.get("annotations") or {}), **self.annotations}
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata, "spec": {**current, **spec}}
        try:
            call(lambda: self.leases.replace_namespaced_lease(self.name, self.namespace, body, field_validation=STRICT))
        except ApiConflict:
            return False  # another candidate wrote it first
        self.holder = self.identity
        return True

    def release(self) -> None:
        """Give the lease up at shutdown, so a successor need not wait for it to expire."""
        if not self.leading:
            return
        try:
            self._try(0.0)  # renewed in 1970: expired for everyone
        except (ApiConflict, StoreUnavailable, RequestRefused):
            pass  # the Lease expires on its own
        self.leading = False
