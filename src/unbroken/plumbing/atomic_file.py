"""Whole files or nothing: write to ``<name>.tmp``, fsync, rename over the target, fsync the folder.

A process killed at any point leaves either the old file or the new one (plus at most
a ``.tmp`` nobody reads), never a torn one: checkpoints, token shards and their index
all appear this way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable


def write_atomically(path: Path, write: Callable[[Any], None], *, mode: int | None = None) -> None:
    """Write through ``write(file)`` to ``path.tmp``, fsync it, rename, fsync the folder.
    With ``mode`` (e.g. 0o600 for a key) the file has it before any byte is written."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not stay full of our half-written file
        raise
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomically(path: Path, data: bytes, *, mode: int | None = None) -> None:
    write_atomically(path, lambda f: f.write(data), mode=mode)
