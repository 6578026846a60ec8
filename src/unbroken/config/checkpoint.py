"""Per-tier checkpoint policies (the job file's ``checkpoint:`` section): how often each tier takes a step and how many it keeps.

Declared in the job file under ``checkpoint:`` and usable directly from Python::

    TierPolicy(memory=MemoryTier(every_steps=50, keep=2, replicas=1),
               persistent=PersistentTier(uri="s3://bucket/runs", every_seconds=600))

Who decides what:

- the **memory** tier is decided by the ranks, in ``ctx.checkpoint.save``: ``every_steps``
  costs nothing (every rank computes the same answer); ``every_seconds`` costs one
  4-byte all-reduce per call so that all ranks agree on the step (a rank deciding
  by its own clock would save steps its peers skip, and no step would ever commit);
- **replicas** follow every step committed in memory;
- the **persistent** tier is decided by the node agents on committed memory steps,
  so it never adds to the training stall; if it falls behind it skips to the newest
  committed step instead of queueing.
"""

from __future__ import annotations

from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PERSISTENT_SCHEMES = ("file", "s3")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Cadence(_Strict):
    every_steps: int | None = Field(default=None, ge=1)
    every_seconds: float | None = Field(default=None, gt=0)

    def due(self, step: int, *, last_step: int | None, seconds_since_last: float | None) -> bool:
        """Whether ``step`` goes to this tier, given the last step it took and how long ago.

        ``every_steps`` means multiples of it (every rank and every agent computes the
        same answer); either setting triggers; neither set takes every step offered.
        """
        if last_step is not None and step <= last_step:
            return False
        if self.every_steps is None and self.every_seconds is None:
            return True
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        return self.every_seconds is not None and (seconds_since_last is None or seconds_since_last >= self.every_seconds)


class MemoryTier(_Cadence):
    keep: int = Field(default=2, ge=1, le=16)
    """Committed steps held in shared memory per rank (plus one buffer being written)."""
    replicas: int = Field(default=1, ge=0, le=8)
    """Peer nodes that hold a copy of each shard (ring placement, never the same node)."""


class PersistentTier(_Cadence):
    uri: str
    """``file:///abs/path`` (local or shared filesystem) or ``s3://bucket/prefix``; S3 endpoint
    and credentials come from the usual AWS variables (``AWS_ENDPOINT_URL``, ...)."""
    keep: int = Field(default=2, ge=1, le=1000)

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, value: str) -> str:
        parsed = urlparse(value)
        if parsed.scheme not in PERSISTENT_SCHEMES:
            raise ValueError(f"uri {value!r}: scheme must be one of {', '.join(s + '://' for s in PERSISTENT_SCHEMES)}")
        if parsed.scheme == "file" and (parsed.netloc or not parsed.path.startswith("/")):
            # file://data/x would put "data" in the host part and write relative to the agent's cwd
            raise ValueError(f"uri {value!r}: a file:// uri needs an absolute path and three slashes, e.g. file:///data/ckpt")
        if parsed.scheme == "s3" and not parsed.netloc:
            raise ValueError(f"uri {value!r}: an s3:// uri needs a bucket, e.g. s3://my-bucket/runs")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _needs_cadence(self) -> "PersistentTier":
        if self.every_steps is None and self.every_seconds is None:
            # Draining every memory step to S3 is almost never what anyone wants, and
            # silently doing it would hide a cost; make the choice explicit.
            raise ValueError("set every_steps and/or every_seconds (e.g. every_seconds: 600)")
        return self


class TierPolicy(_Strict):
    memory: MemoryTier = Field(default_factory=MemoryTier)
    persistent: PersistentTier | None = None
