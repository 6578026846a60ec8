"""One rank's checkpoint as bytes: every tensor laid out flat, then the rest pickled.

Layout of a shard (the same bytes in shared memory, on a peer and in the persistent tier)::

    [tensor 0][pad][tensor 1][pad]...[skeleton pickle]

Tensors start at 64-byte boundaries so they can be viewed in place. The skeleton
is the state dict pickled with every tensor replaced by its index (pickle's
``persistent_id``, the mechanism ``torch.save`` itself uses), so any nesting of
dicts, lists, optimizer state and plain Python values round-trips.
The :class:`ShardHeader` (sizes, dtype/shape per tensor, checksum) lives next
to the bytes (descriptor file, manifest), not inside them.

Tensors that share storage (views of one another) are written once each and
come back as separate tensors; state dicts of models and optimizers do not
rely on sharing.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from typing import Any

import torch

from unbroken.checkpoint.format.integrity import StreamingChecksum, checksum
from unbroken.checkpoint.format.manifest import FORMAT, ShardLayout, TensorMeta
from unbroken.errors import CheckpointError

__all__ = ["ALIGN", "FORMAT", "ShardLayout", "StreamingChecksum", "TensorMeta", "checksum", "plan", "read", "rebuild", "view", "write"]

ALIGN = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class _Flattener(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            self.tensors.append(obj)
            return ("tensor", len(self.tensors) - 1)
        return None


class _Unflattener(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        kind, index = pid
        if kind != "tensor":
            raise pickle.UnpicklingError(f"unknown reference {kind!r} in a checkpoint shard")
        return self.tensors[index]


def plan(state: Any) -> tuple[ShardLayout, list[torch.Tensor]]:
    """Lay out ``state``: the skeleton and where each of its tensors goes."""
    buffer = io.BytesIO()
    flattener = _Flattener(buffer)
    flattener.dump(state)
    metas = []
    offset = 0
    for tensor in flattener.tensors:
        if tensor.layout is not torch.strided or tensor.device.type == "meta":
            raise CheckpointError(
                f"checkpoint state at {_path_to(state, tensor)} ({tensor.layout}, device {tensor.device}, shape {tuple(tensor.shape)}) "
                "cannot be checkpointed: only dense tensors with data can (use .to_dense(); materialize meta tensors)"
            )
        offset = _align(offset)
        nbytes = tensor.numel() * tensor.element_size()
        metas.append(TensorMeta(offset, nbytes, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)))
        offset += nbytes
    return ShardLayout(tuple(metas), _align(offset), buffer.getvalue()), flattener.tensors


def _path_to(state: Any, target: torch.Tensor) -> str:
    """Where ``target`` sits in nested dicts/lists, for an error message (``optimizer.embedding``)."""
    stack: list[tuple[Any, str]] = [(state, "")]
    while stack:
        node, path = stack.pop()
        if node is target:
            return path.lstrip(".") or "?"
        if isinstance(node, dict):
            stack += [(v, f"{path}.{k}") for k, v in node.items()]
        elif isinstance(node, (list, tuple)):
            stack += [(v, f"{path}.{i}") for i, v in enumerate(node)]
    return "?"


def _view(buffer: Any, meta: TensorMeta) -> torch.Tensor:
    dtype = getattr(torch, meta.dtype)
    if meta.nbytes == 0:
        return torch.empty(meta.shape, dtype=dtype)
    raw = torch.frombuffer(buffer, dtype=torch.uint8, count=meta.nbytes, offset=meta.offset)
    return raw.view(dtype).view(meta.shape)


Copy = Callable[[torch.Tensor, torch.Tensor], None]
"""Copies a tensor (source, second) into its place in a shard (destination, first)."""


def write(buffer: Any, layout: ShardLayout, tensors: list[torch.Tensor], *, copy: Copy | None = None,
          landed: Callable[[int], None] | None = None) -> None:
    """Copy every tensor and the skeleton into ``buffer`` (writable, at least ``layout.size`` bytes).

    This copy is the whole blocking part of a save. ``copy`` puts one tensor in its
    place (default ``Tensor.copy_``); the memory tier passes one that queues device
    tensors' copies on its copy stream, and synchronises before the bytes are read.
    ``landed(end)``, if given, is told after each tensor's copy, in order, that the
    bytes before ``end`` are copied (or queued, by such a ``copy``); last with
    ``layout.size``, once the skeleton is written.
    """
    with torch.no_grad():
        for meta, tensor in zip(layout.tensors, tensors, strict=True):
            if meta.nbytes:
                destination = _view(buffer, meta)
                if copy is None:
                    destination.copy_(tensor.detach())
                else:
                    copy(destination, tensor.detach())
                if landed is not None:
                    landed(meta.offset + meta.nbytes)
    view = memoryview(buffer)
    view[layout.skeleton_offset : layout.size] = layout.skeleton
    view.release()
    if landed is not None:
        landed(layout.size)


def view(buffer: Any, meta: TensorMeta) -> torch.Tensor:
    """Where the tensor described by ``meta`` lies in ``buffer``, as a tensor of its dtype and shape."""
    return _view(buffer, meta)


def read(buffer: Any, tensors: tuple[TensorMeta, ...], skeleton_offset: int, size: int, *, copy: bool = True) -> Any:
    """Rebuild the state from shard bytes. ``copy`` detaches it from ``buffer`` (a reused slot)."""
    views = [_view(buffer, meta) for meta in tensors]
    if copy:
        views = [v.clone() for v in views]
    skeleton = bytes(memoryview(buffer)[skeleton_offset:size])
    return rebuild(skeleton, views)


def rebuild(skeleton: bytes, tensors: list[Any]) -> Any:
    """The state from its skeleton, with ``tensors[i]`` wherever tensor ``i`` was (any objects will do)."""
    return _Unflattener(io.BytesIO(skeleton), tensors).load()
