"""The persistent tier: a folder or bucket reached through fsspec (``file://``, ``s3://``).

Layout under the tier's URI::

    <job>/step-000000040/rank-00003.shard   the shard's bytes, exactly as in shared memory
    <job>/step-000000040/manifest.json      world size, attempt, every rank's ShardInfo
    <job>/step-000000040/COMMITTED          written last: the step is visible from here on

The tier is self-describing: a new cluster (or ``unbroken ckpt verify``) can
list and check it without the store. On ``file://`` every file is written
to a temporary name, fsynced and renamed; on S3 an object appears atomically
when its (multipart) upload completes, so the order manifest → marker is enough.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import fsspec

from unbroken.checkpoint.format.manifest import ShardInfo, StepManifest, dumps
from unbroken.checkpoint.format.integrity import StreamingChecksum
from unbroken.errors import CheckpointError

MARKER = "COMMITTED"
_STEP = re.compile(r"step-(\d{9})$")
_CHUNK = 8 << 20
_UPLOAD_PART = 64 << 20
"""Multipart upload part size on object stores (S3 allows 5 MiB - 5 GiB per part)."""


def _fs_options(uri: str) -> dict[str, Any]:
    if urlparse(uri).scheme != "s3":
        return {}
    options: dict[str, Any] = {"use_listings_cache": False, "skip_instance_cache": True}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["client_kwargs"] = {"endpoint_url": endpoint}
    return options


class PersistentStore:
    """One tier URI. Methods raise ``OSError``/``CheckpointError``; callers decide to retry or degrade."""

    def __init__(self, uri: str) -> None:
        self.uri = uri.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.uri, **_fs_options(uri))
        self.local = urlparse(uri).scheme == "file"

    # -- paths ----------------------------------------------------------------------

    def step_path(self, job: str, step: int) -> str:
        return f"{self.root}/{job}/step-{step:09d}"

    def shard_path(self, job: str, step: int, rank: int) -> str:
        return f"{self.step_path(job, step)}/rank-{rank:05d}.shard"

    def display(self, job: str, step: int) -> str:
        return f"{self.uri}/{job}/step-{step:09d}"

    # -- writing --------------------------------------------------------------------

    def upload_shard(self, source: Path, info: ShardInfo) -> None:
        """Copy a shard's bytes from shared memory to the tier."""
        target = self.shard_path(info.job, info.step, info.rank)
        if self.local:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            with open(source, "rb") as src:
                _write_local(Path(target), lambda out: _sendfile(src.fileno(), out.fileno(), info.size))
        else:
            # Exactly ``info.size`` bytes: a shared-memory slot is rounded up beyond its shard.
            with open(source, "rb") as src, self.fs.open(target, "wb", block_size=_UPLOAD_PART) as out:
                left = info.size
                while left:
                    chunk = src.read(min(_UPLOAD_PART, left))
                    if not chunk:
                        raise CheckpointError(f"{source} ended {left} bytes before the shard's {info.size}")
                    out.write(chunk)
                    left -= len(chunk)

    def commit(self, manifest: StepManifest) -> None:
        """Manifest, then the marker: the step is visible only once both exist."""
        manifest.check_complete()
        base = self.step_path(manifest.job, manifest.step)
        self._put_small(f"{base}/manifest.json", manifest.model_dump_json().encode())
        self._put_small(f"{base}/{MARKER}", dumps({"step": manifest.step, "attempt": manifest.attempt}))

    def _put_small(self, path: str, data: bytes) -> None:
        if self.local:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            _write_local(Path(path), lambda out: out.write(data))
        else:
            self.fs.pipe_file(path, data)

    def delete_step(self, job: str, step: int) -> None:
        """Marker first, so a half-deleted step is never taken for a committed one."""
        base = self.step_path(job, step)
        try:
            self.fs.rm_file(f"{base}/{MARKER}")
        except FileNotFoundError:
            pass
        try:
            self.fs.rm(base, recursive=True)
        except FileNotFoundError:
            pass

    # -- reading --------------------------------------------------------------------

    def steps(self, job: str) -> list[int]:
        """Step folders present (committed or not), newest first."""
        try:
            entries = self.fs.ls(f"{self.root}/{job}", detail=False)
        except FileNotFoundError:
            return []
        steps = [int(m.group(1)) for e in entries if (m := _STEP.search(str(e).rstrip("/")))]
        return sorted(steps, reverse=True)

    def is_committed(self, job: str, step: int) -> bool:
        return bool(self.fs.exists(f"{self.step_path(job, step)}/{MARKER}"))

    def committed_steps(self, job: str) -> list[int]:
        return [s for s in self.steps(job) if self.is_committed(job, s)]

    def manifest(self, job: str, step: int) -> StepManifest:
        path = f"{self.step_path(job, step)}/manifest.json"
        return StepManifest.decode(self.fs.cat_file(path), source=f"{self.uri}/{job}/step-{step:09d}/manifest.json")

    def read_shard(self, info: ShardInfo) -> bytearray:
        """The shard's bytes, checked against ``info.checksum``; CheckpointError on a mismatch."""
        path = self.shard_path(info.job, info.step, info.rank)
        buffer = bytearray(info.size)
        view = memoryview(buffer)
        digest = StreamingChecksum(like=info.checksum)
        done = 0
        with self.fs.open(path, "rb", block_size=_CHUNK) as f:
            while done < info.size:
                n = f.readinto(view[done : done + _CHUNK]) if hasattr(f, "readinto") else _read_into(f, view, done)
                if not n:
                    break
                digest.update(view[done : done + n])
                done += n
            extra = f.read(1)
        view.release()
        where = f"{self.display(info.job, info.step)}/rank-{info.rank:05d}.shard"
        if done != info.size or extra:
            raise CheckpointError(f"{where}: size differs from the manifest ({info.size} bytes expected)")
        if digest.hexdigest() != info.checksum:
            raise CheckpointError(f"{where}: checksum mismatch (manifest {info.checksum}, data {digest.hexdigest()})")
        return buffer


def _read_into(f: Any, view: memoryview, offset: int) -> int:
    data = f.read(_CHUNK)
    view[offset : offset + len(data)] = data
    return len(data)


def _sendfile(src: int, dst: int, size: int) -> None:
    done = 0
    while done < size:
        sent = os.sendfile(dst, src, done, size - done)
        if sent == 0:
            raise CheckpointError(f"shard source ended after {done} of {size} bytes")
        done += sent


def _write_local(path: Path, write: Any) -> None:
    from unbroken.plumbing.atomic_file import write_atomically

    write_atomically(path, write)
