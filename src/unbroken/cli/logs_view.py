"""Find and print a job's log files (``job logs``), once or following them."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from unbroken.errors import UsageError
from unbroken.plumbing.layout import ClusterLayout
from unbroken.state.records import Job, Worker
from unbroken.runtime import Runtime


@dataclass(frozen=True)
class LogSource:
    label: str
    paths: tuple[Path, ...]
    """Candidates in order; torchrun names rank folders after its run id, found by glob."""


def rank_paths(log_dir: Path, local_rank: int) -> tuple[Path, ...]:
    found = []
    for stream in ("stdout.log", "stderr.log"):
        found += sorted(log_dir.glob(f"*/attempt_*/{local_rank}/{stream}"))
    return tuple(found)


def sources(layout: ClusterLayout, job: Job, workers: list[Worker], *, node: str | None, rank: int | None) -> list[LogSource]:
    spec = job.spec()
    out: list[LogSource] = []
    if node is not None and node not in {w.node for w in workers}:
        raise UsageError(f"job {job.name} has no worker on node {node} in this attempt (nodes: {', '.join(w.node for w in workers)})")
    for worker in workers:
        if node is not None and worker.node != node:
            continue
        log_dir = layout.worker_log_dir(worker.job, worker.attempt, worker.node)
        # Ranks report their global rank when they start; before that, torchrun's
        # usual order (node_rank * procs + local_rank) is the best guess.
        known = {info.rank: info.local_rank for info in worker.ranks}
        if not known:
            known = {worker.node_rank * spec.procs_per_node + lr: lr for lr in range(spec.procs_per_node)}
        if rank is None:
            out.append(LogSource(f"{worker.node} torchrun", (log_dir / "torchrun.log",)))
        for global_rank, local_rank in sorted(known.items()):
            if rank is None or rank == global_rank:
                out.append(LogSource(f"{worker.node} rank {global_rank}", rank_paths(log_dir, local_rank)))
    if rank is not None and not out:
        raise UsageError(f"job {job.name} has no rank {rank} (world size {spec.world_size})")
    return out


def show(runtime: Runtime, job: Job, attempt: int, *, node: str | None, rank: int | None, follow: bool) -> None:
    offsets: dict[Path, int] = {}
    layout = runtime.layout
    while True:
        job = runtime.cluster.get_job(job.name)
        workers = runtime.backend.observe_attempt(job.name, attempt)
        ended = job.phase.is_terminal or attempt < job.attempt
        last_pass = not follow or ended
        for source in sources(layout, job, workers, node=node, rank=rank):
            for path in source.paths:
                _print_new(path, source.label, offsets, partial_too=last_pass)
        if last_pass:
            return
        time.sleep(0.5)


def _print_new(path: Path, label: str, offsets: dict[Path, int], *, partial_too: bool) -> None:
    """Print what was appended to ``path`` since the last call, line by line.

    While following, an unfinished last line waits for its newline; on the last
    pass it is printed as it is.
    """
    try:
        with open(path, "rb") as f:
            f.seek(offsets.get(path, 0))
            data = f.read()
    except OSError:
        return
    if not data:
        return
    if partial_too:
        complete, consumed = data, len(data)
    else:
        end = data.rfind(b"\n")
        if end < 0:
            return  # wait for the line to finish
        complete, consumed = data[:end], end + 1
    offsets[path] = offsets.get(path, 0) + consumed
    stream = "err" if path.name == "stderr.log" else ""
    prefix = f"[{label}{' ' + stream if stream else ''}] "
    for line in complete.decode(errors="replace").splitlines():
        sys.stdout.write(prefix + line + "\n")
    sys.stdout.flush()
