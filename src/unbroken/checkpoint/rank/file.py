"""Checkpoints as files: one file per rank per step, written atomically.

Layout::

    <dir>/step-000000040/rank-00000.pt   (each: write tmp, fsync, rename, fsync dir)
    <dir>/step-000000040/manifest.json   (rank 0: world size, step; written the same way)

A step counts as committed only when its manifest and all ``world_size`` rank
files exist; since every file appears by an atomic rename, a rank killed in
the middle of a save leaves only a ``*.tmp`` that is never read. No barrier
is needed in ``save``, so a slow rank never stalls the others there.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import zipfile
from pathlib import Path
from typing import Any

import torch

from unbroken.checkpoint.rank import collectives, rng
from unbroken.checkpoint.rank.device_restore import map_tensors
from unbroken.plumbing.atomic_file import write_atomically
from unbroken.checkpoint.api import CheckpointObserver, Restored, RestoreReport, SaveReport
from unbroken.errors import CheckpointError

_STEP_DIR = re.compile(r"^step-(\d{9})$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:09d}"


def quarantine_dir(root: Path, step: int) -> Path:
    """Where a distrusted step's folder goes: out of ``step-*``'s pattern, a free name (a step can be distrusted twice)."""
    base = root / f"untrusted-step-{step:09d}"
    target, n = base, 1
    while target.exists():
        target, n = base.with_name(f"{base.name}.{n}"), n + 1
    return target


def rank_file(root: Path, step: int, rank: int) -> Path:
    return step_dir(root, step) / f"rank-{rank:05d}.pt"


def committed_steps(root: Path, world_size: int) -> list[int]:
    """Steps whose manifest and every rank file are present, newest first."""
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if not match:
            continue
        step = int(match.group(1))
        if _manifest_world_size(entry) != world_size:
            continue  # no manifest yet (torn), or written by a run of another size
        if all(rank_file(root, step, r).exists() for r in range(world_size)):
            steps.append(step)
    return sorted(steps, reverse=True)


class FileCheckpointer:
    """The foundation's checkpointer: local or shared filesystem, every rank its own file."""

    def __init__(
        self,
        directory: Path,
        *,
        rank: int = 0,
        world_size: int = 1,
        keep: int = 2,
        observer: CheckpointObserver | None = None,
    ) -> None:
        self.directory = directory
        self.rank = rank
        self.world_size = world_size
        self.keep = keep
        self.observer = observer
        self.agreed_step: int | None = None
        """The last step the replicas agreed on (``agreed``): retention keeps the newest committed step up to it."""

    def close(self) -> None:
        """Nothing to let go of: every save is durable when it returns."""

    def fence(self) -> None:
        """Nothing to wait for: ``save`` returns with the state on disk."""

    def agreed(self, step: int) -> None:
        self.agreed_step = step

    def distrust_after(self, step: int, why: str) -> None:
        """Quarantine the step folders after ``step``: each is renamed ``untrusted-step-…`` with the reason beside
        its files, so no restore (and no retention) sees it, and whoever looks into the folder sees why.
        Every rank tries (the folder may be shared or per node); a rename another rank made first is no error."""
        if not self.directory.is_dir():
            return
        for entry in sorted(self.directory.iterdir()):
            match = _STEP_DIR.match(entry.name)
            if not match or int(match.group(1)) <= step:
                continue
            target = quarantine_dir(self.directory, int(match.group(1)))
            try:
                entry.rename(target)
            except OSError:
                continue  # renamed by a peer meanwhile, or a name taken: the folder is out of the restore's sight or will be
            try:
                (target / "UNTRUSTED").write_text(why + "\n")
            except OSError:
                pass  # the name says it already
            print(f"unbroken: {entry.name} quarantined as {target.name}: {why}", flush=True)

    def save(self, step: int, state: dict[str, Any]) -> None:
        if step < 0:
            raise CheckpointError(f"checkpoint step must be >= 0, got {step}")
        started = time.perf_counter()
        target = step_dir(self.directory, step)
        try:
            target.mkdir(parents=True, exist_ok=True)
            payload = {"step": step, "state": state, "rng": rng.capture()}
            path = rank_file(self.directory, step, self.rank)
            write_atomically(path, lambda f: torch.save(payload, f))
            if self.rank == 0:
                manifest = {"step": step, "world_size": self.world_size, "format": "unbroken.file/1"}
                write_atomically(target / "manifest.json", lambda f: f.write(json.dumps(manifest).encode()))
                self._apply_retention()
        except (OSError, RuntimeError) as exc:
            # torch.save's zip writer turns a failed write (disk full) into a RuntimeError
            # whose context is the OSError that says what really happened.
            cause = _os_error_in(exc)
            if cause is None:
                raise
            raise CheckpointError(f"cannot write checkpoint step {step} to {target}: {cause.strerror or cause}") from exc
        if self.observer is not None:
            self.observer.saved(SaveReport(step, "file", time.perf_counter() - started, path.stat().st_size))

    def prepare(self, state: dict[str, Any]) -> None:
        """Nothing to get ready: each save writes a new file."""

    def restore(self, device: Any = None) -> Restored | None:
        """Newest committed step that *every* rank loads cleanly; older steps on any failure. With
        ``device``, the state's tensors come back there (``torch.load``'s ``map_location``)."""
        started = time.perf_counter()
        for step in self._agreed_candidates():
            payload = self._try_load(step)
            if collectives.all_ok(payload is not None):
                assert payload is not None
                self._discard_abandoned(after=step)
                rng.apply(payload["rng"])
                if self.observer is not None:
                    self.observer.restored(RestoreReport(step, "file", time.perf_counter() - started))
                state = payload["state"] if device is None else map_tensors(payload["state"], lambda t: t.to(device))
                return Restored(step=step, state=state, source=str(step_dir(self.directory, step)))
        self._discard_abandoned(after=-1)
        return None

    def _discard_abandoned(self, *, after: int) -> None:
        """Delete step folders newer than the one we resume from (rank 0 only).

        They belong to the timeline that just failed: torn (some ranks' files
        missing) or unreadable. Left in place, the resumed run's rank files
        would mix with the old run's in the same folder and could look committed.
        Folders written for another world size are left alone: they are not ours.
        """
        if self.rank != 0 or not self.directory.is_dir():
            return
        for entry in sorted(self.directory.iterdir()):
            match = _STEP_DIR.match(entry.name)
            if not match or int(match.group(1)) <= after:
                continue
            world_size = _manifest_world_size(entry)
            if world_size is None or world_size == self.world_size:
                print(f"unbroken: discarding {entry.name}: newer than the resumed step and not restorable", flush=True)
                shutil.rmtree(entry, ignore_errors=True)

    def _try_load(self, step: int) -> dict[str, Any] | None:
        path = rank_file(self.directory, step, self.rank)
        try:
            _check_crc32(path)
            payload = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as exc:  # noqa: BLE001 - any unreadable file means: try the older step
            print(f"unbroken: checkpoint {path} unreadable ({type(exc).__name__}: {exc}); trying an older step", flush=True)
            return None
        if not isinstance(payload, dict) or payload.get("step") != step or "state" not in payload:
            print(f"unbroken: checkpoint {path} is not a step-{step} checkpoint; trying an older step", flush=True)
            return None
        return payload

    def _agreed_candidates(self) -> list[int]:
        """Rank 0's list of committed steps, so every rank walks the same candidates."""
        return collectives.from_rank0(lambda: committed_steps(self.directory, self.world_size))

    def _apply_retention(self) -> None:
        """Keep the newest ``keep`` committed steps, and the newest committed step the replicas agreed on (where they
        are watched: with checks rarer than saves, the steps saved since are unverified, and a disagreement rolls
        back to that one); drop anything else older than the oldest kept.

        Runs on rank 0 only. Only steps *older* than a committed step are deleted,
        so an in-progress newer step (other ranks still writing) is never touched.
        """
        committed = committed_steps(self.directory, self.world_size)
        if len(committed) <= self.keep:
            return
        oldest_kept = committed[self.keep - 1]
        agreed = self.agreed_step
        rollback_point = next((s for s in committed if agreed is not None and s <= agreed), None)
        for entry in self.directory.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match and int(match.group(1)) < oldest_kept and int(match.group(1)) != rollback_point:
                shutil.rmtree(entry, ignore_errors=True)


def _os_error_in(exc: BaseException) -> OSError | None:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _manifest_world_size(folder: Path) -> int | None:
    try:
        return int(json.loads((folder / "manifest.json").read_text())["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _check_crc32(path: Path) -> None:
    """Raise if a record of the torch.save zip archive fails its CRC-32.

    ``torch.load`` does not check them, so a flipped byte inside tensor data
    would load silently as a wrong value instead of falling back a step.
    Records written with CRCs turned off (``torch.serialization.set_crc32_options``) store 0: skipped.
    """
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if info.CRC == 0:
                continue
            with archive.open(info) as record:  # raises BadZipFile at the end on a CRC mismatch
                while record.read(1 << 20):
                    pass
