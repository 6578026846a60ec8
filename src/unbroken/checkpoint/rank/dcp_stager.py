"""The stager for ``dcp.async_save`` on the tiers (``checkpoint/rank/dcp.py`` says how the two go
together): the state dict copied into CPU buffers kept across saves (pinned for device tensors), so
``async_save`` stalls for that copy only."""

from __future__ import annotations

import copy
import logging
import threading
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from unbroken.errors import CheckpointError

log = logging.getLogger("unbroken.checkpoint.rank.dcp")


class TieredStager(AsyncStager):
    """Copies a state dict into CPU buffers allocated on first use and reused by every save.

    Buffers are keyed by their path in the state dict and reallocated only when a shape or
    dtype changes. ``stage`` overwrites them only once the previous save released them: a
    writer built with ``stager=`` does so when its shard is in shared memory (rank 0 with
    a planner other than :class:`DefaultSavePlanner`: in ``finish``, which DCP skips when
    another rank failed; then call :meth:`release` after that save's future is done).
    """

    _synchronize_after_execute = False  # ``stage`` returns after the copy: nothing to wait for

    def __init__(self, *, wait_seconds: float = 300.0) -> None:
        self.wait_seconds = wait_seconds
        """How long ``stage`` waits for the previous save to release the buffers."""
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._free = threading.Event()
        self._free.set()

    @property
    def buffers(self) -> dict[tuple[Any, ...], torch.Tensor]:
        """The staging buffers by their path in the state dict (a copy of the mapping)."""
        return dict(self._buffers)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if not self._free.wait(self.wait_seconds):
            raise CheckpointError(
                f"the previous async save still holds the staging buffers after {self.wait_seconds:g} s; "
                "pass the stager to TieredStorageWriter(stager=...), or call release() once its future is done"
            )
        self._free.clear()
        try:
            seen: set[tuple[Any, ...]] = set()
            staged = self._copy(state_dict, (), seen)
            for path in set(self._buffers) - seen:
                del self._buffers[path]
            if any(b.is_pinned() for b in self._buffers.values()):
                torch.cuda.current_stream().synchronize()
        except BaseException:
            self._free.set()
            raise
        return staged

    def release(self) -> None:
        """The staged copy is no longer read: the next ``stage`` may overwrite it."""
        self._free.set()

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self._buffers.clear()

    def _copy(self, value: Any, path: tuple[Any, ...], seen: set[tuple[Any, ...]]) -> Any:
        if isinstance(value, DTensor):
            local = self._into_buffer(path, value.to_local(), seen)
            # Same spec (mesh, placements, global shape), local data in the buffer; as torch's
            # DefaultStager, the local tensor is on the CPU even when the mesh is not.
            return DTensor(local, value._spec, requires_grad=False)
        if isinstance(value, torch.Tensor):
            return self._into_buffer(path, value, seen)
        if isinstance(value, dict):
            staged = copy.copy(value)  # keeps the mapping's type (OrderedDict, defaultdict)
            for k, v in value.items():
                staged[k] = self._copy(v, (*path, k), seen)
            return staged
        if isinstance(value, list):
            return [self._copy(v, (*path, i), seen) for i, v in enumerate(value)]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(self._copy(v, (*path, i), seen) for i, v in enumerate(value))
        return copy.deepcopy(value)

    def _into_buffer(self, path: tuple[Any, ...], source: torch.Tensor, seen: set[tuple[Any, ...]]) -> torch.Tensor:
        seen.add(path)
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=source.is_cuda)
            self._buffers[path] = buffer
        buffer.copy_(source.detach(), non_blocking=source.is_cuda)
        return buffer
