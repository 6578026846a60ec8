"""The checkpoint filesystem: writable, reads back what was written, has room, and is not crawling.

A full or read-only checkpoint filesystem loses every step since the last
good checkpoint when a fault hits; finding it at join costs nothing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
import uuid
from pathlib import Path

from unbroken.health.context import CheckContext
from unbroken.health.result import FaultAction, Outcome, Status

PROBE_BYTES = 16 << 20
"""Big enough to measure a throughput that means something, small enough for a few hundred ms."""


def storage_dir(ctx: CheckContext) -> Path:
    if ctx.storage_dir is not None:
        return ctx.storage_dir
    if ctx.cluster_dir is not None:
        return ctx.cluster_dir / "checkpoints"
    return ctx.node_dir


def checkpoint(ctx: CheckContext) -> Outcome:
    root = storage_dir(ctx)
    size = int(ctx.params.get("storage_bytes", PROBE_BYTES))
    payload = os.urandom(size)
    probe = root / f".unbroken-health-{ctx.node}-{uuid.uuid4().hex[:8]}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        with open(probe, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        seconds = time.perf_counter() - start
        back = probe.read_bytes()
    except OSError as exc:
        return Outcome(Status.FAIL, f"checkpoint storage {root} not writable: {exc.strerror or exc}", "NotWritable",
                       {"path": str(root)}, FaultAction.REBOOT)
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass  # the directory itself is unusable: already reported above
    free = shutil.disk_usage(root).free
    metrics = {"path": str(root), "write_MBps": round(size / seconds / 1e6, 1), "free_GiB": round(free / 2**30, 2),
               "free_floor_GiB": ctx.settings.StorageFreeFloorGiB}
    if hashlib.sha256(back).digest() != hashlib.sha256(payload).digest():
        return Outcome(Status.FAIL, f"checkpoint storage {root} returned different bytes than were written", "ReadBackMismatch",
                       metrics, FaultAction.REPLACE)
    if free < ctx.settings.StorageFreeFloorGiB * 2**30:
        # The shared filesystem being full is not this node's fault: no node action, but a failure people see.
        return Outcome(Status.FAIL, f"checkpoint storage {root} has {free / 2**30:.2f} GiB free, "
                       f"floor {ctx.settings.StorageFreeFloorGiB:g} GiB", "LowFreeSpace", metrics, FaultAction.NONE)
    return Outcome(Status.PASS, f"{root}: wrote and read back {size >> 20} MiB at {metrics['write_MBps']} MB/s, "
                   f"{metrics['free_GiB']} GiB free", "", metrics, FaultAction.NONE)
