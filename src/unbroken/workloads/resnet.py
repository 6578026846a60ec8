"""ResNet DDP training on an ImageFolder dataset: the vision workload.

ResNet-50 by default (``resnet_model``), DistributedDataParallel, channels-last memory
layout, bf16 autocast on GPU, SGD with Nesterov momentum, label smoothing, linear warm-up
then cosine decay, checkpointed through ``ctx.checkpoint`` (the job's tiers or files).

Data: ``--data`` is an ImageFolder (``<class>/<image>.JPEG``): ImageNet's train/ as
shipped, or its val/ after ``unbroken data imagenet-val``. The position in the data (global
batches consumed) is saved with the weights and every augmentation draw is seeded by
(seed, epoch, sample), so a resumed run sees the very batches an uninterrupted one would.

    unbroken data imagenet-val ~/imagenet/val --solutions ~/imagenet/LOC_val_solution.csv
    torchrun --nproc-per-node 8 -m unbroken.workloads.resnet --data ~/imagenet/val --steps 5000 --workers 8
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import unbroken
from unbroken.errors import UnbrokenError
from unbroken.workloads.image_folder import ImageFolder
from unbroken.workloads.resnet_model import DEPTHS, ResNet
from unbroken.workloads.schedule import learning_rate
from unbroken.workloads.script import add_common_arguments, exit_rank, finish, pace, run, state_digest

log = logging.getLogger("unbroken.workloads.resnet")


class EpochBatches:
    """This rank's share of global batches from a per-epoch shuffle, starting at global batch
    ``start``. A sample is yielded as ``epoch * len(dataset) + index`` so that the dataset (in
    any worker process) knows the epoch its augmentation is seeded with."""

    def __init__(self, size: int, batch: int, rank: int, world: int, seed: int, start: int) -> None:
        self.size, self.batch, self.rank, self.world, self.seed, self.start = size, batch, rank, world, seed, start
        self.per_epoch = size // (batch * world)

    def __iter__(self) -> Iterator[list[int]]:
        number = self.start
        while True:
            epoch, within = divmod(number, self.per_epoch)
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + epoch))
            first = (within * self.world + self.rank) * self.batch
            yield [epoch * self.size + int(i) for i in order[first : first + self.batch]]
            number += 1


class EpochSamples(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """``ImageFolder`` addressed by ``epoch * len + index`` (see ``EpochBatches``)."""

    def __init__(self, images: ImageFolder) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, item: int) -> tuple[torch.Tensor, int]:
        self.images.epoch, index = divmod(item, len(self.images))
        return self.images[index]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="an ImageFolder: one folder of images per class")
    parser.add_argument("--arch", choices=sorted(DEPTHS), default="resnet50")
    parser.add_argument("--width", type=int, default=64, help="channels of the first stage (64: the paper's; tests use 8)")
    parser.add_argument("--image-size", type=int, default=224, help="training crop, pixels")
    add_common_arguments(parser, steps=1000, warmup=50, checkpoint_every=100)
    parser.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default 0.1 x global batch / 256)")
    parser.add_argument("--workers", type=int, default=0, help="data loader processes per rank (0: load in the training process)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    return run(_train, parse_args(argv), log)


def _train(args: argparse.Namespace, ctx: unbroken.Context) -> int:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", ctx.local_rank) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(1)
    images = ImageFolder(args.data, args.image_size, train=True, seed=args.seed)
    torch.manual_seed(args.seed)
    model = ResNet(args.arch, classes=len(images.classes), width=args.width).to(device)
    model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # nn.Module.to takes it; the stubs do not say so
    ddp: torch.nn.Module = model
    if ctx.world_size > 1:
        # On the CPU (gloo), one bucket per parameter from the first step, as in the MLP workload:
        # DDP's re-bucketing after step one would change the summation order of a resumed run.
        # On GPUs NCCL's sums are not bit-exact anyway; its default buckets are faster.
        if cuda:
            ddp = DistributedDataParallel(model, device_ids=[device.index])
        else:
            ddp = DistributedDataParallel(model, bucket_cap_mb_list=[1e-6])  # type: ignore[list-item]
    global_batch = args.batch_size * ctx.world_size
    peak = args.lr if args.lr is not None else 0.1 * global_batch / 256
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]  # BatchNorm and biases: as in the usual recipe
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": 1e-4}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=peak, momentum=0.9, nesterov=True)

    step = 0
    # on a GPU: straight onto it through pinned memory (a host restore would be copied there pageable)
    restored = ctx.checkpoint.restore(device=device if device.type == "cuda" else None)
    if restored is not None:
        model.load_state_dict(restored.state["model"])
        optimizer.load_state_dict(restored.state["optimizer"])
        step = restored.step
        log.info(f"rank {ctx.rank}: resumed at step {step} from {restored.source}", extra={"step": step, "source": restored.source})
    batches = EpochBatches(len(images), args.batch_size, ctx.rank, ctx.world_size, args.seed, start=step)
    if batches.per_epoch < 1:
        raise UnbrokenError(f"{args.data}: {len(images)} images are fewer than one global batch ({global_batch})")
    loader = torch.utils.data.DataLoader(EpochSamples(images), batch_sampler=batches, num_workers=args.workers,
                                         pin_memory=cuda, persistent_workers=args.workers > 0)
    if ctx.rank == 0:
        log.info(f"{args.arch} width {args.width}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, "
                 f"{len(images)} images in {len(images.classes)} classes, global batch {global_batch}")
    loss = torch.zeros(())
    started = time.perf_counter()
    for inputs, labels in loader:
        if step >= args.steps:
            break
        lr = learning_rate(step, peak=peak, warmup=args.warmup, total=args.steps, floor=0.0)
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs = inputs.to(device, non_blocking=True, memory_format=torch.channels_last)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = F.cross_entropy(ddp(inputs), labels, label_smoothing=0.1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        pace(started, args.step_time)
        images_per_s = global_batch / (time.perf_counter() - started)
        started = time.perf_counter()
        ctx.progress(step, loss=loss.item(), images_per_s=images_per_s)
        if ctx.rank == 0 and (step % args.log_every == 0 or step == args.steps):
            log.info(f"step {step} loss {loss.item():.4f} lr {lr:.3f} {images_per_s:,.0f} images/s",
                     extra={"step": step, "loss": loss.item(), "images_per_s": round(images_per_s, 1)})
        if step % args.checkpoint_every == 0 or step == args.steps:
            state: dict[str, Any] = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            ctx.checkpoint.save(step, state)

    # parameters and buffers (BatchNorm's running statistics included): replicated, so rank 0's alone
    finish(ctx, step, state_digest(model.state_dict()) if ctx.rank == 0 else None, args.output, log, loss=loss.item())
    return 0



if __name__ == "__main__":
    exit_rank(main(sys.argv[1:]))
