"""Llama-style pretraining with FSDP2: the LLM workload.

A decoder (``unbroken.workloads.llama``) sharded with ``fully_shard`` block by block,
trained on token shards from ``unbroken data prepare-text``, checkpointed through
``torch.distributed.checkpoint`` on the job's tiers (``sharded_checkpoint``). AdamW with
linear warm-up then cosine decay; bf16 compute with fp32 reductions on GPU.

Exact resumption: the batches are a pure function of (seed, epoch, position), and the
position is saved with the weights, so a resumed run sees the batches an uninterrupted
one would have; with the same world size its losses are bit-identical.

Batch size: ``--global-batch`` sequences per optimizer step, whatever the world size,
made of ``--micro-batch`` sequences per rank per forward pass and as many accumulation
steps as it takes (global = micro x ranks x accumulation, which must divide evenly). A
job resumed on fewer or more ranks keeps the global batch, hence the learning-rate
schedule, and changes only the accumulation.

    unbroken data prepare-text kjv.txt --out data/kjv --vocab-size 4096
    torchrun --nproc-per-node 2 -m unbroken.workloads.llm --data data/kjv --config tiny --steps 100
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import unbroken
from unbroken.data.token_shards import TokenStream
from unbroken.errors import ConfigError
from unbroken.workloads.llama import CONFIGS, Llama, LlamaConfig, init_module
from unbroken.workloads.schedule import learning_rate
from unbroken.workloads.script import add_common_arguments, exit_rank, finish, pace, run, state_digest
from unbroken.workloads.sharded_checkpoint import ShardedCheckpoint

log = logging.getLogger("unbroken.workloads.llm")


class TokenBatches:
    """Global batches of ``seq_len + 1``-token windows in a per-epoch shuffled order.

    The position (epoch, windows used this epoch) is global, not per rank: it is the same
    on every rank and means the same at any world size.
    """

    def __init__(self, stream: TokenStream, seq_len: int, global_batch: int, seed: int) -> None:
        self.stream, self.window, self.global_batch, self.seed = stream, seq_len + 1, global_batch, seed
        self.windows = stream.windows(self.window)
        if self.windows < global_batch:
            raise ConfigError(f"{stream.folder}: {stream.tokens} tokens make {self.windows} windows of {self.window}, "
                              f"fewer than one global batch ({global_batch}); prepare more text or lower --global-batch")
        self.epoch = 0
        self.used = 0
        self._order: tuple[int, torch.Tensor] | None = None

    def next_batch(self) -> list[int]:
        """The window numbers of the next global batch."""
        if self.used + self.global_batch > self.windows:
            self.epoch, self.used = self.epoch + 1, 0
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, torch.randperm(self.windows, generator=torch.Generator().manual_seed(self.seed + self.epoch)))
        chosen = self._order[1][self.used : self.used + self.global_batch].tolist()
        self.used += self.global_batch
        return chosen

    def tokens(self, windows: list[int]) -> torch.Tensor:
        return torch.from_numpy(np.stack([self.stream.window(w, self.window) for w in windows]))

    def position(self) -> tuple[int, int]:
        return self.epoch, self.used

    def seek(self, epoch: int, used: int) -> None:
        self.epoch, self.used = epoch, used


def build(config: LlamaConfig, seed: int, device: torch.device, world_size: int) -> Llama:
    """The model, each block initialized on the CPU under its own seed and sharded right away."""
    with torch.device("meta"):
        model = Llama(config)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = None
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world_size,))
    # bf16 compute, fp32 reductions and master weights on GPU; CPU stays fp32 (bit-exact resume tests run there)
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" else MixedPrecisionPolicy()
    for number, block in enumerate(model.layers):
        block.to_empty(device="cpu")
        init_module(block, seed + 1 + number, depth=config.layers)
        if mesh is not None:
            fully_shard(block, mesh=mesh, mp_policy=mixed)
    for part in (model.tok_embeddings, model.norm, model.output):
        part.to_empty(device="cpu")
    init_module(model, seed, depth=config.layers, skip="layers.")
    if mesh is not None:
        fully_shard(model, mesh=mesh, mp_policy=mixed)
    else:
        model.to(device)
    return model


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="a folder written by unbroken data prepare-text")
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tiny", help="model size")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the config's max)")
    add_common_arguments(parser, steps=200, warmup=20, checkpoint_every=20)
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step, at any world size")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per forward pass")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine's floor, as a fraction of --lr")
    parser.add_argument("--loss-log", type=Path, help="rank 0 appends {step, loss, world_size, attempt} per step here (JSON lines)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    return run(_train, parse_args(argv), log)


def _train(args: argparse.Namespace, ctx: unbroken.Context) -> int:
    device = torch.device("cuda", ctx.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # the cores are shared by every rank; determinism too
    stream = TokenStream(args.data)
    config = CONFIGS[args.config].with_vocab(stream.index.vocab_size)
    seq_len = args.seq_len or config.max_seq_len
    per_pass = args.micro_batch * ctx.world_size
    if args.global_batch % per_pass:
        raise ConfigError(f"--global-batch {args.global_batch} does not divide into --micro-batch {args.micro_batch} x "
                          f"{ctx.world_size} ranks; choose a multiple of {per_pass}")
    accumulation = args.global_batch // per_pass
    model = build(config, args.seed, device, ctx.world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    batches = TokenBatches(stream, seq_len, args.global_batch, args.seed)
    checkpoint = ShardedCheckpoint(ctx)

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def state() -> dict[str, Any]:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optimizer": optimizer_state,
                "progress": torch.tensor([step, *batches.position()], dtype=torch.int64)}

    step = 0
    loaded_state = state()
    loaded = checkpoint.load(loaded_state)
    if loaded is not None:
        set_state_dict(model, optimizer, model_state_dict=loaded_state["model"], optim_state_dict=loaded_state["optimizer"])
        step, epoch, used = (int(v) for v in loaded_state["progress"])
        batches.seek(epoch, used)
        log.info(f"rank {ctx.rank}: resumed at step {step} from {loaded.source} in {loaded.seconds:.3f} s "
                 f"({ctx.world_size} ranks, accumulation {accumulation})", extra={"step": step, "source": loaded.source})
    del loaded_state
    if ctx.rank == 0:
        log.info(f"{args.config}: {config.parameters() / 1e6:.1f} M parameters, {ctx.world_size} ranks, global batch "
                 f"{args.global_batch} = {args.micro_batch} x {ctx.world_size} x {accumulation}, {seq_len} tokens each")

    sharded = ctx.world_size > 1
    loss_log = open(args.loss_log, "a") if args.loss_log is not None and ctx.rank == 0 else None  # noqa: SIM115 - open for the run
    while step < args.steps:
        started = time.perf_counter()
        lr = learning_rate(step, peak=args.lr, warmup=args.warmup, total=args.steps, floor=args.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        windows = batches.next_batch()
        total = torch.zeros((), device=device)
        for micro in range(accumulation):
            first = (micro * ctx.world_size + ctx.rank) * args.micro_batch
            tokens = batches.tokens(windows[first : first + args.micro_batch]).to(device)
            if sharded:
                model.set_requires_gradient_sync(micro == accumulation - 1)  # type: ignore[operator]
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()) / accumulation
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        pace(started, args.step_time)
        if sharded:
            dist.all_reduce(total, op=dist.ReduceOp.AVG if device.type == "cuda" else dist.ReduceOp.SUM)
            if device.type != "cuda":
                total /= ctx.world_size  # gloo has no AVG
        loss_value = total.item()
        tokens_per_s = args.global_batch * seq_len / (time.perf_counter() - started)
        ctx.progress(step, loss=loss_value, tokens_per_s=tokens_per_s)
        if ctx.rank == 0:
            if loss_log is not None:
                loss_log.write(json.dumps({"step": step, "loss": loss_value, "world_size": ctx.world_size, "attempt": ctx.attempt}) + "\n")
                loss_log.flush()  # a killed rank's last steps must be on disk: the tests compare every one
            if step % args.log_every == 0 or step == args.steps:
                log.info(f"step {step} loss {loss_value:.4f} lr {lr:.2e} {tokens_per_s:,.0f} tokens/s",
                         extra={"step": step, "loss": loss_value, "tokens_per_s": round(tokens_per_s, 1)})
        if step % args.checkpoint_every == 0 or step == args.steps:
            checkpoint.save(step, state())

    digest = parameters_digest(model)  # every rank: it gathers
    finish(ctx, step, digest, args.output, log)
    return 0


def parameters_digest(model: torch.nn.Module) -> str:
    """sha256 of the full (unsharded) parameters, gathered to rank 0's CPU: a collective on a
    sharded model, meaningful on rank 0 only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return state_digest(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))


if __name__ == "__main__":
    exit_rank(main(sys.argv[1:]))
