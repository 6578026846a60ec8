"""The few collectives a checkpoint restore needs, in one place: is this a distributed run,
which device its tensors go on, does every rank agree, what does rank 0 say.

The device is the part that is easy to get wrong. ``unbroken.init()`` starts an
NCCL-only process group on GPUs, and NCCL serves no CPU tensors: an all-reduce
of a CPU tensor there fails with "No backend type associated with device type
cpu". A process group knows which device types it serves
(``get_backend_config``: ``"cpu:gloo,cuda:nccl"``, ``"cuda:nccl"``, ``"cpu:gloo,cuda:gloo"``
for plain gloo); flags go to the CPU only when the group serves it, else to the
current GPU. ``broadcast_object_list`` picks its device the same way inside torch.

Every function is a no-op (returns its local answer) outside a distributed run
of more than one rank, so the same restore code runs under plain ``python``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from unbroken.errors import CheckpointError

T = TypeVar("T")

__all__ = ["all_ok", "any_rank", "device", "distributed", "everyones", "from_rank", "from_rank0"]


def distributed(group: dist.ProcessGroup | None = None) -> bool:
    """A process group with more than one rank is up."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor for a collective on ``group`` must live."""
    served = {pair.split(":", 1)[0].strip() for pair in dist.get_backend_config(group).split(",")}
    if "cpu" in served:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cuda")


def all_ok(ok: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True only if every rank says True (a MIN all-reduce of one int)."""
    return _reduce(ok, dist.ReduceOp.MIN, group)


def any_rank(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True if some rank says True (a MAX all-reduce of one int)."""
    return _reduce(flag, dist.ReduceOp.MAX, group)


def from_rank0(compute: Callable[[], T], group: dist.ProcessGroup | None = None) -> T:
    """``compute()`` on the group's first rank, its value on every rank.

    If it raises there, every rank raises :class:`CheckpointError` with its message
    (no rank is left waiting in the broadcast while the others have moved on).
    """
    if not distributed(group):
        return compute()
    box: list[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            box = [("ok", compute())]
        except Exception as exc:  # noqa: BLE001 - carried to every rank and raised there
            box = [("error", f"{type(exc).__name__}: {exc}")]
    source = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=source, group=group)
    status, value = box[0]
    if status == "error":
        raise CheckpointError(f"rank 0 failed while choosing what to restore: {value}")
    return value  # type: ignore[no-any-return]


def everyones(value: T, group: dist.ProcessGroup | None = None) -> list[T]:
    """Every rank's ``value`` (picklable), in rank order, on every rank."""
    if not distributed(group):
        return [value]
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def from_rank(source: int, value: T | None, group: dist.ProcessGroup | None = None) -> T:
    """Rank ``source``'s ``value`` (picklable; what the others pass is ignored), on every rank."""
    if not distributed(group):
        assert value is not None
        return value
    box: list[Any] = [value]
    dist.broadcast_object_list(box, src=source, group=group)
    return box[0]  # type: ignore[no-any-return]


def _reduce(flag: bool, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None) -> bool:
    if not distributed(group):
        return flag
    tensor = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device(group))
    dist.all_reduce(tensor, op=op, group=group)
    return bool(tensor.item())
