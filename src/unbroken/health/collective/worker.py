"""One rank of the sweep: ``python -m unbroken.health.collective.worker --rank R --world N --init tcp://H:P``.

Reads its plan (JSON) on stdin. Rank 0 prints the report as one marked JSON
line. Each size is timed like nccl-tests: warm-up iterations, then ``iters``
back to back, time per iteration averaged over the ranks; #wrong counts
elements that differ from the exact expected value after one checked call.
When the whole group is below the floor (after the retries), every pair of
nodes is timed on its own at the largest size: a slow link shows in exactly
the pairs that include its node.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

RESULT_MARK = "@@unbroken-collective@@ "


def _ops(dist: Any) -> dict[str, Any]:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return {"all_reduce": dist.all_reduce, "all_gather": gather, "reduce_scatter": dist.reduce_scatter_tensor}


class Bench:
    def __init__(self, torch: Any, dist: Any, device: str) -> None:
        self.torch, self.dist, self.device = torch, dist, device
        self.ops = _ops(dist)

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize()

    def _calls(self, op: str, count: int, group: Any) -> tuple[Any, Any, Any]:
        """(out-of-place call, in-place call, check) for ``count`` elements of the operation."""
        torch, dist = self.torch, self.dist
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        chunk = count // n
        full = torch.empty(count, device=self.device, dtype=torch.float32)
        part = torch.empty(chunk, device=self.device, dtype=torch.float32)
        fn = self.ops[op]
        if op == "all_reduce":
            src = torch.full((count,), float(rank + 1), device=self.device)
            out_call = lambda: (full.copy_(src), fn(full, group=group))  # noqa: E731
            in_call = lambda: fn(full, group=group)  # noqa: E731

            def check() -> int:
                full.fill_(rank + 1)
                fn(full, group=group)
                return int((full != n * (n + 1) / 2).sum())
        elif op == "all_gather":
            part.fill_(rank + 1)
            mine = full.narrow(0, rank * chunk, chunk)
            out_call = lambda: fn(full, part, group=group)  # noqa: E731
            in_call = lambda: fn(full, mine, group=group)  # noqa: E731

            def check() -> int:
                fn(full, part, group=group)
                expected = torch.arange(1, n + 1, device=self.device, dtype=torch.float32).repeat_interleave(chunk)
                return int((full != expected).sum())
        else:
            full.fill_(rank + 1)
            mine = full.narrow(0, rank * chunk, chunk)
            out_call = lambda: fn(part, full, group=group)  # noqa: E731
            in_call = lambda: fn(mine, full, group=group)  # noqa: E731

            def check() -> int:
                full.fill_(rank + 1)
                fn(part, full, group=group)
                return int((part != n * (n + 1) / 2).sum())
        return out_call, in_call, check

    def time_us(self, call: Any, iters: int, warmup: int, group: Any) -> tuple[float, float]:
        """(mean, best) microseconds per iteration, each the average over the group's ranks.

        The table reports the mean, as nccl-tests does; the verdict uses the best
        iteration, because a slow link slows every iteration while a busy CPU
        (ranks sharing cores with other work) slows only some."""
        for _ in range(warmup):
            call()
        self.sync()
        self.dist.barrier(group=group)
        laps = []
        for _ in range(iters):
            start = time.perf_counter()
            call()
            self.sync()
            laps.append(time.perf_counter() - start)
        mine = [sum(laps) / len(laps) * 1e6, min(laps) * 1e6]
        total = self.torch.tensor(mine, dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(total, group=group)
        n = self.dist.get_world_size(group)
        return float(total[0].item()) / n, float(total[1].item()) / n

    def row(self, op: str, size: int, iters: int, warmup: int, group: Any = None) -> dict[str, Any]:
        n = self.dist.get_world_size(group)
        count = max(n, size // 4 // n * n)  # whole elements per rank, as the sweep's sizes are
        size = count * 4
        out_call, in_call, check = self._calls(op, count, group)
        out_us, out_best = self.time_us(out_call, iters, warmup, group)
        in_us, in_best = self.time_us(in_call, iters, warmup, group)
        wrong = check()
        return {"size": size, "count": count, "dtype": "float", "op": op, "out_time_us": out_us, "out_wrong": wrong,
                "in_time_us": in_us, "in_wrong": wrong, "ranks": self.dist.get_world_size(group),
                "out_best_us": out_best, "in_best_us": in_best}


def _largest_busbw(rows: list[dict[str, Any]]) -> float:
    from unbroken.health.collective.sweep import Row

    biggest = max((r for r in rows if r["op"] == "all_reduce"), key=lambda r: r["size"])
    return Row(**biggest).best_busbw


def run(rank: int, world: int, init: str, plan: dict[str, Any]) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)
    backend = plan.get("backend", "gloo")
    device = f"cuda:{plan.get('local_rank', 0)}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=float(plan.get("timeout_s", 120))))
    bench = Bench(torch, dist, device)
    iters, warmup = int(plan.get("iters", 5)), int(plan.get("warmup", 1))
    floor = plan.get("floor") if world > 1 else None  # one rank has no link: its busbw is 0 by definition
    runs: list[dict[str, Any]] = []
    for _ in range(int(plan.get("repeat", 1))):
        attempts = []
        for _ in range(int(plan.get("retries", 0)) + 1):
            rows = [bench.row(op, size, iters, warmup) for op in plan["ops"] for size in plan["sizes"]]
            busbw = _largest_busbw(rows) if "all_reduce" in plan["ops"] else None
            attempts.append({"rows": rows, "busbw": busbw})
            if floor is None or busbw is None or busbw >= floor:
                break
        runs.append({"attempts": attempts})
    pairs: list[dict[str, Any]] = []
    node_ranks: dict[str, list[int]] = plan["node_ranks"]
    below = floor is not None and any(a["busbw"] is not None and a["busbw"] < floor for a in runs[-1]["attempts"][-1:])
    if below and len(node_ranks) >= 2:
        biggest = max(plan["sizes"])
        for a, b in itertools.combinations(sorted(node_ranks), 2):
            members = sorted(node_ranks[a] + node_ranks[b])
            group = dist.new_group(members)  # every rank creates every group, in the same order
            if rank in members:
                # one warm-up and one timed call per column: a slow pair is 10x slow, not 10 % slow
                row = bench.row("all_reduce", biggest, 1, 1, group)
                if dist.get_rank(group) == 0:
                    pairs.append({"nodes": [a, b], "row": row})
    gathered: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object(pairs, gathered if rank == 0 else None, dst=0)
    dist.destroy_process_group()
    if rank != 0:
        return None
    return {"runs": runs, "pairs": [p for part in gathered for p in (part or [])], "world": world}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unbroken-collective-worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--init", required=True, help="tcp://HOST:PORT of rank 0")
    args = parser.parse_args(argv)
    plan = json.loads(sys.stdin.read())
    report = run(args.rank, args.world, args.init, plan)
    if report is not None:
        print(RESULT_MARK + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
