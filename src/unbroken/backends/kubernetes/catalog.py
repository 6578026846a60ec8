"""``CheckpointCatalog`` on a Kubernetes API: one ConfigMap per checkpointed step of a job.

| catalog | Kubernetes |
|---|---|
| a step's row in one tier | key ``step.<tier>`` of ConfigMap ``unbroken-ckpt-<job digest>-<step>`` (JSON) |
| one copy of one rank's shard | key ``copy.<tier>.<rank>.<node>`` of the same ConfigMap (``-`` for the persistent tier's empty node) |
| a node's shard server | annotation ``unbroken.dev/shard-server`` on the Node |

The ConfigMaps live in the operator's namespace, labelled ``unbroken.dev/checkpoint-job``
(the job's digest) and annotated with the job's name. One per step keeps each object
small (a step of a 1,000-rank job with two copies per rank is ~400 KiB, under the
API's 1 MiB) and keeps agents writing different steps off each other's objects.

Writes: a copy is one merge patch of one key (the API server applies it atomically,
so agents adding copies to one step never lose each other's). Step rows are the
agents' race: insert-if-absent and compare-and-swap read the ConfigMap and send its
``resourceVersion`` with the patch, so a write that raced another is refused (409)
and decided again on the fresh object. A ConfigMap left with no key is deleted under
the same precondition, so a copy added meanwhile is never lost with it.

Reads list the label's ConfigMaps (a label selector, and filtered here too); one list
serves the reads of a pass (``LIST_REUSE_SECONDS``). Agents read every pass;
``CHECKPOINT_PASS_SECONDS`` in agent/kubernetes.py sets how often.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import kubernetes

from unbroken.errors import NotFoundError, StoreUnavailable
from unbroken.backends.kubernetes import names
from unbroken.backends.kubernetes.api import STRICT, ApiConflict, call
from unbroken.state.records import CheckpointStep, CheckpointTier, ShardCopy, StepStatus

LIST_REUSE_SECONDS = 0.2
"""A job's list is reused this long (unless this catalog wrote since): the agent's pass (0.5 s) asks for a
job's steps, then its copies, then the restore catalog does again; other agents' writes show within this."""
CONFLICT_RETRIES = 20
"""Optimistic writes retried against the fresh object; agents racing for one step settle in a few."""
_STEP_KEY = "step."
_COPY_KEY = "copy."
_NO_NODE = "-"


def job_digest(job: str) -> str:
    """A job name as a label value and a name part: ``<namespace>/<name>`` may be 253 characters."""
    return hashlib.sha256(job.encode()).hexdigest()[:16]


def configmap_name(job: str, step: int) -> str:
    return f"unbroken-ckpt-{job_digest(job)}-{step}"


def _step_key(tier: CheckpointTier) -> str:
    return f"{_STEP_KEY}{tier.value}"


def _copy_key(tier: CheckpointTier, rank: int, node: str) -> str:
    return f"{_COPY_KEY}{tier.value}.{rank}.{node or _NO_NODE}"


def _encode(record: CheckpointStep | ShardCopy) -> str:
    return json.dumps(asdict(record), sort_keys=True)


def _decode_step(raw: str) -> CheckpointStep:
    data = json.loads(raw)
    return CheckpointStep(**{**data, "tier": CheckpointTier(data["tier"]), "status": StepStatus(data["status"])})


def _decode_copy(raw: str) -> ShardCopy:
    data = json.loads(raw)
    return ShardCopy(**{**data, "tier": CheckpointTier(data["tier"])})


class KubernetesCatalog:
    def __init__(self, api: kubernetes.client.ApiClient, namespace: str) -> None:
        self.core = kubernetes.client.CoreV1Api(api)
        self.namespace = namespace
        self._listed: dict[str, tuple[float, list[dict[str, Any]]]] = {}
        """Per job: when it was last listed, and what came back (see ``_list``)."""

    # -- ConfigMap plumbing (every call through kube.api.call: 404 NotFoundError, 409 ApiConflict) --------

    def _json(self, request: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        response = call(lambda: request(*args, _preload_content=False, **kwargs))
        return json.loads(response.data)

    def _read(self, job: str, step: int) -> dict[str, Any] | None:
        """The step's ConfigMap as JSON, None if there is none."""
        try:
            obj: dict[str, Any] = self._json(self.core.read_namespaced_config_map, configmap_name(job, step), self.namespace)
        except NotFoundError:
            return None
        return obj

    def _list(self, job: str) -> list[dict[str, Any]]:
        """The job's step ConfigMaps. Within ``LIST_REUSE_SECONDS`` of the last list and with no write by this
        catalog since, the same answer: a pass reads a job's steps and its copies, one list serves both."""
        now = time.monotonic()
        cached = self._listed.get(job)
        if cached is not None and now - cached[0] < LIST_REUSE_SECONDS:
            return cached[1]
        digest = job_digest(job)
        items = self._json(self.core.list_namespaced_config_map, self.namespace,
                           label_selector=f"{names.CHECKPOINT_JOB}={digest}").get("items") or []
        mine = [i for i in items if (i["metadata"].get("labels") or {}).get(names.CHECKPOINT_JOB) == digest
                and (i["metadata"].get("annotations") or {}).get(names.CHECKPOINT_JOB) == job]
        self._listed[job] = (now, mine)
        return mine

    def _write(self, job: str, step: int, data: dict[str, str | None], *, resource_version: str | None = None) -> bool:
        """Merge ``data`` into the step's ConfigMap (None deletes a key), creating it if it is missing.
        With ``resource_version``: only over that version of it; False if it changed (or went away)."""
        self._listed.pop(job, None)
        patch: dict[str, Any] = {"data": data}
        if resource_version is not None:
            patch["metadata"] = {"resourceVersion": resource_version}
        try:
            call(lambda: self.core.patch_namespaced_config_map(configmap_name(job, step), self.namespace, patch, field_validation=STRICT))
            return True
        except ApiConflict:
            return False
        except NotFoundError:
            if resource_version is not None:  # the version we read is gone
                return False
        if all(v is None for v in data.values()):
            return True  # deleting keys of a ConfigMap that is gone: nothing to do
        if self._create_only(job, step, data):
            return True
        return self._write(job, step, data)  # another agent created it first: merge into theirs

    def _delete_if_empty(self, job: str, step: int) -> None:
        obj = self._read(job, step)
        if obj is None or obj.get("data"):
            return
        self._listed.pop(job, None)
        options = kubernetes.client.V1DeleteOptions(preconditions=kubernetes.client.V1Preconditions(
            resource_version=obj["metadata"]["resourceVersion"]))
        try:
            call(lambda: self.core.delete_namespaced_config_map(configmap_name(job, step), self.namespace, body=options))
        except (NotFoundError, ApiConflict):
            pass  # gone already, or a key was added since: keep it

    def _compare_and_write(self, job: str, step: int, decide: Callable[[dict[str, str]], dict[str, str | None] | None]) -> bool:
        """``decide(data)`` → the keys to write, or None to give up; retried on a changed ConfigMap."""
        for _ in range(CONFLICT_RETRIES):
            obj = self._read(job, step)
            change = decide((obj or {}).get("data") or {})
            if change is None:
                return False
            if obj is None:
                # Nothing to race over yet: create it; a creator that lost the race tries again.
                if self._create_only(job, step, change):
                    return True
                continue
            if self._write(job, step, change, resource_version=obj["metadata"]["resourceVersion"]):
                if any(v is None for v in change.values()):
                    self._delete_if_empty(job, step)
                return True
        raise StoreUnavailable(f"checkpoint catalog: step {step} of job {job} kept changing under {CONFLICT_RETRIES} writes")

    def _create_only(self, job: str, step: int, data: dict[str, str | None]) -> bool:
        self._listed.pop(job, None)
        body = {"metadata": {"name": configmap_name(job, step),
                             "labels": {names.CHECKPOINT_JOB: job_digest(job), "app.kubernetes.io/part-of": names.COMPONENT},
                             "annotations": {names.CHECKPOINT_JOB: job}},
                "data": {k: v for k, v in data.items() if v is not None}}
        try:
            call(lambda: self.core.create_namespaced_config_map(self.namespace, body, field_validation=STRICT))
            return True
        except ApiConflict:
            return False

    # -- shard copies ---------------------------------------------------------------------

    def put_shard_copy(self, copy: ShardCopy) -> None:
        self._write(copy.job, copy.step, {_copy_key(copy.tier, copy.rank, copy.node): _encode(copy)})

    def list_shard_copies(self, job: str, *, step: int | None = None, tier: CheckpointTier | None = None) -> list[ShardCopy]:
        objects = [o for o in [self._read(job, step)] if o is not None] if step is not None else self._list(job)
        copies = [_decode_copy(raw) for obj in objects for key, raw in (obj.get("data") or {}).items()
                  if key.startswith(_COPY_KEY)]
        copies = [c for c in copies if c.job == job and (tier is None or c.tier is tier)]
        return sorted(copies, key=lambda c: (-c.step, c.rank, c.tier.value, c.node))

    def delete_shard_copies(self, job: str, step: int, *, tier: CheckpointTier | None = None, node: str | None = None,
                            rank: int | None = None) -> None:
        obj = self._read(job, step)
        if obj is None:
            return
        gone: dict[str, str | None] = {}
        for key, raw in (obj.get("data") or {}).items():
            if not key.startswith(_COPY_KEY):
                continue
            copy = _decode_copy(raw)
            if (tier is None or copy.tier is tier) and (node is None or copy.node == node) and (rank is None or copy.rank == rank):
                gone[key] = None
        if gone:
            # No precondition: a delete racing a put of the same copy is ordered either way, as in SQL.
            self._write(job, step, gone)
            self._delete_if_empty(job, step)

    # -- step rows --------------------------------------------------------------------------

    def put_checkpoint_step(self, record: CheckpointStep, *, only_if_absent: bool = False) -> bool:
        key = _step_key(record.tier)
        if not only_if_absent:
            self._write(record.job, record.step, {key: _encode(record)})
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
        steps = [_decode_step(raw) for obj in self._list(job) for key, raw in (obj.get("data") or {}).items()
                 if key.startswith(_STEP_KEY)]
        steps = [s for s in steps if s.job == job and (tier is None or s.tier is tier)]
        return sorted(steps, key=lambda s: (-s.step, s.tier.value))

    def delete_checkpoint_step(self, job: str, step: int, tier: CheckpointTier) -> None:
        if self._read(job, step) is None:
            return
        self._write(job, step, {_step_key(tier): None})
        self._delete_if_empty(job, step)

    # -- shard servers ------------------------------------------------------------------------

    def set_shard_server(self, node: str, address: str) -> None:
        call(lambda: self.core.patch_node(node, {"metadata": {"annotations": {names.SHARD_SERVER: address}}}, field_validation=STRICT))

    def shard_servers(self) -> dict[str, str]:
        servers: dict[str, str] = {}
        for item in self._json(self.core.list_node).get("items") or []:
            address = (item["metadata"].get("annotations") or {}).get(names.SHARD_SERVER)
            if address:
                servers[item["metadata"]["name"]] = address
        return servers
