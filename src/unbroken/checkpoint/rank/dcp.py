"""``torch.distributed.checkpoint`` on the tiers: ``dcp.save``, ``dcp.async_save`` and ``dcp.load``
write to and read from shared memory, peers and the persistent tier through a
:class:`~unbroken.checkpoint.rank.tiered.TieredCheckpointer`::

    dcp.save(state, storage_writer=TieredStorageWriter(checkpointer, step))
    reader = TieredStorageReader(checkpointer)          # newest committed DCP step
    dcp.load(state, storage_reader=reader)              # reader.step, reader.sources

    stager = TieredStager()                             # buffers allocated once, reused
    future = dcp.async_save(state, storage_writer=TieredStorageWriter(checkpointer, step, stager=stager),
                            async_stager=stager)

Decisions:

- **One DCP save is one tiered step.** Each rank's shard (what ``checkpointer.save`` stages)
  is ``{"format", "items": {storage key: tensor | bytes}, "rank_state"}``; rank 0's also
  holds the pickled DCP ``Metadata`` and the world size. The agent commits, replicates and
  drains it like any step, and a reader sees it only once committed.
- **Storage keys** are an item's FQN and chunk offsets (``"layers.0.weight@0,0"``): after
  DCP's global plan every ``MetadataIndex`` is on exactly one rank, so keys are distinct
  across ranks, readable in a shard, and the coordinator knows all of them before any
  rank writes. ``storage_data`` (in ``WriteResult`` and ``Metadata``) is ``(rank, key)``.
- **The coordinator stages with the others.** DCP hands the global ``Metadata`` to
  ``finish()`` only, but with :class:`DefaultSavePlanner` (not overriding
  ``create_global_plan``) it is the planner's ``metadata`` from the start of the write
  phase, so rank 0 completes it (storage data, storage meta) and stages its shard in
  ``write_data``: no rank holds tensors until ``finish``, and the stager's buffers are
  free once ``write_data`` returns. With any other planner rank 0 defers its save to
  ``finish()``; ``finish`` checks the results match what was staged either way.
- **Replicated state is written once.** DCP keeps one copy of every plain (non-DTensor)
  tensor, on the rank with the least data so far: DDP state costs one copy, spread over
  the ranks. The trap is per-rank state that *differs* between ranks (a data loader's
  position, a rank's own statistics): as a plain tensor DCP silently keeps one rank's
  copy. Pass it as ``rank_state=`` instead: it goes into the rank's own shard, outside
  DCP's plan, and :meth:`TieredStorageReader.rank_state` gives it back. Each shard
  also holds the rank's RNG state (``checkpointer.save`` captures it).
- **Saves are explicit.** The step must be one the memory tier takes (``every_steps``);
  this is checked on every rank before anything is written, so all ranks fail together.
  A memory tier with ``every_seconds`` is refused: its agreement is an all-reduce inside
  ``checkpointer.save``, which here would interleave with DCP's own collectives.
  ``dcp.save`` returns, like ``checkpointer.save``, once the shard is copied into shared
  memory; call ``checkpointer.close()`` before the process exits.
- **Loading picks a step together.** Rank 0 lists committed steps of any world size
  (DCP reshards, so a 2-rank step loads on 1 rank or 4), loads shard 0 (the metadata)
  and broadcasts it; each rank then loads shards ``r % world == rank``; an all-reduce
  says whether every shard verified, else the next older step is tried. Each shard
  comes from its fastest verified copy (memory, peer, persistent): a corrupt memory copy
  falls back to the same step's persistent copy if there is one, else to an older step.
  Verified shards the rank's plan needs are kept for ``read_data``; the others are
  loaded there, one at a time, and dropped once copied into the target tensors.
- **The stager** copies the state dict into CPU buffers kept across saves (pinned for
  device tensors), so ``async_save`` stalls for that copy only; the upload thread then
  copies them into shared memory. A linked writer releases the buffers once its shard
  is staged; the next ``stage`` waits for that instead of overwriting them.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import os
import pickle
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import Metadata, StorageReader, StorageWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from unbroken.checkpoint.rank import collectives
from unbroken.checkpoint.api import RestoreReport
from unbroken.checkpoint.format.restore_catalog import RestoreCatalog
from unbroken.checkpoint.rank.dcp_stager import TieredStager
from unbroken.checkpoint.rank.tiered import TieredCheckpointer
from unbroken.errors import CheckpointError

log = logging.getLogger("unbroken.checkpoint.rank.dcp")

FORMAT = "unbroken.dcp/1"

__all__ = ["TieredStager", "TieredStorageReader", "TieredStorageWriter"]


def _key(index: MetadataIndex) -> str:
    offset = "" if index.offset is None else ",".join(str(o) for o in index.offset)
    return f"{index.fqn}@{offset}"


def _parse_step(checkpoint_id: Any) -> int | None:
    text = os.fspath(checkpoint_id) if isinstance(checkpoint_id, (str, os.PathLike)) else str(checkpoint_id)
    text = str(text).removeprefix("step-")
    return int(text) if text.isdigit() else None


def _step_of(checkpoint_id: Any) -> int:
    step = _parse_step(checkpoint_id)
    if step is None:
        raise CheckpointError(f"checkpoint_id {checkpoint_id!r}: the tiers name a checkpoint by its step (e.g. 40)")
    return step


# -- writing ------------------------------------------------------------------------


_TIER_ORDER = ("memory", "replica", "peer", "persistent")
"""Restore sources, fastest first (``tiers.Location.source``)."""


class TieredStorageWriter(StorageWriter):
    """A DCP ``StorageWriter`` whose "files" are this rank's shard of one tiered step."""

    def __init__(self, checkpointer: TieredCheckpointer, step: int | None = None, *, rank_state: Any = None,
                 stager: TieredStager | None = None) -> None:
        super().__init__()
        self.checkpointer = checkpointer
        self.step = step
        """Set here or through ``checkpoint_id`` (``dcp.save(..., checkpoint_id=40)``)."""
        self.rank_state = rank_state
        self.stager = stager
        self.save_id = uuid.uuid4().hex
        self._coordinator = False
        self._locations: dict[MetadataIndex, tuple[int, str]] = {}
        self._staged_metadata: Metadata | None = None
        self._deferred: dict[str, Any] | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.step = _step_of(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _parse_step(checkpoint_id) is not None

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"{self.checkpointer.job}/step-{self.step}", save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise CheckpointError("dcp.save(use_collectives=False) is not supported: a tiered step has one global metadata")
        if is_coordinator and self.checkpointer.rank != 0:
            raise CheckpointError(f"the DCP coordinator is rank {self.checkpointer.rank}; the tiers read the metadata from rank 0's shard")
        self._coordinator = is_coordinator
        self._locations, self._staged_metadata, self._deferred = {}, None, None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        step = self._step()
        memory = self.checkpointer.policy.memory
        if memory.every_seconds is not None:
            raise CheckpointError("DCP saves need a memory tier without every_seconds: the caller decides when to save")
        last = self.checkpointer.last_step
        if not memory.due(step, last_step=last, seconds_since_last=None):
            raise CheckpointError(f"step {step} is not taken by the memory tier (every_steps={memory.every_steps}, last step {last})")
        return dataclasses.replace(plan, storage_data=self.checkpointer.rank)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        locations: dict[MetadataIndex, tuple[int, str]] = {}
        for plan in plans:
            if not plan.usable:
                raise CheckpointError("DCP plan caching (enable_plan_caching=True) is not supported by the tiered writer")
            if not isinstance(plan.storage_data, int):
                raise CheckpointError("a rank's plan has no shard rank: every rank must save through a TieredStorageWriter")
            for item in plan.items:
                locations[item.index] = (plan.storage_data, _key(item.index))
        if len(set(locations.values())) != len(locations):
            raise CheckpointError("two DCP items map to one storage key")
        self._locations = locations
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            payload, results = self._resolve(plan, planner)
            if not self._coordinator:
                self._stage(payload)
            elif _metadata_known(planner):
                metadata: Metadata = planner.metadata  # type: ignore[attr-defined]
                self._stage(self._with_metadata(payload, metadata))
                self._staged_metadata = metadata
            else:
                self._deferred = payload  # holds this rank's tensors until finish()
        finally:
            if self.stager is not None and self._deferred is None:
                self.stager.release()
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        payload, self._deferred = self._deferred, None
        try:
            written = {r.index: r.storage_data for rank_results in results for r in rank_results}
            if written != self._locations:
                raise CheckpointError("DCP's write results differ from the global plan")
            if payload is not None:
                self._stage(self._with_metadata(payload, metadata))
            elif metadata is not self._staged_metadata:
                raise CheckpointError(f"step {self.step}: the planner's metadata changed after the coordinator staged it")
        finally:
            if self.stager is not None:
                self.stager.release()

    # -- helpers ------------------------------------------------------------------

    def _step(self) -> int:
        if self.step is None:
            raise CheckpointError("no step to save: TieredStorageWriter(checkpointer, step) or dcp.save(..., checkpoint_id=step)")
        return self.step

    def _resolve(self, plan: SavePlan, planner: SavePlanner) -> tuple[dict[str, Any], list[WriteResult]]:
        items: dict[str, Any] = {}
        results = []
        rank = self.checkpointer.rank
        for item in plan.items:
            key = _key(item.index)
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                value: Any = data.getvalue()
                size = len(value)
            else:
                assert isinstance(data, torch.Tensor)
                value = data.detach()
                size = value.numel() * value.element_size()
            items[key] = value
            results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=(rank, key)))
        return {"format": FORMAT, "items": items, "rank_state": self.rank_state}, results

    def _with_metadata(self, payload: dict[str, Any], metadata: Metadata) -> dict[str, Any]:
        metadata.storage_data = dict(self._locations)
        metadata.storage_meta = self.storage_meta()
        return {**payload, "metadata": pickle.dumps(metadata), "world_size": self.checkpointer.world_size}

    def _stage(self, payload: dict[str, Any]) -> None:
        step = self._step()
        if not self.checkpointer.stage(step, payload):
            raise CheckpointError(f"step {step} was not staged in the memory tier (the rank's log says why)")


def _metadata_known(planner: SavePlanner) -> bool:
    """Whether ``planner.metadata`` is the object DCP will pass to ``finish()``."""
    return (
        isinstance(planner, DefaultSavePlanner)
        and type(planner).create_global_plan is DefaultSavePlanner.create_global_plan
        and isinstance(getattr(planner, "metadata", None), Metadata)
    )


# -- reading ------------------------------------------------------------------------


class TieredStorageReader(StorageReader):
    """A DCP ``StorageReader`` over the committed steps of the checkpointer's job."""

    def __init__(self, checkpointer: TieredCheckpointer, step: int | None = None, *, collective: bool = True,
                 process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.checkpointer = checkpointer
        self.requested = step
        """The step to load; None: the newest committed DCP step that loads."""
        self.collective = collective
        """False for ``dcp.load(no_dist=True)`` in a distributed job: no collectives then."""
        self.process_group = process_group
        self.step: int | None = None
        """The step ``read_metadata`` chose."""
        self.sources: dict[int, str] = {}
        """Where each shard this rank loaded came from (``memory on node-1``, ``persistent ...``)."""
        self.load_id = uuid.uuid4().hex
        self._catalog = RestoreCatalog(job=checkpointer.job)
        self._storage: dict[MetadataIndex, tuple[int, str]] = {}
        self._shards: dict[int, dict[str, Any]] = {}
        self._rank_states: dict[int, Any] = {}
        self._kinds: dict[int, str] = {}
        self._started = time.perf_counter()

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.requested = _step_of(checkpoint_id)
        self.step, self.sources, self._shards, self._rank_states = None, {}, {}, {}
        self.load_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _parse_step(checkpoint_id) is not None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError("tiered DCP steps hold global metadata only, no per-rank metadata")
        self._started = time.perf_counter()
        ranks = _Ranks(self.collective, self.process_group)
        catalog = ranks.from_root(functools.partial(self.checkpointer.catalog, any_world_size=True))
        if self.requested is not None:
            candidates = [self.requested]
        else:
            candidates = catalog.candidates()
        for step in candidates:
            self._shards, self.sources = {}, {}
            head = ranks.from_root(functools.partial(self._head, step, catalog))
            if head is None:
                continue
            encoded, world_size = head
            if ranks.all(self._verify(step, catalog, world_size, ranks)):
                self.step, self._catalog = step, catalog
                metadata: Metadata = pickle.loads(encoded)
                if metadata.storage_meta is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
                return metadata
            log.warning("step %d: not every shard loads and verifies; trying an older step", step)
        self._shards = {}
        wanted = f"step {self.requested}" if self.requested is not None else "any committed step"
        raise CheckpointError(f"no DCP checkpoint of job {self.checkpointer.job} loads ({wanted}; {len(candidates)} tried)")

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not isinstance(metadata.storage_data, dict):
            raise CheckpointError(f"step {self.step}: DCP metadata without storage data")
        self._storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        needed = {self._where(item)[0] for item in plan.items}
        self._shards = {r: items for r, items in self._shards.items() if r in needed}
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_rank: dict[int, list[ReadItem]] = {}
        for item in plan.items:
            by_rank.setdefault(self._where(item)[0], []).append(item)
        for rank, requests in sorted(by_rank.items()):
            items = self._shards.pop(rank, None)
            if items is None:
                assert self.step is not None
                if self._keep(self.step, rank, self._catalog) is None:
                    raise CheckpointError(f"step {self.step}: rank {rank}'s shard no longer loads from any tier")
                items = self._shards.pop(rank)
            for request in requests:
                _apply(request, items[self._where(request)[1]], planner)
        self._report(sorted(by_rank))
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def rank_state(self, rank: int | None = None) -> Any:
        """What rank ``rank`` (default: this checkpointer's) passed as ``rank_state`` at the loaded step;
        None when that step had no such rank (another world size)."""
        rank = self.checkpointer.rank if rank is None else rank
        if rank not in self._rank_states:
            if self.step is None:
                raise CheckpointError("rank_state() before dcp.load chose a step")
            loaded = self.checkpointer.load_shard(self.step, rank, self._catalog)
            self._rank_states[rank] = None if loaded is None else loaded.payload["state"].get("rank_state")
        return self._rank_states[rank]

    # -- helpers ------------------------------------------------------------------

    def _report(self, ranks: list[int]) -> None:
        """Tell the observer (the node agent) of this rank's restore, named by the slowest tier it read from."""
        if self.checkpointer.observer is None or self.step is None:
            return
        kinds = [self._kinds[r] or "memory" for r in ranks if r in self._kinds] or ["memory"]
        slowest = max(kinds, key=lambda k: _TIER_ORDER.index(k) if k in _TIER_ORDER else len(_TIER_ORDER))
        self.checkpointer.observer.restored(RestoreReport(self.step, slowest, time.perf_counter() - self._started))

    def _where(self, item: ReadItem) -> tuple[int, str]:
        location = self._storage.get(item.storage_index)
        if not (isinstance(location, tuple) and len(location) == 2):
            raise CheckpointError(f"step {self.step}: no shard holds {item.storage_index.fqn}")
        return location

    def _verify(self, step: int, catalog: RestoreCatalog, world_size: int, ranks: _Ranks) -> bool:
        """This rank's share of the step's other shards (``r % world == rank``) loads and verifies."""
        try:
            return all(self._keep(step, r, catalog) is not None for r in range(1, world_size) if r % ranks.size == ranks.rank)
        except Exception as exc:  # noqa: BLE001 - the other ranks wait in the all-reduce: answer "no", never raise alone
            log.warning("step %d: checking shards failed: %s", step, exc)
            return False

    def _head(self, step: int, catalog: RestoreCatalog) -> tuple[bytes, int] | None:
        """Rank 0: the step's metadata and world size, if its shard 0 loads and is a DCP shard."""
        state = self._keep(step, 0, catalog)
        if state is None or "metadata" not in state:
            return None
        return state["metadata"], int(state["world_size"])

    def _keep(self, step: int, rank: int, catalog: RestoreCatalog) -> dict[str, Any] | None:
        """Load rank ``rank``'s shard of ``step`` and keep its items for ``read_data``; None if it does not load."""
        loaded = self.checkpointer.load_shard(step, rank, catalog)
        if loaded is None:
            return None
        state = loaded.payload["state"]
        if not (isinstance(state, dict) and state.get("format") == FORMAT):
            log.info("step %d rank %d is not a DCP checkpoint", step, rank)
            return None
        self._shards[rank] = state["items"]
        self._rank_states[rank] = state.get("rank_state")
        self.sources[rank] = loaded.source
        self._kinds[rank] = loaded.kind
        return state


def _apply(request: ReadItem, value: Any, planner: LoadPlanner) -> None:
    if request.type == LoadItemType.BYTE_IO:
        planner.load_bytes(request, io.BytesIO(value))
        return
    tensor = value
    for dim, (offset, length) in enumerate(zip(request.storage_offsets, request.lengths, strict=True)):
        if offset != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    target = planner.resolve_tensor(request).detach()
    if target.size() != tensor.size():
        raise CheckpointError(f"{request.storage_index.fqn}: stored chunk {tuple(tensor.size())} does not fit target {tuple(target.size())}")
    target.copy_(tensor)
    planner.commit_tensor(request, target)


class _Ranks:
    """Which collectives a load may use: none for ``dcp.load(no_dist=True)`` or a single rank."""

    def __init__(self, collective: bool, group: dist.ProcessGroup | None) -> None:
        self.on = collective and collectives.distributed(group)
        self.group = group
        self.rank = dist.get_rank(group) if self.on else 0
        self.size = dist.get_world_size(group) if self.on else 1

    def from_root(self, compute: Any) -> Any:
        """``compute()`` on rank 0, its value (or its error) on every rank."""
        return collectives.from_rank0(compute, self.group) if self.on else compute()

    def all(self, ok: bool) -> bool:
        return collectives.all_ok(ok, self.group) if self.on else ok
