"""The learning-rate schedule the workloads share: linear warm-up, then a cosine down to a floor."""

from __future__ import annotations

import math


def learning_rate(step: int, *, peak: float, warmup: int, total: int, floor: float) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then cosine down to ``floor * peak`` at ``total``.

    A pure function of the step: nothing to checkpoint, and a resumed run (at any world size,
    the global batch being kept) continues on the same curve."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
