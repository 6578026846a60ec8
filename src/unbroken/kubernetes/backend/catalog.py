"""``CheckpointCatalog`` on a Kubernetes API: ConfigMaps per checkpointed step and per node of a job.

| catalog | Kubernetes |
|---|---|
| a step's row in one tier | key ``step.<tier>`` of ConfigMap ``unbroken-ckpt-<job digest>-<step>`` (JSON) |
| the copies of a job's shards on one node | ConfigMap ``unbroken-ckpt-<job digest>-n-<node digest>``, a key ``<tier>.<step>.<rank>`` per copy (the persistent tier's copies, which have no node, under the node name ``-``) |
| a node's shard server | annotation ``unbroken.dev/shard-server`` on the Node |

The ConfigMaps live in the operator's namespace, labelled ``unbroken.dev/checkpoint-job``
(the job's digest) and annotated with the job's name.

**What a save costs.** A node's agent records its copies (its own shards and the replicas it
holds), and forgets those it deleted, in its own ConfigMap: one merge patch per pass at most.
The agent holds new records for ``COPY_WRITE_DELAY_SECONDS``, and while a peer is pushing it
replicas for up to ``REPLICA_WRITE_WAIT_SECONDS`` more (peers push a step as soon as its shards are
recorded, not after its commit), so that a save's own copies, the replicas it brings, and the copies
the save before retired (``FORGET_WRITE_DELAY_SECONDS``) go out as one write: one write per node per
save, whatever the ranks per node. A replica that takes longer than the wait comes in a second write.
The price: a step is committed in memory up to that much later (the commit waits for every node's
copies). The job's step row is two writes per save (the commit creates the step's ConfigMap, the
retirement deletes it), made by one agent each; measured in docs/benchmarks.md beside a ConfigMap per
step with a key per copy, which took 27 writes per node per save at 8 ranks per node and could not
hold a 1,024-rank step at all (over the API's 1 MiB). The agents race for step rows through
insert-if-absent and compare-and-swap, which read the ConfigMap and send its ``resourceVersion`` with
the patch, so a write that raced another is refused (409) and decided again on the fresh object. A
ConfigMap left with no key is deleted under the same precondition, so a key added meanwhile is never
lost with it.

**What reading costs.** A catalog that :meth:`~KubernetesCatalog.follow` s (the agents') keeps
the catalog's ConfigMaps, and the Nodes' shard-server annotations, in watch caches
(kubernetes/backend/watch_cache.py): a pass reads memory, and each write reaches every agent
once, as a watch event. Without (the CLI) a read lists the job's ConfigMaps (a label selector),
one list serving the reads of ``LIST_REUSE_SECONDS``. Compare-and-swap always reads the
ConfigMap itself. Every agent receiving every node's write is what limits this catalog past a
few hundred nodes (docs/benchmarks-history.md, "checkpoint catalog"), and why the design wants the
catalog off the API server at that scale.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import kubernetes

from unbroken.errors import NotFoundError, StoreUnavailable
from unbroken.kubernetes.backend import names
from unbroken.kubernetes.backend.api import STRICT, ApiConflict, call
from unbroken.kubernetes.backend.watch_cache import WatchCache, own_client
from unbroken.state.catalog import CopyKey
from unbroken.state.records import CheckpointStep, CheckpointTier, ShardCopy, StepStatus

LIST_REUSE_SECONDS = 0.2
"""A job's list is reused this long (unless this catalog wrote since): the agent's pass (0.5 s) asks for a
job's steps, then its copies, then the restore catalog does again; other agents' writes show within this."""
CONFLICT_RETRIES = 20
"""Optimistic writes retried against the fresh object; agents racing for one step settle in a few."""
COPY_WRITE_DELAY_SECONDS = 1.0
"""How long an agent may hold its copy changes to send them as one write (see the module's docstring): a
memory step is committed up to this much later than the last copy landed."""
REPLICA_WRITE_WAIT_SECONDS = 5.0
"""How much longer an agent holds its copy records while a peer pushes it replicas: the replicas of a save that
replicates within about this much come in the same write as the node's own copies."""
FORGET_WRITE_DELAY_SECONDS = 120.0
"""How long a node's forgotten copies alone may wait: with saves more often than this, the copies a save
retires go out with the next save's write."""
_STEP_KEY = "step."
_NO_NODE = "-"
_KIND_LABEL = f"{names.PREFIX}/checkpoint-object"
"""``step`` or ``copies``: which of the two kinds of catalog ConfigMap."""


def job_digest(job: str) -> str:
    """A job name as a label value and a name part: ``<namespace>/<name>`` may be 253 characters."""
    return hashlib.sha256(job.encode()).hexdigest()[:16]


def configmap_name(job: str, step: int) -> str:
    """The ConfigMap of the step's rows."""
    return f"unbroken-ckpt-{job_digest(job)}-{step}"


def copies_configmap_name(job: str, node: str) -> str:
    """The ConfigMap of the job's shard copies on ``node`` ("" : the persistent tier's)."""
    return f"unbroken-ckpt-{job_digest(job)}-n-{hashlib.sha256((node or _NO_NODE).encode()).hexdigest()[:12]}"


def _step_key(tier: CheckpointTier) -> str:
    return f"{_STEP_KEY}{tier.value}"


def _copy_key(tier: CheckpointTier, step: int, rank: int) -> str:
    return f"{tier.value}.{step}.{rank}"


def _encode(record: CheckpointStep | ShardCopy) -> str:
    return json.dumps(asdict(record), sort_keys=True)


def _decode_step(raw: str) -> CheckpointStep:
    data = json.loads(raw)
    return CheckpointStep(**{**data, "tier": CheckpointTier(data["tier"]), "status": StepStatus(data["status"])})


def _decode_copy(raw: str) -> ShardCopy:
    data = json.loads(raw)
    return ShardCopy(**{**data, "tier": CheckpointTier(data["tier"])})


def _kind(obj: dict[str, Any]) -> str:
    return (obj["metadata"].get("labels") or {}).get(_KIND_LABEL, "step")


class KubernetesCatalog:
    copy_write_delay = COPY_WRITE_DELAY_SECONDS
    forget_write_delay = FORGET_WRITE_DELAY_SECONDS
    replica_write_wait = REPLICA_WRITE_WAIT_SECONDS

    def __init__(self, api: kubernetes.client.ApiClient, namespace: str) -> None:
        self.core = kubernetes.client.CoreV1Api(api)
        self.namespace = namespace
        self._listed: dict[str, tuple[float, list[dict[str, Any]]]] = {}
        """Per job: when it was last listed, and what came back (see ``_list``)."""
        self._configmaps: WatchCache | None = None
        self._nodes: WatchCache | None = None

    def follow(self, nodes: WatchCache | None = None) -> WatchCache:
        """Read from a watch cache of the catalog's ConfigMaps from now on (and the shard servers from ``nodes``,
        a cache of the Nodes the caller keeps anyway)."""
        core = kubernetes.client.CoreV1Api(own_client(self.core.api_client))
        self._configmaps = WatchCache("checkpoint-catalog", core.list_namespaced_config_map, self.namespace,
                                      label_selector=names.CHECKPOINT_JOB)
        self._configmaps.start()
        self._nodes = nodes
        return self._configmaps

    def stop_following(self) -> None:
        if self._configmaps is not None:
            self._configmaps.stop()

    def _observe(self, obj: dict[str, Any] | None) -> None:
        if self._configmaps is not None and obj is not None and (obj.get("metadata") or {}).get("resourceVersion"):
            self._configmaps.observe(obj)

    # -- ConfigMap plumbing (every call through kube.api.call: 404 NotFoundError, 409 ApiConflict) --------

    def _json(self, request: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        response = call(lambda: request(*args, _preload_content=False, **kwargs))
        return json.loads(response.data)

    def _read(self, name: str) -> dict[str, Any] | None:
        """The ConfigMap ``name`` as JSON, None if there is none."""
        try:
            obj: dict[str, Any] = self._json(self.core.read_namespaced_config_map, name, self.namespace)
        except NotFoundError:
            return None
        return obj

    def _list(self, job: str) -> list[dict[str, Any]]:
        """The job's ConfigMaps, both kinds. Within ``LIST_REUSE_SECONDS`` of the last list and with no write by
        this catalog since, the same answer: a pass reads a job's steps and its copies, one list serves both."""
        digest = job_digest(job)
        if self._configmaps is not None and self._configmaps.synced:
            items = self._configmaps.objects()
        else:
            now = time.monotonic()
            cached = self._listed.get(job)
            if cached is not None and now - cached[0] < LIST_REUSE_SECONDS:
                return cached[1]
            items = self._json(self.core.list_namespaced_config_map, self.namespace,
                               label_selector=f"{names.CHECKPOINT_JOB}={digest}").get("items") or []
        mine = [i for i in items if (i["metadata"].get("labels") or {}).get(names.CHECKPOINT_JOB) == digest
                and (i["metadata"].get("annotations") or {}).get(names.CHECKPOINT_JOB) == job]
        if self._configmaps is None or not self._configmaps.synced:
            self._listed[job] = (time.monotonic(), mine)
        return mine

    def _write(self, job: str, name: str, kind: str, data: dict[str, str | None], *,
               resource_version: str | None = None) -> dict[str, Any] | None:
        """Merge ``data`` into the ConfigMap ``name`` (None deletes a key), creating it if it is missing; the
        ConfigMap as written. With ``resource_version``: only over that version of it; None if it changed (or
        went away)."""
        self._listed.pop(job, None)
        patch: dict[str, Any] = {"data": data}
        if resource_version is not None:
            patch["metadata"] = {"resourceVersion": resource_version}
        try:
            written: dict[str, Any] = self._json(self.core.patch_namespaced_config_map, name, self.namespace, patch,
                                                 field_validation=STRICT)
            self._observe(written)
            return written
        except ApiConflict:
            return None
        except NotFoundError:
            if resource_version is not None:  # the version we read is gone
                return None
        if all(v is None for v in data.values()):
            return {"metadata": {}, "data": {}}  # deleting keys of a ConfigMap that is gone: nothing to do
        created = self._create_only(job, name, kind, data)
        if created is not None:
            return created
        return self._write(job, name, kind, data)  # another agent created it first: merge into theirs

    def _delete_if_empty(self, job: str, name: str, obj: dict[str, Any] | None = None) -> None:
        """Delete the ConfigMap if it holds nothing of the catalog's any more (a step's ConfigMap: no step key;
        keys of the layout before, one per copy, are left-overs), only over the version read."""
        obj = obj if obj is not None and obj.get("metadata", {}).get("resourceVersion") else self._read(name)
        if obj is None:
            return
        keys = (obj.get("data") or {}).keys()
        if any(key.startswith(_STEP_KEY) for key in keys) if _kind(obj) == "step" else keys:
            return
        self._delete_at_version(job, name, obj)

    def _delete_at_version(self, job: str, name: str, obj: dict[str, Any]) -> bool:
        """Delete the ConfigMap only if it is still ``obj``'s version: False if it changed or went away."""
        self._listed.pop(job, None)
        options = kubernetes.client.V1DeleteOptions(preconditions=kubernetes.client.V1Preconditions(
            resource_version=obj["metadata"]["resourceVersion"]))
        try:
            call(lambda: self.core.delete_namespaced_config_map(name, self.namespace, body=options))
        except (NotFoundError, ApiConflict):
            return False  # gone already, or a key was added since: keep it
        if self._configmaps is not None:
            self._configmaps.discard(self.namespace, name)
        return True

    def _compare_and_write(self, job: str, step: int, decide: Callable[[dict[str, str]], dict[str, str | None] | None]) -> bool:
        """``decide(data)`` → the keys to write, or None to give up; retried on a changed ConfigMap."""
        name = configmap_name(job, step)
        for _ in range(CONFLICT_RETRIES):
            obj = self._read(name)
            change = decide((obj or {}).get("data") or {})
            if change is None:
                return False
            if obj is None:
                # Nothing to race over yet: create it; a creator that lost the race tries again.
                if self._create_only(job, name, "step", change) is not None:
                    return True
                continue
            written = self._write(job, name, "step", change, resource_version=obj["metadata"]["resourceVersion"])
            if written is not None:
                if any(v is None for v in change.values()):
                    self._delete_if_empty(job, name, written)
                return True
        raise StoreUnavailable(f"checkpoint catalog: step {step} of job {job} kept changing under {CONFLICT_RETRIES} writes")

    def _create_only(self, job: str, name: str, kind: str, data: dict[str, str | None]) -> dict[str, Any] | None:
        self._listed.pop(job, None)
        body = {"metadata": {"name": name,
                             "labels": {names.CHECKPOINT_JOB: job_digest(job), _KIND_LABEL: kind,
                                        "app.kubernetes.io/part-of": names.COMPONENT},
                             "annotations": {names.CHECKPOINT_JOB: job}},
                "data": {k: v for k, v in data.items() if v is not None}}
        try:
            created: dict[str, Any] = self._json(self.core.create_namespaced_config_map, self.namespace, body,
                                                 field_validation=STRICT)
            self._observe(created)
            return created
        except ApiConflict:
            return None

    # -- shard copies ---------------------------------------------------------------------

    def put_shard_copy(self, copy: ShardCopy) -> None:
        self.update_shard_copies(copy.job, put=[copy])

    def update_shard_copies(self, job: str, *, put: Sequence[ShardCopy] = (), forget: Sequence[CopyKey] = ()) -> None:
        """One merge patch per node's ConfigMap touched: an agent's changes of a pass are one write."""
        by_node: dict[str, dict[str, str | None]] = {}
        for key in forget:
            by_node.setdefault(key.node, {})[_copy_key(key.tier, key.step, key.rank)] = None
        for copy in put:
            by_node.setdefault(copy.node, {})[_copy_key(copy.tier, copy.step, copy.rank)] = _encode(copy)
        for node, data in by_node.items():
            name = copies_configmap_name(job, node)
            written = self._write(job, name, "copies", data)
            if written is not None and not written.get("data") and any(v is None for v in data.values()):
                self._delete_if_empty(job, name, written)

    def list_shard_copies(self, job: str, *, step: int | None = None, tier: CheckpointTier | None = None) -> list[ShardCopy]:
        copies = [_decode_copy(raw) for obj in self._list(job) if _kind(obj) == "copies"
                  for raw in (obj.get("data") or {}).values()]
        copies = [c for c in copies if c.job == job and (step is None or c.step == step) and (tier is None or c.tier is tier)]
        return sorted(copies, key=lambda c: (-c.step, c.rank, c.tier.value, c.node))

    def delete_shard_copies(self, job: str, step: int, *, tier: CheckpointTier | None = None, node: str | None = None,
                            rank: int | None = None) -> None:
        self._listed.pop(job, None)  # decided on what is there now
        gone = [CopyKey(c.step, c.tier, c.node, c.rank) for c in self.list_shard_copies(job, step=step, tier=tier)
                if (node is None or c.node == node) and (rank is None or c.rank == rank)]
        if gone:
            # No precondition: a delete racing a put of the same copy is ordered either way, as in SQL.
            self.update_shard_copies(job, forget=gone)

    # -- step rows --------------------------------------------------------------------------

    def put_checkpoint_step(self, record: CheckpointStep, *, only_if_absent: bool = False) -> bool:
        key = _step_key(record.tier)
        if not only_if_absent:
            self._write(record.job, configmap_name(record.job, record.step), "step", {key: _encode(record)})
            return True
        return self._compare_and_write(record.job, record.step,
                                       lambda data: None if key in data else {key: _encode(record)})

    def replace_checkpoint_step(self, current: CheckpointStep, new: CheckpointStep | None) -> bool:
        key = _step_key(current.tier)

        def decide(data: dict[str, str]) -> dict[str, str | None] | None:
            stored = data.get(key)
            if stored is None or _decode_step(stored) != current:
                return None
            if new is None or new.step != current.step:
                return {key: None}
            return {key: _encode(new)}

        if not self._compare_and_write(current.job, current.step, decide):
            return False
        if new is not None and new.step != current.step:  # never done by the service; kept correct anyway
            self.put_checkpoint_step(new)
        return True

    def list_checkpoint_steps(self, job: str, *, tier: CheckpointTier | None = None) -> list[CheckpointStep]:
        steps = [_decode_step(raw) for obj in self._list(job) if _kind(obj) == "step"
                 for key, raw in (obj.get("data") or {}).items() if key.startswith(_STEP_KEY)]
        steps = [s for s in steps if s.job == job and (tier is None or s.tier is tier)]
        return sorted(steps, key=lambda s: (-s.step, s.tier.value))

    def delete_checkpoint_step(self, job: str, step: int, tier: CheckpointTier) -> None:
        name = configmap_name(job, step)
        obj = self._read(name)
        if obj is None:
            return
        rows = {key for key in (obj.get("data") or {}) if key.startswith(_STEP_KEY)}
        if _step_key(tier) not in rows:
            if not rows:
                self._delete_at_version(job, name, obj)  # e.g. only keys of the layout before are left
            return  # every agent retires old steps: the first one's write is the only one needed
        if rows == {_step_key(tier)} and self._delete_at_version(job, name, obj):
            return  # the step's last row goes with its ConfigMap: one write, not a patch and then a delete
        written = self._write(job, name, "step", {_step_key(tier): None})
        self._delete_if_empty(job, name, written)

    # -- shard servers ------------------------------------------------------------------------

    def set_shard_server(self, node: str, address: str) -> None:
        call(lambda: self.core.patch_node(node, {"metadata": {"annotations": {names.SHARD_SERVER: address}}}, field_validation=STRICT))

    def shard_servers(self) -> dict[str, str]:
        servers: dict[str, str] = {}
        nodes = self._nodes.objects() if self._nodes is not None and self._nodes.synced else \
            self._json(self.core.list_node).get("items") or []
        for item in nodes:
            address = (item["metadata"].get("annotations") or {}).get(names.SHARD_SERVER)
            if address:
                servers[item["metadata"]["name"]] = address
        return servers
