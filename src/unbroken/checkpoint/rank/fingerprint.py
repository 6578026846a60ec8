"""Block sums: a fingerprint of a tensor's bytes that the device and the host compute alike.

A save of device tensors is recorded only once the bytes in its slot are known
to be the bytes the rank held. The shard's checksum (xxh3) is of the slot, so
it cannot say that: a copy that went to other pages (a stale registration), or
stopped short, or raced a write, leaves a slot that checksums fine. So the
source is fingerprinted on the device, on the copy stream right before its
copy (the same bytes the copy reads), and the slot on the host after it; the
save counts only if the two agree.

The fingerprint is, per tensor and per 1 MiB block of its bytes, the sum of the
block's 8-byte words modulo 2**64 (the bytes past the last whole word are summed
on their own). Integer sums wrap the same way everywhere and do not depend on
the order of the additions, so a GPU's reduction and a CPU's give the same
numbers bit for bit; they are cheap on both (one read of the bytes: ~3 ms per
8 GiB on an H100, ~30 GB/s on one host core); and a block that differs in any
one word, or by any run of bytes that does not sum to zero mod 2**64, shows.
It is not a cryptographic hash, and needs not be: what it guards against is a
copy gone wrong, not an adversary.
"""

from __future__ import annotations

from typing import Any

import torch

BLOCK_BYTES = 1 << 20
_WORD = 8


def of_bytes(data: torch.Tensor) -> torch.Tensor:
    """Block sums of ``data``, a 1-D contiguous ``uint8`` tensor, on its device (int64)."""
    nbytes = data.numel()
    whole = nbytes // _WORD * _WORD
    if whole and data.data_ptr() % _WORD:
        data = data.clone()  # a view at an odd offset: an aligned copy, for the int64 view
    parts: list[torch.Tensor] = []
    blocks = whole // BLOCK_BYTES
    if blocks:
        parts.append(data[: blocks * BLOCK_BYTES].view(torch.int64).view(blocks, BLOCK_BYTES // _WORD).sum(dim=1))
    rest = data[blocks * BLOCK_BYTES : whole]
    if rest.numel():
        parts.append(rest.view(torch.int64).sum().reshape(1))
    tail = data[whole:]
    if tail.numel():
        parts.append(tail.to(torch.int64).sum().reshape(1))
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=data.device)
    return torch.cat(parts)


def of_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Block sums of a tensor's bytes in row-major order (what a slot holds of it)."""
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return of_bytes(flat.view(torch.uint8))


def of_host(buffer: Any, offset: int, nbytes: int) -> torch.Tensor:
    """Block sums of ``nbytes`` of a host buffer (a slot) from ``offset``."""
    if nbytes == 0:
        return torch.zeros(0, dtype=torch.int64)
    return of_bytes(torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset))
