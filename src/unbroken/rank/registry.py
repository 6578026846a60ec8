"""Which process is which rank, for ranks whose environment does not say.

A rank that torchrun starts with ``subprocess`` carries ``RANK`` and
``LOCAL_RANK`` in its environment, and the agent, chaos and the local backend
read them from ``/proc/<pid>/environ``. A rank forked from a warm spare's
forkserver (supervision/warm_spare.py) does not: the kernel shows the environment a
process was *exec'ed* with, and a forked rank was exec'ed as the forkserver.
Such a rank writes one small file, ``<registry>/<pid>.json``, before it runs the
script; readers look there when the environment is silent. The registry is the
worker's log folder (one per attempt and node), so pids of older attempts never
collide with new ones.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

REGISTRY_DIR = "UNBROKEN_RANK_REGISTRY"
"""Set for ranks started from a warm spare: where they register."""
IN_PROCESS_REGISTRY = "UNBROKEN_REJOIN_DIR"
"""``launch_env.REJOIN_DIR``: set for the ranks of a job with in-process restarts. Their environment
names a node-local RANK (each node's torchrun runs alone) and their global rank changes with each
attempt they join, so they register it in that folder, again at every rejoin (train.py)."""


@dataclass(frozen=True)
class RankIdentity:
    rank: int
    """The global rank."""
    local_rank: int


def register(directory: Path, pid: int, identity: RankIdentity) -> None:
    """Record ``pid`` as ``identity``; the file appears whole (rename) or not at all."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{pid}.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"rank": identity.rank, "local_rank": identity.local_rank}))
    os.replace(tmp, path)


def record_exit(directory: Path, pid: int, code: int) -> None:
    """A registered rank's own end (its script returned or raised): the agent reads it when the
    rank's exit status is gone (its parent, the forkserver, reaps at once). A rank with no
    record died of a signal."""
    path = directory / f"{pid}.exit"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(str(code))
    os.replace(tmp, path)


def exit_code(directory: Path, pid: int) -> int | None:
    """What :func:`record_exit` wrote; None if the rank never wrote it (killed)."""
    try:
        return int((directory / f"{pid}.exit").read_text())
    except (OSError, ValueError):
        return None


def identify(pid: int, environ: dict[str, str], registry: Path | None) -> RankIdentity | None:
    """The rank a process is: from its environment (``RANK``, ``LOCAL_RANK``), else from the
    registry; None for a process that is no rank (torchrun, a forkserver, a stray). A rank of a job
    with in-process restarts is known by its registration first."""
    if environ.get(IN_PROCESS_REGISTRY):
        registered = _registered(Path(environ[IN_PROCESS_REGISTRY]), pid)
        if registered is not None:
            return registered
    if "RANK" in environ and "LOCAL_RANK" in environ:
        try:
            return RankIdentity(int(environ["RANK"]), int(environ["LOCAL_RANK"]))
        except ValueError:
            return None
    if registry is None:
        return None
    return _registered(registry, pid)


def _registered(registry: Path, pid: int) -> RankIdentity | None:
    try:
        data = json.loads((registry / f"{pid}.json").read_text())
        return RankIdentity(int(data["rank"]), int(data["local_rank"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
