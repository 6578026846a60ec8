"""The known-answer check: deterministic arithmetic on every device, compared with the exact answer.

A GPU with silent data corruption passes every status query and may even be
fast; it computes some results wrong. This check gives each device work whose
right answer is known exactly, independently of the device, the kernel and
the order of the additions:

- matrices of small integers (``|x| <= 8``, fixed seed): every product and
  every partial sum of a 1,024-long dot product is an integer under 2**24,
  so float32 holds each exactly and any summation order gives the same bits.
  The matmul runs in float32, and on a GPU also from bfloat16 inputs (small
  integers are exact in bf16) accumulated in float32 (tensor cores); its row
  sums run in float64 (exact too);
- the reference is the same arithmetic in int64 on the host CPU.

Every element must equal the reference bit for bit, so the expected answer is
the same on every node of every instance type and needs no recorded table or
peer to compare with. A node that disagrees fails with
``SilentDataCorruption`` and is replaced.

Fault injection (``unbroken chaos corrupt``, and tests): a file
``chaos-sdc`` in the node's folder makes this check change one element of
each device's result before it is compared, where a faulty ALU or HBM cell would
have (one element off by one): the stand-in for a GPU that computes wrong numbers, since none can be
made to on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from unbroken.health.context import CheckContext
from unbroken.health.result import FaultAction, Outcome, Status

SILENT_DATA_CORRUPTION = "SilentDataCorruption"
FAULT_FILE = "chaos-sdc"
"""In the node's folder: this node's devices compute wrong numbers (fault injection)."""
SEED = 20261127
N = 1024


@dataclass(frozen=True)
class Case:
    """One exact computation: an ``n`` x ``inner`` by ``inner`` x ``n`` matmul of integers in [-bound, bound] whose every
    result (at most ``inner * bound**2`` in magnitude) is exact in ``dtype``'s output."""

    name: str
    dtype_name: str
    inner: int
    bound: int


CASES = (Case("float32", "float32", 1024, 8), Case("bfloat16", "bfloat16", 256, 1))
"""float32: products to 65,536 (< 2**24). bfloat16 (tensor cores on a GPU): the output is bf16 too, exact to 256."""


def _inputs(torch: Any, n: int, case: Case) -> tuple[Any, Any]:
    generator = torch.Generator().manual_seed(SEED)
    a = torch.randint(-case.bound, case.bound + 1, (n, case.inner), generator=generator, dtype=torch.int64)
    b = torch.randint(-case.bound, case.bound + 1, (case.inner, n), generator=generator, dtype=torch.int64)
    return a, b


def reference(torch: Any, n: int, case: Case) -> tuple[Any, Any]:
    """The exact answer, in int64 on the host: the product and its row sums, which every healthy device must produce."""
    a, b = _inputs(torch, n, case)
    product = a @ b
    return product, product.sum(dim=1)


def on_device(torch: Any, device: str, n: int, case: Case, *, corrupt: bool = False,
              expected: tuple[Any, Any] | None = None) -> str | None:
    """Run ``case`` on ``device`` and compare it with the exact answer (``expected``: ``reference``'s, computed once
    for all the devices) bit for bit: None if exact, else what differs."""
    product_ref, rows_ref = expected if expected is not None else reference(torch, n, case)
    a, b = _inputs(torch, n, case)
    dtype = getattr(torch, case.dtype_name)
    product = torch.matmul(a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))
    if corrupt:
        product = product.clone()
        product.view(-1)[product.numel() // 3] += 1  # one element off by one: what a flipped bit does to an integer result
    rows = product.double().sum(dim=1)  # float64: the row sums (< 2**27) are exact in any order
    host, host_rows = product.cpu().double(), rows.cpu()
    wrong = (host != product_ref.double()).nonzero()
    if wrong.numel():
        i, j = (int(v) for v in wrong[0])
        return (f"{wrong.shape[0]} element(s) differ, first [{i}, {j}]: {float(host[i, j])!r} where {int(product_ref[i, j])} "
                "is exact")
    if not torch.equal(host_rows, rows_ref.double()):
        return "row sums differ from the exact ones"
    return None


def known_answer(ctx: CheckContext) -> Outcome:
    import torch

    n = int(ctx.params.get("known_answer_n", N))
    if n < 2 or n > 4096:
        return Outcome(Status.FAIL, f"known_answer_n {n} is out of range (2 to 4096: larger sums leave float32's exact range)",
                       "BadConfig", {}, FaultAction.NONE)
    # Every device the node has, whatever its profile says: wrong numbers are a device's, and a node checked on demand
    # may have no profile that names its GPUs (health/suspect.py).
    if torch.cuda.is_available():
        devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    elif ctx.profile.Accelerator == "gpu":
        return Outcome(Status.FAIL, f"profile {ctx.instance_type} expects GPUs; torch sees no CUDA device", "NoGPU", {},
                       FaultAction.REPLACE)
    else:
        devices = ["cpu"]
    corrupt = (ctx.node_dir / FAULT_FILE).exists()
    wrong: dict[str, str] = {}
    expected = {case: reference(torch, n, case) for case in CASES}  # the host's int64 answer, once, not per device
    for device in devices:
        for case in CASES:
            differs = on_device(torch, device, n, case, corrupt=corrupt, expected=expected[case])
            if differs is not None:
                wrong[f"{device} {case.name}"] = differs
    metrics = {"n": n, "devices": devices, "wrong": wrong}
    if wrong:
        first = next(iter(wrong))
        return Outcome(Status.FAIL, f"wrong results on {', '.join(wrong)}: an exact integer matmul of {n}x{n} did not give the "
                       f"known answer ({first}: {wrong[first]}): silent data corruption", SILENT_DATA_CORRUPTION, metrics,
                       FaultAction.REPLACE)
    return Outcome(Status.PASS, f"exact results on {len(devices)} device(s) ({n}x{n} integer matmuls in "
                   f"{'/'.join(c.name for c in CASES)})", "", metrics, FaultAction.NONE)
