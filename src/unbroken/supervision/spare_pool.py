"""The agent's warm spares, per job: started while the job trains, handed out when it restarts.

A job opts in with ``resilience.warm_spares: N``; each node it runs on then keeps
N spares (supervision/warm_spare.py) for it. A spare is started only while none of the
node's workers is starting up: warming imports torch on every core of a small
machine, which must not slow the attempt that is starting (or the one a fault
just caused). The first attempt is therefore cold and the next ones are warm. A
spare's environment is the job's at the time it starts; an identity brings the
attempt's own on top. Spares of a job that no longer runs here are released.
"""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from unbroken.plumbing import procs
from unbroken.plumbing import trampoline as plumbing_trampoline
from unbroken.supervision import standby_rank, warm_spare
from unbroken.config.job import JobSpec

log = logging.getLogger("unbroken.supervision.spare_pool")


@dataclass
class Spare:
    job: str
    process: subprocess.Popen[bytes]
    ready_file: Path | None = None
    """Created by the spare once warm (warm_spare.READY_FILE), if it was given one."""

    def alive(self) -> bool:
        return self.process.poll() is None

    def ready(self) -> bool:
        """Warm (torch imported), as far as is known: without a ready file, taken to be."""
        return self.alive() and (self.ready_file is None or self.ready_file.exists())


class SparePool:
    def __init__(self, node: str, log_dir: Path, trampoline: str) -> None:
        self.node = node
        self.log_dir = log_dir
        """Where spares write until they are given an identity (``spares-<job>.log``)."""
        self.trampoline = trampoline
        self._spares: dict[str, list[Spare]] = {}

    def take(self, job: str) -> Spare | None:
        """A live spare of ``job``, now out of the pool, or None (launch cold)."""
        spares = self._spares.get(job, [])
        while spares:
            spare = spares.pop(0)
            if spare.alive():
                return spare
            log.warning("warm spare died before use (exit %s)", spare.process.returncode, extra={"node": self.node, "job": job})
        return None

    def keep(self, wanted: dict[str, tuple[JobSpec, dict[str, str]]], *, may_start: bool) -> None:
        """Hold ``spec.resilience.warm_spares`` spares for each wanted job (with the environment
        to start them in); start missing ones only if ``may_start``; release the others' spares."""
        for job in [j for j in self._spares if j not in wanted]:
            self.release(job)
        for job, (spec, env) in wanted.items():
            spares = [s for s in self._spares.get(job, []) if s.alive()]
            while may_start and len(spares) < spec.resilience.warm_spares:
                spares.append(self._start(spec, env))
            self._spares[job] = spares

    def release(self, job: str) -> None:
        for spare in self._spares.pop(job, []):
            release(spare)

    def close(self) -> None:
        for job in list(self._spares):
            self.release(job)

    def _start(self, spec: JobSpec, env: dict[str, str]) -> Spare:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        extra = {warm_spare.WARM_IMPORTS: ",".join(spec.resilience.warm_imports)} if spec.resilience.warm_imports else {}
        extra[standby_rank.LOCAL_RANKS] = str(spec.procs_per_node)
        with open(self.log_dir / f"spares-{spec.name}.log", "ab") as out:
            spare = start_spare(spec.name, self.trampoline, {**os.environ, **env, **extra}, cwd=spec.working_dir, out=out)
        log.info("warm spare started", extra={"node": self.node, "job": spec.name, "pid": spare.process.pid})
        return spare


def start_spare(job: str, trampoline: str, env: dict[str, str], *, cwd: str | Path | None, out: IO[bytes] | int | None,
                ready_file: Path | None = None) -> Spare:
    """A warm spare (supervision/warm_spare.py) for ``job``, writing to ``out`` (None: our own stdout) until it is given an
    identity; ``ready_file``: the spare's ``warm_spare.READY_FILE`` in ``env``, if set there."""
    process = subprocess.Popen(plumbing_trampoline.command(*warm_spare.SPARE_ARGV, code=trampoline), cwd=cwd, env=env,
                               stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return Spare(job, process, ready_file)


def release(spare: Spare) -> None:
    """Kill ``spare`` and its forkserver: a spare holds no state, so there is nothing to wind down."""
    procs.kill_now(procs.tree(spare.process.pid))
    spare.process.wait()
    if spare.process.stdin is not None:
        spare.process.stdin.close()
