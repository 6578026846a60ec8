"""What the tiered checkpointer does beside the training thread: work in a thread of its own whose
result comes through a future (a save's verification), the time a piece of work took, and the
copy-on-write mapping a restore reads a shard through."""

from __future__ import annotations

import mmap
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def timed(into: dict[str, float], key: str, work: Callable[[], T]) -> T:
    started = time.perf_counter()
    try:
        return work()
    finally:
        into[key] = time.perf_counter() - started


def beside(work: Callable[[], T], name: str = "ckpt-beside") -> Future[T]:
    """Run ``work`` in a thread of its own; its result (or exception) comes through the future."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14; the constant is missing from older Pythons


def map_private(path: Path, size: int) -> mmap.mmap:
    """A copy-on-write mapping of a shard file with its page tables filled for reading.

    Not ``MAP_POPULATE``: on a writable private mapping it faults every page for
    writing, i.e. copies the whole shard. ``MADV_POPULATE_READ`` maps the page-cache
    pages themselves (~0.1 s per GiB here); a later write copies just that page.
    """
    with open(path, "rb") as f:
        view = mmap.mmap(f.fileno(), max(size, 1), flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        view.madvise(_MADV_POPULATE_READ)
    except OSError:
        pass  # older kernel: pages are mapped on first touch instead
    return view
