"""What is known about a shard and a step, in every tier the same.

``ShardInfo`` is the descriptor written next to a shard's bytes (``.json`` beside
a shared-memory slot, the peer protocol's header, an entry of a persistent
manifest). ``StepManifest`` is a step's manifest in the persistent tier:
world size, attempt and every rank's ``ShardInfo``; the ``COMMITTED`` marker
is written after it.

No torch import here: the node agent reads descriptors and must start fast
(it has seconds to register before it counts as lost).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from unbroken.errors import CheckpointError

FORMAT = "unbroken.shard/1"


@dataclass(frozen=True)
class TensorMeta:
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"offset": self.offset, "nbytes": self.nbytes, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "TensorMeta":
        return cls(int(raw["offset"]), int(raw["nbytes"]), str(raw["dtype"]), tuple(int(x) for x in raw["shape"]))


@dataclass(frozen=True)
class ShardLayout:
    """Where each tensor and the skeleton go; computed before any byte is copied."""

    tensors: tuple[TensorMeta, ...]
    skeleton_offset: int
    skeleton: bytes

    @property
    def size(self) -> int:
        return self.skeleton_offset + len(self.skeleton)



class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorEntry(_Frozen):
    offset: int = Field(ge=0)
    nbytes: int = Field(ge=0)
    dtype: str
    shape: tuple[int, ...]

    def meta(self) -> TensorMeta:
        return TensorMeta(self.offset, self.nbytes, self.dtype, self.shape)


class ShardInfo(_Frozen):
    format: str = FORMAT
    job: str
    step: int = Field(ge=0)
    rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    attempt: int = Field(ge=0)
    """The job attempt that wrote it: a step never commits from shards of two attempts."""
    size: int = Field(ge=0)
    skeleton_offset: int = Field(ge=0)
    checksum: str
    tensors: tuple[TensorEntry, ...]
    saved_at: float

    @classmethod
    def describe(cls, *, job: str, step: int, rank: int, world_size: int, attempt: int, layout: ShardLayout, checksum: str) -> "ShardInfo":
        return cls(
            job=job, step=step, rank=rank, world_size=world_size, attempt=attempt, size=layout.size,
            skeleton_offset=layout.skeleton_offset, checksum=checksum, saved_at=time.time(),
            tensors=tuple(TensorEntry(offset=t.offset, nbytes=t.nbytes, dtype=t.dtype, shape=t.shape) for t in layout.tensors),
        )

    def metas(self) -> tuple[TensorMeta, ...]:
        return tuple(t.meta() for t in self.tensors)

    def encode(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def decode(cls, data: bytes | str, *, source: str) -> "ShardInfo":
        try:
            return cls.model_validate_json(data)
        except ValidationError as exc:
            raise CheckpointError(f"{source}: not a shard descriptor ({exc.error_count()} problems, first: {exc.errors()[0]['msg']})") from None

    @classmethod
    def read(cls, path: Path) -> "ShardInfo":
        try:
            return cls.decode(path.read_bytes(), source=str(path))
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read shard descriptor: {exc.strerror}") from None


class StepManifest(_Frozen):
    format: str = "unbroken.step/1"
    job: str
    step: int = Field(ge=0)
    world_size: int = Field(ge=1)
    attempt: int = Field(ge=0)
    shards: tuple[ShardInfo, ...]
    written_at: float = Field(default_factory=time.time)

    @property
    def size(self) -> int:
        return sum(s.size for s in self.shards)

    def shard(self, rank: int) -> ShardInfo:
        for shard in self.shards:
            if shard.rank == rank:
                return shard
        raise CheckpointError(f"manifest of {self.job} step {self.step} has no shard for rank {rank}")

    def check_complete(self) -> None:
        ranks = sorted(s.rank for s in self.shards)
        if ranks != list(range(self.world_size)):
            raise CheckpointError(f"manifest of {self.job} step {self.step}: ranks {ranks} do not cover world size {self.world_size}")
        if {s.attempt for s in self.shards} != {self.attempt}:
            raise CheckpointError(f"manifest of {self.job} step {self.step}: shards from more than one attempt")

    @classmethod
    def decode(cls, data: bytes, *, source: str) -> "StepManifest":
        try:
            manifest = cls.model_validate_json(data)
        except ValidationError as exc:
            raise CheckpointError(f"{source}: not a step manifest ({exc.errors()[0]['msg']})") from None
        manifest.check_complete()
        return manifest


def dumps(raw: Any) -> bytes:
    return json.dumps(raw, separators=(",", ":")).encode()
