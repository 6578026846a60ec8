"""nccl-tests' arithmetic and output format, exactly, so numbers compare with theirs.

From nccl-tests' PERFORMANCE.md: ``algbw = S / t`` with S the bytes of the
operation (the full buffer: for all-gather the received bytes, for
reduce-scatter the sent bytes) and GB = 1e9 bytes; ``busbw = algbw x factor``
with factor ``2(n-1)/n`` for all-reduce and ``(n-1)/n`` for all-gather and
reduce-scatter, n being the number of ranks. busbw is comparable across rank
counts and to the hardware's link speed; algbw is not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from unbroken.errors import UsageError

OPS = ("all_reduce", "all_gather", "reduce_scatter")
_OP_NAMES = {"all_reduce": "sum", "all_gather": "none", "reduce_scatter": "sum"}


def bus_factor(op: str, ranks: int) -> float:
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if op == "all_reduce":
        return 2 * (ranks - 1) / ranks
    if op in ("all_gather", "reduce_scatter"):
        return (ranks - 1) / ranks
    raise ValueError(f"unknown collective {op!r}; valid: {', '.join(OPS)}")


def algbw(size_bytes: int, seconds: float) -> float:
    """GB/s with GB = 1e9 bytes, as nccl-tests computes it."""
    return size_bytes / 1e9 / seconds


def busbw(op: str, size_bytes: int, seconds: float, ranks: int) -> float:
    return algbw(size_bytes, seconds) * bus_factor(op, ranks)


_SIZE = re.compile(r"^(\d+)([KMG]?)B?$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """nccl-tests' ``-b/-e`` syntax: ``8``, ``1K``, ``256M``, ``1G`` (powers of 1024)."""
    match = _SIZE.match(text.strip())
    if not match:
        raise UsageError(f"size {text!r} is invalid; use bytes with an optional K, M or G suffix, e.g. 8, 64K, 256M, 1G")
    number, unit = int(match.group(1)), match.group(2).upper()
    return number * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[unit]


def sizes(begin: int, end: int, factor: int, ranks: int, elem_bytes: int = 4) -> list[int]:
    """``begin, begin*factor, ... <= end``, each rounded down to whole elements per rank (at least one)."""
    if begin <= 0 or end < begin or factor < 2:
        raise UsageError(f"sweep -b {begin} -e {end} -f {factor} is invalid: need 0 < begin <= end and factor >= 2")
    unit = ranks * elem_bytes
    out: list[int] = []
    size = begin
    while size <= end:
        out.append(max(unit, size // unit * unit))
        size *= factor
    return out


@dataclass(frozen=True)
class Row:
    size: int
    """Bytes of the operation (S above)."""
    count: int
    """Elements of the operation."""
    dtype: str
    op: str
    out_time_us: float
    out_wrong: int
    in_time_us: float
    in_wrong: int
    ranks: int
    out_best_us: float = 0.0
    """Fastest iteration (not printed; the verdict's figure). 0: unknown, use the mean."""
    in_best_us: float = 0.0

    @property
    def best_busbw(self) -> float:
        """busbw of the fastest iteration, the better of out-of-place and in-place."""
        out = self.out_best_us or self.out_time_us
        inp = self.in_best_us or self.in_time_us
        return busbw(self.op, self.size, min(out, inp) / 1e6, self.ranks)

    @property
    def best_algbw(self) -> float:
        """algbw of the fastest iteration, the better of out-of-place and in-place: with one rank, all there is."""
        out = self.out_best_us or self.out_time_us
        inp = self.in_best_us or self.in_time_us
        return algbw(self.size, min(out, inp) / 1e6)

    @property
    def out_algbw(self) -> float:
        return algbw(self.size, self.out_time_us / 1e6)

    @property
    def out_busbw(self) -> float:
        return busbw(self.op, self.size, self.out_time_us / 1e6, self.ranks)

    @property
    def in_algbw(self) -> float:
        return algbw(self.size, self.in_time_us / 1e6)

    @property
    def in_busbw(self) -> float:
        return busbw(self.op, self.size, self.in_time_us / 1e6, self.ranks)


def _time(us: float) -> str:
    # nccl-tests: fewer decimals as the number grows, so the column keeps its width
    if us >= 10000.0:
        return f"{us:7.0f}"
    if us >= 100.0:
        return f"{us:7.1f}"
    return f"{us:7.2f}"


HEADER = (
    "#                                                              out-of-place                       in-place          \n"
    "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong\n"
    "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)       "
)


def format_row(row: Row) -> str:
    return (f"{row.size:12d}  {row.count:12d}  {row.dtype:>8s}  {_OP_NAMES[row.op]:>6s}  {-1:6d}"
            f"  {_time(row.out_time_us)}  {row.out_algbw:6.2f}  {row.out_busbw:6.2f}  {row.out_wrong:5d}"
            f"  {_time(row.in_time_us)}  {row.in_algbw:6.2f}  {row.in_busbw:6.2f}  {row.in_wrong:5d}")


def avg_busbw(rows: list[Row]) -> float:
    """nccl-tests' footer: the mean busbw over every size, out-of-place and in-place."""
    values = [r.out_busbw for r in rows] + [r.in_busbw for r in rows]
    return sum(values) / len(values) if values else 0.0


def format_table(rows: list[Row], title: str = "") -> str:
    lines = [f"# {title}"] if title else []
    lines.append(HEADER)
    lines.extend(format_row(r) for r in rows)
    wrong = sum(r.out_wrong + r.in_wrong for r in rows)
    lines.append(f"# Out of bounds values : {wrong} {'FAILED' if wrong else 'OK'}")
    lines.append(f"# Avg bus bandwidth    : {avg_busbw(rows):g} ")
    lines.append("#")
    return "\n".join(lines)
