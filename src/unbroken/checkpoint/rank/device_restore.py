"""A shard onto the device: streamed through pinned memory, its checksum verified on the way.

A restore to the GPU through pageable memory costs twice: mapping the shard file
(page tables for every page: 1.48 s for 8 GiB on an H100 host) and a pageable
host-to-device copy (~8 GB/s, where pinned memory runs at the link's ~55 GB/s).
:func:`read_file` does neither. Reader threads ``pread`` the file, in chunks,
into a ring of pinned buffers; the calling thread feeds each chunk to the
shard's streaming checksum in order and queues its host-to-device copy on the
current stream; a buffer is read into again once its copy is done. Reading,
checksumming and the copies overlap; the checksum is known when the last chunk
is in, and a mismatch raises before anything is returned (the device tensors
are dropped). The RNG state in a shard stays on the host, where
``torch.set_rng_state`` wants it.

:func:`to_device` moves a payload read by other means (a peer, the persistent
tier) the same way, tensor by tensor.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from unbroken.checkpoint.format import integrity, shard
from unbroken.checkpoint.node.cuda_host import CudaRuntime
from unbroken.checkpoint.format.integrity import StreamingChecksum
from unbroken.checkpoint.format.manifest import ShardInfo, TensorMeta
from unbroken.errors import CheckpointError

CHUNK_BYTES = integrity.CHUNK_BYTES
"""A chunk: the checksum's (each reader hashes what it read), large enough for each copy to run at the link's speed
and each ``pread`` to amortise its call."""
BUFFERS = 6
READERS = max(4, min(8, os.cpu_count() or 1))
"""``pread`` from tmpfs is the kernel copying at one core's memory speed, and each reader hashes its chunk too. On an
H100 host (16 cores) ``pread`` gave 3.5 GB/s on one thread, 10 on three and 15.7-17.5 on eight; an 8 GiB restore to
the device took 1.00 s with four readers, and with eight against sixteen, in the same runs, 0.80 against 0.95 s and
1.03 against 1.13 s: past eight, readers only contend for the memory bandwidth. One a core, up to eight."""
HOST_PART = "rng"
"""The part of a shard's payload that stays on the host."""


@dataclass(frozen=True)
class _Index:
    """Stands in for tensor ``i`` while the skeleton is read for which tensors stay on the host."""

    i: int


def read_file(path: Path, info: ShardInfo, device: torch.device, runtime: CudaRuntime,
              timing: dict[str, float] | None = None) -> Any:
    """The payload of the shard file ``path`` (described by ``info``) with its tensors on ``device``. ``timing``, if
    given, gets where the time went: ``allocate_s``, ``read_wait_s`` (waiting for the readers), ``checksum_s``,
    ``queue_s`` (queueing the copies), ``drain_s`` (the last copies), ``total_s``."""
    timing = timing if timing is not None else {}
    started = time.perf_counter()
    metas = info.metas()
    fd = os.open(path, os.O_RDONLY)
    try:
        skeleton = os.pread(fd, info.size - info.skeleton_offset, info.skeleton_offset)
        on_host = _host_tensors(skeleton, len(metas))
        targets = [_empty(meta, torch.device("cpu") if i in on_host else device) for i, meta in enumerate(metas)]
        timing["allocate_s"] = time.perf_counter() - started
        checksum = _stream(fd, info.size, metas, targets, on_host, runtime, timing, info.checksum)
    finally:
        os.close(fd)
    timing["total_s"] = time.perf_counter() - started
    if checksum != info.checksum:
        raise CheckpointError(f"{path}: checksum mismatch (descriptor {info.checksum}, data {checksum})")
    return shard.rebuild(skeleton, targets)


def to_device(payload: Any, device: torch.device, runtime: CudaRuntime) -> Any:
    """``payload`` (a shard's, its tensors on the host) with its state's tensors moved to ``device`` through pinned memory."""
    buffers = [runtime.pinned_buffer(CHUNK_BYTES) for _ in range(2)]
    markers: list[Any] = [None, None]
    turn = 0

    def move(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal turn
        target = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        source, destination = _bytes(tensor.contiguous()), _bytes(target)
        for start in range(0, source.numel(), CHUNK_BYTES):
            length = min(CHUNK_BYTES, source.numel() - start)
            if markers[turn] is not None:
                runtime.wait(markers[turn])
            buffers[turn][:length].copy_(source[start : start + length])
            runtime.copy_to_device(destination[start : start + length], buffers[turn][:length])
            markers[turn] = runtime.marker()
            turn = 1 - turn
        return target

    moved = {key: (map_tensors(value, move) if key == "state" else value) for key, value in payload.items()}
    for marker in markers:
        if marker is not None:
            runtime.wait(marker)  # the pinned buffers go when this returns
    return moved


def _stream(fd: int, size: int, metas: tuple[TensorMeta, ...], targets: list[torch.Tensor], on_host: set[int],
            runtime: CudaRuntime, timing: dict[str, float], like: str) -> str:
    """Read ``size`` bytes of ``fd`` into ``targets`` (each meta's bytes into its tensor; those in ``on_host`` are host
    tensors); their checksum, made as ``like`` was. A chunked checksum's chunks are the reads: each reader hashes
    what it read, on its own core; a whole-file one (an older shard) is hashed here, in order."""
    parallel = integrity.is_chunked(like) and CHUNK_BYTES == integrity.CHUNK_BYTES
    checksum = StreamingChecksum(like=like)
    digests: list[bytes] = []
    chunks = [(start, min(CHUNK_BYTES, size - start)) for start in range(0, size, CHUNK_BYTES)]
    buffers = [runtime.pinned_buffer(CHUNK_BYTES) for _ in range(min(BUFFERS, len(chunks)))]
    markers: list[Any] = [None] * len(buffers)
    destinations = [_bytes(t) for t in targets]

    def read(index: int, after: Any) -> tuple[memoryview, bytes]:
        if after is not None:
            runtime.wait(after)  # the buffer's last copy to the device has read it
        start, length = chunks[index]
        view = memoryview(buffers[index % len(buffers)].numpy())[:length]  # type: ignore[arg-type]
        got = os.preadv(fd, [view], start)
        if got != length:
            raise CheckpointError(f"shard file ended after {start + got} of {size} bytes")
        return view, integrity.chunk_digest(view) if parallel else b""

    clock = {"read_wait_s": 0.0, "checksum_s": 0.0, "queue_s": 0.0}
    with ThreadPoolExecutor(READERS, thread_name_prefix="ckpt-restore") as readers:
        pending: dict[int, Future[tuple[memoryview, bytes]]] = {i: readers.submit(read, i, None) for i in range(len(buffers))}
        for index, (start, length) in enumerate(chunks):
            at = time.perf_counter()
            view, digest = pending.pop(index).result()
            clock["read_wait_s"] += time.perf_counter() - at
            at = time.perf_counter()
            if parallel:
                digests.append(digest)
            else:
                checksum.update(view)
            clock["checksum_s"] += time.perf_counter() - at
            at = time.perf_counter()
            buffer = buffers[index % len(buffers)]
            for k, lo, hi in _overlaps(metas, start, start + length):
                part = buffer[lo - start : hi - start]
                destination = destinations[k][lo - metas[k].offset : hi - metas[k].offset]
                if k in on_host:
                    destination.copy_(part)
                else:
                    runtime.copy_to_device(destination, part)
            markers[index % len(buffers)] = runtime.marker()
            following = index + len(buffers)
            if following < len(chunks):
                pending[following] = readers.submit(read, following, markers[index % len(buffers)])
            clock["queue_s"] += time.perf_counter() - at
        at = time.perf_counter()
        for marker in markers:
            if marker is not None:
                runtime.wait(marker)  # every copy has read its buffer: they may go
        clock["drain_s"] = time.perf_counter() - at
    timing.update(clock)
    return integrity.combine(digests, size) if parallel else checksum.hexdigest()


def _overlaps(metas: tuple[TensorMeta, ...], start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """(tensor index, from, to) of the tensor bytes in the file range [start, end)."""
    for k, meta in enumerate(metas):
        lo, hi = max(start, meta.offset), min(end, meta.offset + meta.nbytes)
        if lo < hi:
            yield k, lo, hi


def _host_tensors(skeleton: bytes, count: int) -> set[int]:
    """Indices of the tensors under the payload's host part (the RNG state)."""
    payload = shard.rebuild(skeleton, [_Index(i) for i in range(count)])
    host = payload.get(HOST_PART) if isinstance(payload, dict) else None
    return {index.i for index in _leaves(host, _Index)}


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in nested dicts, lists and tuples."""
    return _leaves(value, torch.Tensor)


def _leaves(value: Any, kind: type) -> Iterator[Any]:
    if isinstance(value, kind):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item, kind)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item, kind)


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with ``fn`` applied to every tensor in its dicts, lists and tuples (other containers are kept as they are)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if type(value) is dict:
        return {k: map_tensors(v, fn) for k, v in value.items()}
    if type(value) is list:
        return [map_tensors(v, fn) for v in value]
    if type(value) is tuple:
        return tuple(map_tensors(v, fn) for v in value)
    return value


def _empty(meta: TensorMeta, device: torch.device) -> torch.Tensor:
    return torch.empty(meta.shape, dtype=getattr(torch, meta.dtype), device=device)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)
