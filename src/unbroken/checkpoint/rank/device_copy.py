"""A rank's device tensors into its memory-tier slot, and the proof that the slot holds them.

The copy runs on the checkpointer's copy stream, after the caller's stream has
queued the last writes to the tensors: into the slot directly when its mapping
is pinned (the DMA engine at the link's speed), else through a small pinned
bounce buffer that the CUDA runtime allocated itself (exact whatever became of
the slot's registration, at the speed of a host memcpy). On the same stream,
right after the copy and before the tensors may change, the source is
fingerprinted (fingerprint.py): the save is recorded only if the slot's bytes
fingerprint the same on the host, which :meth:`DeviceCopy.verify` checks after
the training step was let go. Everything of a save runs on that stream, which has
the highest priority: nothing of it may wait behind the training's queued kernels.

The slot's side of the read-back (:meth:`DeviceCopy.fingerprint_slot`) and its
checksum need not wait for the whole copy: they read each tensor as soon as its
copies have landed (landing.py), beside the copies still running.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

import torch

from unbroken.checkpoint.format import shard
from unbroken.checkpoint.node import shm
from unbroken.checkpoint.rank import fingerprint
from unbroken.checkpoint.rank.landing import Landing
from unbroken.checkpoint.node.cuda_host import PinnedMemory
from unbroken.checkpoint.format.manifest import ShardLayout

BOUNCE_BYTES = 64 << 20
"""The bounce buffer: large enough that each chunk's copy runs at the link's speed, small enough to keep."""


@dataclass(frozen=True)
class Expected:
    """What each device tensor of a save fingerprinted as on the device, by its index in the layout."""

    sums: dict[int, torch.Tensor]
    through_bounce: bool
    """The slot was not pinned: the copy went through the bounce buffer."""


@dataclass
class DeviceCopy:
    pinning: PinnedMemory
    _bounce: torch.Tensor | None = field(default=None, init=False)

    def holds_device_tensors(self, tensors: list[torch.Tensor]) -> bool:
        return any(self.pinning.runtime.is_device(t) for t in tensors)

    def device_indices(self, layout: ShardLayout, tensors: list[torch.Tensor]) -> list[int]:
        """The tensors (by index in the layout) whose bytes come from the device: the ones the read-back checks."""
        return [i for i, t in enumerate(tensors) if self.pinning.runtime.is_device(t) and layout.tensors[i].nbytes]

    def into(self, slot: shm.Slot, buffer: Any, layout: ShardLayout, tensors: list[torch.Tensor], ready: Any,
             landing: Landing | None = None) -> Expected:
        """Copy ``tensors`` into ``buffer`` (the slot's mapping) and fingerprint the device ones; returns once
        the copy is complete, after which the tensors may change. ``landing`` is told as the copies are queued."""
        runtime = self.pinning.runtime
        direct = slot.pin(self.pinning)
        with torch.no_grad(), runtime.copy_stream(ready):
            # The copies first: the DMA engines start at once, whatever the training's kernels hold of the SMs; the
            # fingerprints follow on the same (high-priority) stream, before anything lets the tensors change.
            shard.write(buffer, layout, tensors, copy=self._direct if direct else self._bounced,
                        landed=landing.landed if landing is not None else None)
            device = {i: fingerprint.of_tensor(tensors[i]) for i in self.device_indices(layout, tensors)}
            # On this stream too: a plain .cpu() after it would go on the default stream, behind the training's
            # queued kernels (on an H100 it held every save's copy to the end of the 0.5 s step beside it).
            sums = {i: found.to("cpu", non_blocking=True) for i, found in device.items()}
            runtime.synchronize()
        return Expected(sums, through_bounce=not direct)

    @staticmethod
    def fingerprint_slot(buffer: Any, layout: ShardLayout, indices: list[int],
                         ready: Callable[[int], None] | None = None) -> dict[int, torch.Tensor]:
        """The fingerprints of the tensors ``indices`` as ``buffer`` (the slot) holds them; ``ready(end)`` returns once
        the bytes before ``end`` are there (each tensor is read as soon as it landed)."""
        found = {}
        for index in indices:
            meta = layout.tensors[index]
            if ready is not None:
                ready(meta.offset + meta.nbytes)
            found[index] = fingerprint.of_host(buffer, meta.offset, meta.nbytes)
        return found

    @staticmethod
    def verify(found: dict[int, torch.Tensor], layout: ShardLayout, expected: Expected) -> str | None:
        """None if every device tensor's fingerprint in the slot (``found``) is what it was on the device, else what differs."""
        for index, sums in expected.sums.items():
            meta = layout.tensors[index]
            here = found.get(index)
            if here is None:
                return f"tensor {index} ({meta.dtype} {list(meta.shape)}) was not read back from the slot"
            if not torch.equal(here, sums):
                differ = (here != sums).nonzero().flatten().tolist() if here.shape == sums.shape else []
                where = f"blocks {differ[:5]} of {sums.numel()}" if differ else f"{here.numel()} blocks, not {sums.numel()}"
                return (f"tensor {index} ({meta.dtype} {list(meta.shape)}, {meta.nbytes} bytes): {where} "
                        f"({fingerprint.BLOCK_BYTES >> 20} MiB each) differ from the device's")
        return None

    def _direct(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        if self.pinning.runtime.is_device(source):
            self.pinning.runtime.copy_to_host(destination, source)
        else:
            destination.copy_(source)

    def _bounced(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        runtime = self.pinning.runtime
        if not runtime.is_device(source):
            destination.copy_(source)
            return
        flat = source.reshape(-1)
        data = (flat if flat.is_contiguous() else flat.contiguous()).view(torch.uint8)
        target = destination.reshape(-1).view(torch.uint8)
        if self._bounce is None:
            self._bounce = runtime.pinned_buffer(BOUNCE_BYTES)
        for start in range(0, data.numel(), BOUNCE_BYTES):
            length = min(BOUNCE_BYTES, data.numel() - start)
            runtime.copy_to_host(self._bounce[:length], data[start : start + length])
            runtime.synchronize()
            target[start : start + length].copy_(self._bounce[:length])
