"""A warm spare: a torchrun that has imported torch and started its ranks' forkserver, waiting for a job.

Most of a restart's startup used to be Python importing torch: once in each node's
torchrun, then again in every rank (``benchmarks/recovery.py``: 6.3-7.0 s of a
7-8 s recovery was startup). A spare does that work before the fault, at no one's
expense: the agent starts it once the job is training, and it

1. starts a ``multiprocessing`` forkserver that imports torch, torch.distributed,
   DDP and ``unbroken.train`` (plus the job's ``resilience.warm_imports``), then
2. imports torchrun itself, and waits on stdin for an identity: one JSON line with
   torchrun's arguments, the job's environment, the working folder and the log file.

Given one, it is that worker's torchrun, with one difference: its ranks are not
``python script.py`` processes but forks of the warm forkserver (torchrun's own
function entrypoint with ``start_method="forkserver"``), which run the script
with ``runpy``, so a script needs no change. Its rendezvous, monitoring, log
files, error files and exit codes are torchrun's, so the agent watches and
stops it as it does a cold torchrun. A spare released unused (stdin closed)
exits 0.

Started by the agent (``SPARE_ARGV``), never by hand.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from unbroken.plumbing.trampoline import TRAMPOLINE
from unbroken.supervision import rank_entry, standby_rank

PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch.distributed.elastic.multiprocessing", "torch._dynamo",
           "unbroken.train")
"""What every rank of every job imports; the job's ``warm_imports`` come on top. ``torch._dynamo``
because building DDP (and FSDP) imports it, with sympy and inductor: 0.8 s a rank here, 1.8 s
with four ranks on two cores, as long as importing torch itself."""
WARM_IMPORTS = "UNBROKEN_WARM_IMPORTS"
"""Comma-separated modules the job asks its spares to import too."""
SPARE_ARGV = ("-c", "import sys; from unbroken.supervision.warm_spare import main; sys.exit(main())")
"""Python's arguments for a spare. Not ``-m``: the ranks' entrypoint must pickle as
``unbroken.supervision.warm_spare.run_rank``, not as ``__main__.run_rank``."""
READY_MARK = "warm spare ready"
"""Printed (to the spare's log) once torch is imported everywhere. The agent hands out a spare ready
or not (a half-warm one is still ahead of a cold start); tests and benchmarks wait for the mark."""
READY_FILE = "UNBROKEN_SPARE_READY_FILE"
"""Where a spare also says it is ready, if set: a file created empty (a launcher that must know, kubernetes/pod_launcher/member.py,
looks for it; its output goes to the pod's log, which the launcher does not read)."""


@dataclass(frozen=True)
class Identity:
    """What turns a spare into one worker's torchrun."""

    torchrun_args: list[str]
    env: dict[str, str]
    """The job's part of the environment (its own ``env`` and the launch variables), applied to torchrun and every rank."""
    working_dir: str
    log: str
    """The worker's ``torchrun.log``: the spare's stdout and stderr go there from now on."""

    def to_line(self) -> bytes:
        return (json.dumps({"torchrun_args": self.torchrun_args, "env": self.env, "working_dir": self.working_dir,
                            "log": self.log}) + "\n").encode()

    @classmethod
    def from_line(cls, line: str) -> "Identity":
        data = json.loads(line)
        return cls(list(data["torchrun_args"]), dict(data["env"]), str(data["working_dir"]), str(data["log"]))


def main() -> int:
    import multiprocessing
    import multiprocessing.forkserver

    started = time.monotonic()
    extra = [m for m in os.environ.get(WARM_IMPORTS, "").split(",") if m]
    multiprocessing.set_forkserver_preload([*PRELOAD, *extra])
    multiprocessing.forkserver.ensure_running()
    import torch.distributed.run  # noqa: F401 - the import is the point: torchrun's own startup, done now

    standbys = None
    if count := standby_rank.wanted(os.environ):
        folder = Path(tempfile.mkdtemp(prefix="unbroken-standby-"))
        standbys = standby_rank.Standbys.start(folder, count, TRAMPOLINE, [*PRELOAD, *extra])
    try:
        return _serve(started, standbys)
    finally:
        if standbys is not None:
            standbys.close()
            shutil.rmtree(standbys.directory, ignore_errors=True)


def _serve(started: float, standbys: standby_rank.Standbys | None) -> int:
    # The forkserver imports in parallel with us; a spare is ready when both are done. A fork
    # request waits for the preload, so connecting once proves it.
    _wait_for_forkserver()
    print(f"{READY_MARK} (pid {os.getpid()}, {time.monotonic() - started:.1f} s)", flush=True)
    if ready_file := os.environ.get(READY_FILE):
        Path(ready_file).touch()

    line = sys.stdin.readline()
    if not line.strip():
        return 0  # released unused
    identity = Identity.from_line(line)
    log = os.open(identity.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.chdir(identity.working_dir)
    os.environ.update(identity.env)
    print(f"unbroken: this torchrun is a warm spare (pid {os.getpid()}), warmed {time.monotonic() - started:.1f} s ago",
          flush=True)
    if standbys is not None:
        standbys.end_unclaimed_after(standby_rank.CLAIM_WINDOW_S)
        identity = Identity(identity.torchrun_args, {**identity.env, standby_rank.DIRECTORY: str(standbys.directory)},
                            identity.working_dir, identity.log)
    return _torchrun(identity)


def _wait_for_forkserver() -> None:
    """Start and join one trivial process through the forkserver: it returns once the preload is done."""
    import multiprocessing

    process = multiprocessing.get_context("forkserver").Process(target=_nothing)
    process.start()
    process.join()


def _nothing() -> None:
    return None


def _torchrun(identity: Identity) -> int:
    from torch.distributed import run as torch_run
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher.api import elastic_launch

    @record
    def launch() -> None:
        args = torch_run.parse_args(identity.torchrun_args)
        if args.master_port is None:
            args.master_port = 29500  # as torchrun's run() when none is given
        config, _, command = torch_run.config_from_args(args)
        config.start_method = "forkserver"
        elastic_launch(config=config, entrypoint=run_rank)(json.dumps(identity.env), identity.working_dir, *command)

    launch()
    return 0


def run_rank(env_json: str, working_dir: str, *command: str) -> None:
    """One rank, in a fork of the warm forkserver: become the job's process, then run its script, or hand it to a
    standby rank that has started CUDA already (supervision/standby_rank.py) and stand in for it.

    ``command`` is what torchrun would have exec'ed after ``python``: ``-u script.py args``
    or ``-u -m module args``.
    """
    os.environ.update(json.loads(env_json))
    handed = standby_rank.hand_over(working_dir, list(command))
    if handed is not None:
        standby_rank.end_as(standby_rank.wait_for(handed))
        return
    rank_entry.run_as_rank(working_dir, list(command))
