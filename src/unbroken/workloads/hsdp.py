"""A small deterministic HSDP job (FSDP2 on a 2-D mesh) whose replicas watch each other: the silent data corruption
benchmark's second layout.

The mesh is ``replicate`` x ``shard``: each parameter is sharded across the ``shard`` ranks and the shards are
replicated across the ``replicate`` ranks, so the ranks of one ``replicate`` group hold identical shards and
compare them (``ctx.watch_replicas(..., group=mesh["replicate"].get_group())``); a pure FSDP job, with no replicate
dimension, has nothing to compare. Gloo on CPU (FSDP2 runs on it); no checkpoints: this job measures detection.

    torchrun --nproc-per-node 4 -m unbroken.workloads.hsdp --replicate 2 --steps 200 --watch-replicas 10
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import unbroken


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--replicate", type=int, default=2, help="the mesh's replicate dimension (it must divide the world size)")
    parser.add_argument("--watch-replicas", type=int, default=10, metavar="N", help="compare the replicas every N steps (0: never)")
    parser.add_argument("--step-time", type=float, default=0.0, help="pad each step to this many seconds (simulated compute)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=0.0, help="run this long instead of --steps (a false-positive run)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    args = parse_args(argv)
    ctx = unbroken.init(backend="gloo")
    if ctx.world_size % args.replicate:
        print(f"--replicate {args.replicate} does not divide the world size {ctx.world_size}", file=sys.stderr)
        return 2
    mesh = init_device_mesh("cpu", (args.replicate, ctx.world_size // args.replicate), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(64, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, 8))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if args.watch_replicas:
        ctx.watch_replicas(lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                           every_steps=args.watch_replicas, group=mesh["replicate"].get_group())
    # Each data-parallel rank (a replicate x shard coordinate) sees its own batches, the same in every run.
    data = torch.Generator().manual_seed(100 + ctx.rank)
    teacher = torch.randn(64, 8, generator=torch.Generator().manual_seed(7))
    deadline = time.monotonic() + args.seconds if args.seconds else None
    step = 0
    while not _done(step, args.steps, deadline):
        started = time.monotonic()
        inputs = torch.randn(32, 64, generator=data)
        loss = nn.functional.mse_loss(model(inputs), inputs @ teacher)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        remaining = args.step_time - (time.monotonic() - started)
        if remaining > 0:
            time.sleep(remaining)  # simulated compute, not synchronisation
        ctx.progress(step, loss=loss.item())
    ctx.finished()  # judges the last step's replica check before the process group goes
    if ctx.rank == 0:
        print(f"done: {step} steps, {ctx._replicas.checks if ctx._replicas else 0} checks, final loss {loss.item():.5f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _done(step: int, steps: int, deadline: float | None) -> bool:
    """Whether to stop before the next step: by count, or (``--seconds``) by a clock every rank agrees on: each rank's
    own clock passes the deadline at a different step, and one that stopped alone would leave the others in a
    collective for ever. So every 10 steps the ranks all-reduce whether anyone's has."""
    if deadline is None:
        return step >= steps
    if step % 10:
        return False
    late = torch.tensor([1 if time.monotonic() >= deadline else 0])
    dist.all_reduce(late, op=dist.ReduceOp.MAX)
    return bool(late.item())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
