"""Shard checksums: xxh3-64 over the exact bytes, the same in every tier, computed on many cores.

The checksum of a shard is ``xxh3_64c:<hex>``: the xxh3-64 of the xxh3-64 digests
of its 32 MiB chunks, in order, followed by its size. One core hashes ~20-30 GB/s,
which made the checksum of an 8 GiB shard (~0.4 s) the longest part of a save on an
H100 (the device-to-host copy takes 0.16 s); chunks hash on as many threads as
there are cores to spare, and a stream of chunks (a restore's readers, a peer's
transfer) is hashed as it arrives. xxhash releases the GIL, so hashing in
threads barely touches the training thread.

Shards written before this (``xxh3_64:<hex>``, one xxh3-64 over all the bytes) still
verify: every check computes the checksum the way the one it compares with was
made (``like=``). No torch import: the node agent uses this too and must start fast.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import xxhash

CHECKSUM_ALGORITHM = "xxh3_64c"
"""Chunked: what every new shard's checksum is."""
WHOLE_ALGORITHM = "xxh3_64"
"""One xxh3-64 over all the bytes: shards of earlier versions."""
CHUNK_BYTES = 32 << 20
"""A chunk: large enough that a thread's start and the digests' combination cost nothing, small enough that
a few GiB make many chunks to share out."""
THREADS = max(1, min(8, (os.cpu_count() or 1) - 1))
"""Threads hashing one shard: the cores a node can spare beside its ranks, no more than eight."""


def checksum(buffer: Any, size: int, *, like: str | None = None, ready: Callable[[int], None] | None = None) -> str:
    """The checksum of the first ``size`` bytes; with ``like``, made the way that checksum was (to compare with it).

    ``ready(end)``, if given, returns once the bytes before ``end`` are in ``buffer``: each chunk is hashed as soon
    as it is, while the rest is still being written (a save's copy from the device)."""
    view = memoryview(buffer).cast("B")[:size]

    def digest(start: int) -> bytes:
        end = min(start + CHUNK_BYTES, size)
        if ready is not None:
            ready(end)
        with view[start:end] as chunk:
            return chunk_digest(chunk)

    try:
        if _algorithm(like) == WHOLE_ALGORITHM:
            if ready is not None:
                ready(size)
            return f"{WHOLE_ALGORITHM}:{xxhash.xxh3_64(view).hexdigest()}"
        starts = range(0, size, CHUNK_BYTES)
        if len(starts) <= 2:
            digests = [digest(start) for start in starts]
        else:
            with ThreadPoolExecutor(min(THREADS, len(starts)), thread_name_prefix="checksum") as pool:
                digests = list(pool.map(digest, starts))
        return combine(digests, size)
    finally:
        view.release()


def chunk_digest(data: Any) -> bytes:
    """One chunk's digest (a thread's share of :func:`checksum`, or a restore reader's)."""
    return xxhash.xxh3_64(data).digest()


def combine(digests: list[bytes], size: int) -> str:
    """The checksum of ``size`` bytes from their chunks' digests, in order."""
    return f"{CHECKSUM_ALGORITHM}:{xxhash.xxh3_64(b''.join(digests) + size.to_bytes(8, 'little')).hexdigest()}"


def is_chunked(like: str | None) -> bool:
    """Whether a checksum made like ``like`` can be put together from its chunks' digests."""
    return _algorithm(like) == CHECKSUM_ALGORITHM


def _algorithm(like: str | None) -> str:
    return WHOLE_ALGORITHM if like is not None and like.startswith(f"{WHOLE_ALGORITHM}:") else CHECKSUM_ALGORITHM


class StreamingChecksum:
    """The same checksum over bytes that arrive in pieces (network, object store); ``like`` as for :func:`checksum`."""

    def __init__(self, like: str | None = None) -> None:
        self._whole = xxhash.xxh3_64() if _algorithm(like) == WHOLE_ALGORITHM else None
        self._chunk = xxhash.xxh3_64()
        self._in_chunk = 0
        self._digests: list[bytes] = []
        self._size = 0

    def update(self, data: Any) -> None:
        if self._whole is not None:
            self._whole.update(data)
            return
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), CHUNK_BYTES - self._in_chunk)
            self._chunk.update(view[:take])
            self._in_chunk += take
            self._size += take
            view = view[take:]
            if self._in_chunk == CHUNK_BYTES:
                self._digests.append(self._chunk.digest())
                self._chunk.reset()
                self._in_chunk = 0

    def hexdigest(self) -> str:
        if self._whole is not None:
            return f"{WHOLE_ALGORITHM}:{self._whole.hexdigest()}"
        tail = [self._chunk.digest()] if self._in_chunk else []
        return combine(self._digests + tail, self._size)
