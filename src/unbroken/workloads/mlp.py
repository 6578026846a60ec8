"""A small, fully deterministic DDP workload that resumes exactly.

An MLP (with dropout, so RNG state matters) learns a fixed random "teacher"
network on a synthetic dataset. Every source of randomness is seeded and the
data order is a pure function of (seed, epoch), so two runs — or one run that
was killed and resumed from a checkpoint — end with bit-identical parameters.

Runs under ``unbroken job start`` and under plain ``torchrun``::

    torchrun --nproc-per-node 2 -m unbroken.workloads.mlp --steps 100
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import unbroken
from unbroken.workloads.script import state_digest

log = logging.getLogger("unbroken.workloads.mlp")

FEATURES = 32
CLASSES = 8


class TeacherDataset:
    """``size`` inputs labelled by a frozen random network: learnable, deterministic."""

    def __init__(self, size: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(size, FEATURES, generator=gen)
        teacher = torch.randn(FEATURES, CLASSES, generator=gen)
        self.labels = (self.inputs @ teacher).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.labels)


class ResumableSampler:
    """Per-rank batches of a per-epoch shuffle; its position is part of the checkpoint."""

    def __init__(self, size: int, batch_size: int, rank: int, world_size: int, seed: int) -> None:
        self.size, self.batch_size, self.rank, self.world_size, self.seed = size, batch_size, rank, world_size, seed
        self.epoch = 0
        self.batch_in_epoch = 0

    @property
    def batches_per_epoch(self) -> int:
        return self.size // (self.batch_size * self.world_size)

    def next_indices(self) -> torch.Tensor:
        if self.batch_in_epoch == self.batches_per_epoch:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        global_batch = self.batch_size * self.world_size
        start = self.batch_in_epoch * global_batch + self.rank * self.batch_size
        self.batch_in_epoch += 1
        return order[start : start + self.batch_size]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batch_in_epoch = state["epoch"], state["batch_in_epoch"]


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(FEATURES, 128), nn.ReLU(), nn.Dropout(0.1),
        nn.Linear(128, 128), nn.ReLU(), nn.Dropout(0.1),
        nn.Linear(128, CLASSES),
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps in total")
    parser.add_argument("--checkpoint-every", type=int, default=20, help="steps between checkpoints")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--step-time", type=float, default=0.0,
                        help="extra seconds per step, standing in for a bigger model's compute")
    parser.add_argument("--compute-matmuls", type=int, default=0,
                        help="256x256 matmuls each rank runs per step, in its 'compute' section: a fixed amount of CPU work "
                             "that a slowed node really takes longer over (a --step-time sleep is wall-clock and is not)")
    parser.add_argument("--output", help="rank 0 writes the final parameters here (torch.save); a path with '{rank}' in it: "
                                         "every rank writes its own (replicas that should be equal)")
    parser.add_argument("--progress-log", help="rank 0 appends '<step> <unix time> <pid> <attempt>' per step here: the step timeline "
                                               "benchmarks read under any launcher (benchmarks/goodput.py)")
    parser.add_argument("--crash-at-step", type=int, default=None,
                        help="fault injection: --crash-rank exits with code 3 when it reaches this step")
    parser.add_argument("--crash-rank", type=int, default=0)
    parser.add_argument("--watch-replicas", type=int, default=0, metavar="N",
                        help="compare the replicas' model and optimizer every N steps (ctx.watch_replicas; 0: never)")
    parser.add_argument("--state-mb", type=float, default=0.0,
                        help="extra MB of per-rank state in every checkpoint, standing in for a bigger model "
                             "(benchmarks use it to make save and restore cost visible)")
    return parser.parse_args(argv)


_COMPUTE = torch.ones(256, 256) / 256


def simulated_compute(matmuls: int) -> None:
    """A fixed amount of CPU work (the same on every rank and step): stands in for a model's compute."""
    x = _COMPUTE
    for _ in range(matmuls):
        x = x @ _COMPUTE


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # deterministic CPU kernels; 2 cores are shared by all ranks anyway
    ctx = unbroken.init()
    # The restart point: with resilience.in_process_restart, a rank whose peer failed re-enters
    # train() in the next attempt's process group instead of exiting (elsewhere it just calls it).
    return ctx.run(lambda ctx: train(ctx, args))


def train(ctx: unbroken.Context, args: argparse.Namespace) -> int:
    """Build, restore, train: everything that depends on the process group, so it runs again after a rejoin."""
    model = build_model(args.seed)
    # One gradient bucket per parameter, fixed from the first step. By default DDP
    # starts with all parameters in one bucket and re-buckets after the first
    # step of *every process*, so a resumed run's first step would all-reduce a
    # differently laid-out buffer; with more than two ranks, gloo's ring then sums
    # some elements in another order and the run stops being bit-identical.
    ddp = DistributedDataParallel(model, bucket_cap_mb_list=[1e-6]) if ctx.world_size > 1 else model  # type: ignore[list-item]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = TeacherDataset(size=16384, seed=args.seed + 1)
    sampler = ResumableSampler(len(data), args.batch_size, ctx.rank, ctx.world_size, seed=args.seed + 2)

    ballast = torch.randn(int(args.state_mb * 2**20) // 4, generator=torch.Generator().manual_seed(ctx.rank))

    # DDP keeps these the same on every rank: a rank replacing a failed peer in an in-process
    # restart can take them from a survivor's memory (the ballast is per rank: not offered)
    ctx.keep_live(lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "sampler": sampler.state_dict()})
    if args.watch_replicas:
        ctx.watch_replicas(lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, every_steps=args.watch_replicas)
    step = 0
    restore_started = time.monotonic()
    restored = ctx.checkpoint.restore()
    if restored is not None:
        model.load_state_dict(restored.state["model"])
        optimizer.load_state_dict(restored.state["optimizer"])
        sampler.load_state_dict(restored.state["sampler"])
        if not torch.equal(restored.state.get("ballast", ballast), ballast):
            raise RuntimeError("restored --state-mb ballast differs from what was saved")
        step = restored.step
        log.info(f"rank {ctx.rank}: resumed at step {step} from {restored.source} in {time.monotonic() - restore_started:.3f} s",
                 extra={"step": step, "source": restored.source})

    progress_log = open(args.progress_log, "a") if args.progress_log and ctx.rank == 0 else None  # noqa: SIM115 - open for the run
    loss_fn = nn.CrossEntropyLoss()
    loss: torch.Tensor | None = None  # stays None when resumed from the final step
    first_loss = None
    first_step_of_process: int | None = None
    while step < args.steps:
        started = time.monotonic()
        # Sections: the agent scores each rank's own work against its peers' to find a straggler node.
        # backward waits on peers (DDP all-reduces the gradients inside it): reported, not scored.
        with ctx.section("data"):
            indices = sampler.next_indices()
        with ctx.section("forward"):
            loss = loss_fn(ddp(data.inputs[indices]), data.labels[indices])
        if args.compute_matmuls:
            with ctx.section("compute"):
                simulated_compute(args.compute_matmuls)
        with ctx.section("backward", waits_on_peers=True):
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        with ctx.section("optimizer"):
            optimizer.step()
        step += 1
        first_loss = first_loss if first_loss is not None else loss.item()
        if args.crash_at_step is not None and step == args.crash_at_step and ctx.rank == args.crash_rank:
            log.error(f"rank {ctx.rank}: injected crash at step {step}", extra={"step": step})
            sys.stdout.flush()
            os._exit(3)
        remaining = args.step_time - (time.monotonic() - started)
        if remaining > 0:
            time.sleep(remaining)  # simulated compute, not synchronisation
        ctx.progress(step, loss=loss.item())
        if progress_log is not None:
            progress_log.write(f"{step} {time.time():.3f} {os.getpid()} {ctx.attempt}\n")
            progress_log.flush()
        if first_step_of_process is None:
            first_step_of_process = step
            # Wall-clock mark of this process's first step: benchmarks read it to time
            # recovery under plain torchrun, where there is no agent to report to.
            log.info(f"rank {ctx.rank}: first step {step} at {time.time():.3f}", extra={"step": step})
        if step % args.checkpoint_every == 0 or step == args.steps:
            state: dict[str, Any] = {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(), "sampler": sampler.state_dict(),
            }
            if args.state_mb:
                state["ballast"] = ballast
            ctx.checkpoint.save(step, state)
        if ctx.rank == 0 and (step % 50 == 0 or step == args.steps):
            log.info(f"step {step} loss {loss.item():.4f}", extra={"step": step, "loss": round(loss.item(), 6)})

    if ctx.rank == 0:
        final = f"{loss.item():.4f}" if loss is not None else "- (resumed at the end)"
        log.info(f"done: {step} steps, first loss {first_loss}, final loss {final}, params sha256 {state_digest(model.state_dict())}",
                 extra={"step": step})
        if args.output and "{rank}" not in args.output:
            torch.save(model.state_dict(), args.output)
    if args.output and "{rank}" in args.output:
        torch.save(model.state_dict(), args.output.replace("{rank}", str(ctx.rank)))
    ctx.finished()  # judges the last step's replica check, which needs the process group
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
