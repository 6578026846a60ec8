"""What every shipped training script shares: its common flags, and how it starts and fails."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import unbroken
from unbroken.rank import registry as rank_registry
from unbroken.errors import UnbrokenError


def add_common_arguments(parser: argparse.ArgumentParser, *, steps: int, warmup: int, checkpoint_every: int) -> None:
    parser.add_argument("--steps", type=int, default=steps, help="optimizer steps in total")
    parser.add_argument("--warmup", type=int, default=warmup, help="warm-up steps of the learning rate")
    parser.add_argument("--checkpoint-every", type=int, default=checkpoint_every, help="steps between checkpoints")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--step-time", type=float, default=0.0,
                        help="extra seconds per step, standing in for a bigger model's compute (tests and benchmarks)")
    parser.add_argument("--log-every", type=int, default=10, help="steps between log lines of rank 0")
    parser.add_argument("--output", type=Path, help="rank 0 writes {step, params_sha256, ...} here at the end (JSON)")


def run(train: Callable[[argparse.Namespace, unbroken.Context], int], args: argparse.Namespace, log: logging.Logger) -> int:
    """Join the job and train; a user mistake (bad data folder, batch that does not divide) is one
    clear log line and exit code 2, not a traceback from every rank. Each rank logs how long after its process
    began it joined the job (imports, torch.distributed): a restart's startup, measured where it is spent."""
    ctx = unbroken.init()
    age = process_age()
    log.info(f"rank {ctx.rank}: joined {age:.2f} s after its process began", extra={"process_began": time.time() - age})
    try:
        return train(args, ctx)
    except UnbrokenError as exc:
        log.error(str(exc))
        return 2


def process_age() -> float:
    """Seconds since this process began, to the kernel's tick (10 ms): ``/proc/uptime`` less the process's start
    in ``/proc/self/stat``. Not psutil's create_time, which rests on a boot time rounded to the second."""
    with open("/proc/self/stat") as f:
        after_name = f.read().rsplit(")", 1)[1].split()
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in clock ticks


def exit_rank(code: int) -> NoReturn:
    """End the rank's process with ``code`` now, once what it wrote is flushed.

    Skips the C++ static destructors: with torch 2.13 a gloo FSDP2 rank now and then aborts in
    them ("terminate called without an active exception", a joinable thread of torch's) after a
    run that ended well, which reads as a rank killed by SIGABRT and fails the job at its last
    line. A warm spare's rank is a function that torchrun's elastic agent runs in a forked
    process (supervision/warm_spare.py): the agent counts a rank done only once the function returns
    its value through a queue, so such a rank raises ``SystemExit`` to its runner instead, which
    records the code and ends the process the same way (``os._exit``) once the agent has it. An
    ``os._exit`` here would leave that torchrun waiting for a value that never comes: a job on a
    warm spare never finished (seen on an H100).
    """
    registry = os.environ.get(rank_registry.REGISTRY_DIR)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if registry:
        raise SystemExit(code)
    os._exit(code)


def pace(started: float, step_time: float) -> None:
    """Stretch a step to ``step_time`` seconds: simulated compute, not synchronisation."""
    remaining = step_time - (time.perf_counter() - started)
    if remaining > 0:
        time.sleep(remaining)


def state_digest(state: Mapping[str, Any]) -> str:
    """sha256 of a state dict's tensors in name order: equal digests, bit-identical runs."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        if isinstance(tensor, torch.Tensor):
            digest.update(name.encode())
            digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def finish(ctx: unbroken.Context, step: int, digest: str | None, output: Path | None, log: logging.Logger, **extra: Any) -> None:
    """Rank 0 logs (and with ``output`` writes) the final parameters' digest; every rank leaves the
    process group together and reports the last step (winding down is progress, not a hang)."""
    import torch.distributed as dist

    if ctx.rank == 0 and digest is not None:
        log.info(f"done: {step} steps, params sha256 {digest}", extra={"step": step})
        if output is not None:
            output.write_text(json.dumps({"step": step, "params_sha256": digest, **extra}))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    ctx.checkpoint.close()  # the last save's copy is done before the process ends (see exit_rank)
    ctx.progress(step)
    ctx.finished()
