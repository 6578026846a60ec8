"""Becoming one rank of a job in a process that already exists: a fork of a warm spare's forkserver, or a standby rank.

torchrun execs ``python script.py`` for a cold rank; a warm rank is a process that
imported torch before it knew which job it would run, so it takes the job's
environment, registers which rank it is (rank/registry.py: its own environment
cannot say), and runs the script as ``__main__`` with ``runpy``. A script needs no
change for it.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from unbroken.rank import registry as rank_registry


def run_as_rank(working_dir: str, command: list[str]) -> None:
    """Run ``command`` (what torchrun would have exec'ed after ``python``: ``-u script.py args`` or ``-u -m module
    args``) as this process's rank, in the environment already applied; its end is recorded in the rank registry."""
    registry = Path(os.environ[rank_registry.REGISTRY_DIR]) if os.environ.get(rank_registry.REGISTRY_DIR) else None
    if registry is not None:
        identity = rank_registry.RankIdentity(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]))
        rank_registry.register(registry, os.getpid(), identity)
    os.chdir(working_dir)
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        import torch

        torch.set_num_threads(int(threads))  # the forkserver's torch read it at import; the job may differ
    code = 1  # an exception, unless the script returns or exits
    try:
        run_script(list(command[1:] if command and command[0] == "-u" else command))
        code = 0
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
        raise
    finally:
        if registry is not None:
            rank_registry.record_exit(registry, os.getpid(), code)


def run_script(args: list[str]) -> None:
    """Run ``script.py args`` or ``-m module args`` as ``__main__``, with its own argv and folder on the path."""
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path.insert(0, str(Path(args[0]).resolve().parent))
        runpy.run_path(args[0], run_name="__main__")
