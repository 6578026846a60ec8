"""``torch.distributed.checkpoint`` for a sharded (FSDP2) training script, on whatever the
job gives it: the tiered checkpointer's DCP StorageWriter/StorageReader under an agent
with checkpoint tiers, else DCP's own folders under the file checkpointer's directory
(plain ``torchrun``, or a job without tiers).

Both read back steps of any world size: DCP reshards, so a job that shrank or grew
resumes from a checkpoint written at its old size.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from unbroken.checkpoint.api import SaveReport
from unbroken.checkpoint.rank.file import FileCheckpointer
from unbroken.checkpoint.rank.live import LiveFirst
from unbroken.checkpoint.rank.tiered import TieredCheckpointer
from unbroken.train import Context

log = logging.getLogger("unbroken.workloads.sharded_checkpoint")

_STEP_DIR = re.compile(r"^dcp-step-(\d{9})$")


@dataclass(frozen=True)
class Loaded:
    step: int
    source: str
    seconds: float


class ShardedCheckpoint:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        # under in-process restarts the checkpointer is wrapped (live peers first): DCP writes to what it wraps
        checkpoint = ctx.checkpoint.inner if isinstance(ctx.checkpoint, LiveFirst) else ctx.checkpoint
        self.tiered = checkpoint if isinstance(checkpoint, TieredCheckpointer) else None
        self.files: FileCheckpointer | None = None
        if self.tiered is None:
            if not isinstance(checkpoint, FileCheckpointer):
                raise TypeError(f"no DCP storage for a {type(checkpoint).__name__}")
            self.files = checkpoint

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Every rank, together. Returns once this step is committed (tiered: in shared memory)."""
        if self.tiered is not None:
            from unbroken.checkpoint.rank.dcp import TieredStorageWriter

            dcp.save(state, storage_writer=TieredStorageWriter(self.tiered, step))
            # Published (checksummed, told to the agent) before the next step: the controller grows an
            # elastic job once every rank has stepped past a save, and must find that save committed.
            self.tiered.wait()
            return
        assert self.files is not None
        started = time.perf_counter()
        dcp.save(state, checkpoint_id=self.files.directory / f"dcp-step-{step:09d}")
        if self.files.observer is not None:  # the agent counts the stall, and an elastic job grows after a save
            self.files.observer.saved(SaveReport(step, "file", time.perf_counter() - started, 0))
        if self.ctx.rank == 0:  # DCP wrote .metadata last, after every rank's data: the step is whole
            for old in self._committed()[self.files.keep :]:
                shutil.rmtree(self.files.directory / f"dcp-step-{old:09d}", ignore_errors=True)

    def load(self, state: dict[str, Any]) -> Loaded | None:
        """Load the newest step every rank can read into ``state`` (in place); None: start fresh."""
        started = time.perf_counter()
        if self.tiered is not None:
            from unbroken.checkpoint.rank.dcp import TieredStorageReader

            if not self._agreed(bool(self.tiered.catalog(any_world_size=True).candidates())):
                return None
            reader = TieredStorageReader(self.tiered)
            dcp.load(state, storage_reader=reader)
            assert reader.step is not None
            sources = sorted(set(reader.sources.values()))
            return Loaded(reader.step, ", ".join(sources) or "memory", time.perf_counter() - started)
        steps = self._committed()
        newest = self._agreed(steps[0] if steps else None)
        if newest is None:
            return None
        assert self.files is not None
        path = self.files.directory / f"dcp-step-{newest:09d}"
        dcp.load(state, checkpoint_id=path)
        return Loaded(newest, str(path), time.perf_counter() - started)

    def _committed(self) -> list[int]:
        assert self.files is not None
        if not self.files.directory.is_dir():
            return []
        found = (_STEP_DIR.match(p.name) for p in self.files.directory.iterdir() if (p / ".metadata").exists())
        return sorted((int(m.group(1)) for m in found if m), reverse=True)

    def _agreed(self, value: Any) -> Any:
        """Rank 0's answer, on every rank: each must walk into the same ``dcp.load``."""
        if not (dist.is_available() and dist.is_initialized()):
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
