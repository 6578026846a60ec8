"""Throughput checks: dense matmul and memory copy, compared with the profile's floors.

A sick GPU (thermal or power throttling, a degraded HBM stack, a bad clock)
passes every status query and is simply slow; only measuring shows it. Each
measurement takes the best of several timed repetitions after a warm-up, so a
busy neighbour costs a repetition, not a failed check.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from unbroken.health.context import CheckContext
from unbroken.health.result import FaultAction, Outcome, Status

REPEATS = 5


def _best_seconds(step: Callable[[], None], sync: Callable[[], None], inner: int) -> float:
    step()
    sync()  # warm-up: allocation, kernel selection, page faults
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(inner):
            step()
        sync()
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def _devices(ctx: CheckContext) -> tuple[Any, list[str], Outcome | None]:
    import torch

    if ctx.profile.Accelerator == "cpu":
        return torch, ["cpu"], None
    if not torch.cuda.is_available():
        return torch, [], Outcome(Status.FAIL, f"profile {ctx.instance_type} expects {ctx.profile.GpuCount} GPUs; "
                                  "torch sees no CUDA device", "NoGPU", {}, FaultAction.REPLACE)
    return torch, [f"cuda:{i}" for i in range(torch.cuda.device_count())], None


def matmul(ctx: CheckContext) -> Outcome:
    torch, devices, problem = _devices(ctx)
    if problem:
        return problem
    gpu = devices[0] != "cpu"
    n = int(ctx.params.get("matmul_n", 8192 if gpu else 1024))
    dtype = torch.bfloat16 if gpu else torch.float32
    unit, scale = ("TFLOP/s", 1e12) if gpu else ("GFLOP/s", 1e9)
    per_device: dict[str, float] = {}
    for device in devices:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        out = torch.empty(n, n, device=device, dtype=dtype)
        sync = torch.cuda.synchronize if gpu else (lambda: None)
        seconds = _best_seconds(functools.partial(torch.matmul, a, b, out=out), sync, inner=10 if gpu else 2)
        per_device[device] = round(2 * n**3 / seconds / scale, 2)
    slowest = min(per_device, key=lambda d: per_device[d])
    floor = ctx.profile.MatmulFloor
    metrics = {"n": n, "dtype": str(dtype).removeprefix("torch."), "unit": unit, "per_device": per_device,
               "min": per_device[slowest], "floor": floor}
    if per_device[slowest] < floor:
        return Outcome(Status.FAIL, f"matmul below threshold on {slowest}: expected >= {floor:g} {unit}, "
                       f"measured {per_device[slowest]:g}", "BelowThreshold", metrics, FaultAction.REPLACE)
    return Outcome(Status.PASS, f"matmul {per_device[slowest]:g} {unit} (slowest device; floor {floor:g})", "", metrics,
                   FaultAction.NONE)


def membw(ctx: CheckContext) -> Outcome:
    torch, devices, problem = _devices(ctx)
    if problem:
        return problem
    gpu = devices[0] != "cpu"
    size = int(ctx.params.get("membw_bytes", (1 << 30) if gpu else (64 << 20)))
    per_device: dict[str, float] = {}
    for device in devices:
        src = torch.ones(size // 4, device=device, dtype=torch.float32)
        dst = torch.empty_like(src)
        sync = torch.cuda.synchronize if gpu else (lambda: None)
        seconds = _best_seconds(functools.partial(dst.copy_, src), sync, inner=10 if gpu else 3)
        # A copy reads and writes every byte: 2 x size, as STREAM's Copy counts it.
        per_device[device] = round(2 * size / seconds / 1e9, 2)
    slowest = min(per_device, key=lambda d: per_device[d])
    floor = ctx.profile.MemoryBandwidthFloorGBps
    metrics = {"bytes": size, "unit": "GB/s", "per_device": per_device, "min": per_device[slowest], "floor": floor}
    if per_device[slowest] < floor:
        return Outcome(Status.FAIL, f"memory bandwidth below threshold on {slowest}: expected >= {floor:g} GB/s, "
                       f"measured {per_device[slowest]:g}", "BelowThreshold", metrics, FaultAction.REPLACE)
    return Outcome(Status.PASS, f"memory copy {per_device[slowest]:g} GB/s (slowest device; floor {floor:g})", "", metrics,
                   FaultAction.NONE)
