"""When a node was last alive: the heartbeat datagrams the operator hears, the agents' Leases and
the kubelet's ``Ready``, judged together (``_heartbeat``), and the ranks' progress the agents report
in both."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any


from unbroken.backends.crowd import most_silent_at_once
from unbroken.errors import NotFoundError
from unbroken.kubernetes.backend import heartbeats, names
from unbroken.kubernetes.backend.api import STRICT, call, format_time, parse_time
from unbroken.kubernetes.backend.heartbeats import progress_from_json, progress_to_json
from unbroken.state.records import WorkerProgress

log = logging.getLogger(__name__)

from unbroken.kubernetes.backend.store.core import AGENT_LEASE_SELECTOR, MANAGED_BY, StoreCore

DATAGRAMS_SILENT_AFTER_SECONDS = 2.0
"""A node unheard this long counts towards "most datagrams stopped at once" (agents beat every second)."""
LEASE_FALLBACK_RENEWALS = 2
"""How many Lease renewal periods of stopped datagrams before the Leases are the evidence for every node:
long enough that every live agent renewed in between, longer than an agent restart or a short stall."""


class LivenessStore(StoreCore):
    """Heartbeats and Leases: when each node was last alive, and what its agent last reported."""

    def _judge_datagrams(self, nodes: Sequence[str]) -> None:
        """Whether the datagrams get through (``_datagrams_down_since``): not while most of the nodes heard from
        (crowd.py, the disruption guard's rule) have been unheard for ``DATAGRAMS_SILENT_AFTER_SECONDS`` at once."""
        if self.heartbeats is None:
            return
        now = time.time()
        heard = [beat for node in nodes if (beat := self.heartbeats.heard(node)) is not None and not beat.leaving]
        unheard = sum(1 for beat in heard if now - beat.at > DATAGRAMS_SILENT_AFTER_SECONDS)
        if most_silent_at_once(unheard, len(heard)):
            if self._datagrams_down_since is None:
                self._datagrams_down_since = now
                log.warning("most nodes' heartbeat datagrams stopped at once", extra={"unheard": unheard, "heard": len(heard)})
        elif self._datagrams_down_since is not None:
            log.info("heartbeat datagrams are back", extra={"down_s": round(now - self._datagrams_down_since, 1)})
            self._datagrams_down_since = None

    def _lease_fallback(self) -> bool:
        """Datagrams have not been getting through to most nodes for ``LEASE_FALLBACK_RENEWALS`` renewals: the
        Leases are the evidence now (each agent has renewed since, if it lives)."""
        return (self._datagrams_down_since is not None
                and time.time() - self._datagrams_down_since >= LEASE_FALLBACK_RENEWALS * self.lease_renew_seconds)

    def _heartbeat(self, node: str, lease: float | None, *, ready: bool) -> float | None:
        """When the node was last known alive, from the datagrams the operator heard, the agent's Lease
        (``lease``: its renewTime) and the kubelet's ``Ready`` condition:

        - the datagrams, while they arrive, whatever ``Ready`` says: the node lifecycle controller writes
          NotReady for every node whose kubelet it could not see (e.g. after an API-server outage longer
          than its grace period) while the machines run on, and a dead machine's beats stop too;
        - while most nodes' datagrams have stopped at once (``_judge_datagrams``), the last datagram alone,
          Leases or not: the disruption guard sees the crowd silent and holds (a Lease renewed meanwhile
          would make the nodes that renewed first look alive and leave the last to renew judged alone);
          after ``LEASE_FALLBACK_RENEWALS`` renewals of that, the Lease vouches for every node as below,
          datagrams being what does not get through;
        - otherwise not ``Ready``: lost (0.0);
        - an agent that said it is leaving (SIGTERM: a rolling update) vouches for its node for
          ``AGENT_RESTART_GRACE_SECONDS``, until its successor's beats replace that;
        - a Lease renewed after the last datagram (a new leader not yet heard from, datagrams that do
          not get through) vouches until its next renewal is due: such a node is lost
          ``LeaseRenewSeconds`` later than one that is heard;
        - no Lease, no agent yet: the kubelet vouches (now); a reader that hears no datagrams (the CLI):
          the Lease as written."""
        heard = self.heartbeats.heard(node) if self.heartbeats is not None else None
        if heard is not None and not heard.leaving and not self._lease_fallback() and (
                lease is None or lease <= heard.at + self.heartbeat_interval or self._datagrams_down_since is not None):
            return heard.at
        if not ready:
            return 0.0
        if heard is not None and heard.leaving:
            return min(time.time(), heard.at + heartbeats.AGENT_RESTART_GRACE_SECONDS)
        if lease is None:
            return time.time()
        if self.heartbeats is None:
            return lease
        backstop = min(time.time(), lease + self.lease_renew_seconds)
        return max(backstop, heard.at) if heard is not None and not heard.leaving else backstop

    def _lease(self, node: str) -> float | None:
        """When ``node``'s agent last renewed its Lease (None: no agent has run there)."""
        try:
            lease = self._json(self.coordination.read_namespaced_lease, names.LEASE_PREFIX + node, self.namespace)
        except NotFoundError:
            return None
        return parse_time((lease.get("spec") or {}).get("renewTime"))

    def lease_annotations(self, name: str) -> dict[str, str]:
        """The annotations of the Lease ``name`` in unbroken's namespace (NotFoundError if there is none)."""
        lease = self._json(self.coordination.read_namespaced_lease, name, self.namespace)
        return dict(lease["metadata"].get("annotations") or {})

    def _agent_leases(self) -> dict[str, dict[str, Any]]:
        """The node agents' Leases, by node (other Leases in the namespace, the leader's, are not theirs)."""
        cache = self.caches.leases if self.caches is not None else None
        items: list[dict[str, Any]]
        if self.caches is not None and cache is None:
            items = []  # this reader does not follow them (start_watches)
        elif cache is not None and cache.synced:
            items = cache.objects()
        else:
            items = self._json(self.coordination.list_namespaced_lease, self.namespace,
                               label_selector=AGENT_LEASE_SELECTOR)["items"]
        return {lease["metadata"]["name"].removeprefix(names.LEASE_PREFIX): lease for lease in items
                if lease["metadata"]["name"].startswith(names.LEASE_PREFIX)}

    def _leases(self) -> dict[str, float]:
        renewed = {node: parse_time((lease.get("spec") or {}).get("renewTime")) for node, lease in self._agent_leases().items()}
        return {node: at for node, at in renewed.items() if at is not None}

    def lease_progress(self) -> dict[tuple[str, int, str], WorkerProgress]:
        """What the node agents last reported of the ranks on their nodes, by (job, attempt, node):
        each agent writes its jobs' latest attempts into its Lease every renewal and sends them with
        every heartbeat datagram; a node's datagram, where one was heard, is the newer."""
        found = self._lease_progress()
        heard = self.heartbeats.everything() if self.heartbeats is not None else {}
        for node, beat in heard.items():
            for key in [k for k in found if k[2] == node]:
                del found[key]
            for report in beat.progress:
                found[(report.job, report.attempt, node)] = report
        return found

    def _lease_progress(self) -> dict[tuple[str, int, str], WorkerProgress]:
        found: dict[tuple[str, int, str], WorkerProgress] = {}
        for node, lease in self._agent_leases().items():
            text = (lease["metadata"].get("annotations") or {}).get(names.LEASE_PROGRESS)
            if not text:
                continue
            try:
                reports = [progress_from_json(entry) for entry in json.loads(text)]
            except (ValueError, TypeError, KeyError) as exc:
                log.warning("Lease %s%s: unreadable %s annotation: %s", names.LEASE_PREFIX, node, names.LEASE_PROGRESS, exc)
                continue
            for report in reports:
                found[(report.job, report.attempt, node)] = report
        return found

    def renew_lease(self, node: str, *, at: float, progress: Sequence[WorkerProgress] = ()) -> None:
        """One write: the Lease's renewTime, and the ranks' progress in its annotation."""
        stamp = format_time(at, micro=True)
        body = {
            "metadata": {"name": names.LEASE_PREFIX + node, "namespace": self.namespace,
                         "labels": {MANAGED_BY: names.COMPONENT},
                         "annotations": {names.LEASE_PROGRESS: json.dumps([progress_to_json(p) for p in progress])}},
            "spec": {"holderIdentity": node, "leaseDurationSeconds": int(4 * self.lease_renew_seconds), "renewTime": stamp},
        }
        try:
            call(lambda: self.coordination.patch_namespaced_lease(names.LEASE_PREFIX + node, self.namespace, body, field_validation=STRICT))
        except NotFoundError:
            call(lambda: self.coordination.create_namespaced_lease(self.namespace, body, field_validation=STRICT))
