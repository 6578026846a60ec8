"""A job whose replicas stopped agreeing (silent data corruption): what the controller reads and writes.

The ranks compare fingerprints of their replicated state (``ctx.watch_replicas``); when they differ every rank
reports it to its agent and exits, and the worker's report carries a :class:`~unbroken.state.records.Divergence`.
The controller then, in one pass:

1. restarts the job, the reason naming the step, the suspect rank(s) and their node(s), and the last agreed step
   (``FaultKind.SILENT_DATA_CORRUPTION``; it counts against ``max_retry`` as any restart does);
2. marks every checkpoint step the diverged attempt (or an earlier one) committed after the last agreed step
   ``Untrusted`` in the catalog, in both tiers: a restore never sees it (``plan.committed_steps`` reads only
   ``Committed`` rows; the restore catalog lists the persistent tier's untrusted steps for the rank to skip);
   again on every pass while the job is Restarting, so a commit that raced the first mark is caught before
   the next attempt restores;
3. takes the suspect node(s) out: outvoted by a majority, ``UnschedulablePendingReplacement`` with fault type
   ``SilentDataCorruption`` at once; with no majority (two replicas), cordoned as ``SilentDataCorruptionSuspect``
   until their agents' known-answer check says which computes wrong (health/suspect.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from unbroken.state.catalog import CheckpointCatalog
from unbroken.state.records import CheckpointStep, Divergence, StepStatus, Worker

log = logging.getLogger("unbroken.controller.divergence")

REASON_PREFIX = "silent data corruption: "
"""How a divergence's restart reason starts (fault_kinds reads it)."""


@dataclass(frozen=True)
class Found:
    divergence: Divergence
    suspect_nodes: tuple[str, ...]
    """The nodes holding the suspect ranks (the ranks' nodes, from the workers' rank lists)."""


def find(workers: list[Worker]) -> Found | None:
    """The attempt's divergence, if a worker reported one: the earliest step's."""
    reported = sorted((w.divergence for w in workers if w.divergence is not None), key=lambda d: d.step)
    if not reported:
        return None
    first = reported[0]
    node_of = {info.rank: w.node for w in workers for info in w.ranks}
    nodes = tuple(sorted({node_of[r] for r in first.suspects if r in node_of}))
    return Found(first, nodes)


def reason(found: Found) -> str:
    d = found.divergence
    where = f" in {d.tensor}" if d.tensor else ""
    ranks = ", ".join(str(r) for r in d.suspects)
    on = f" on {', '.join(found.suspect_nodes)}" if found.suspect_nodes else ""
    who = (f"rank {ranks}{on} outvoted by its replicas" if d.majority else
           f"no majority among ranks {ranks}{on}: the known-answer check decides")
    agreed = f"step {d.agreed_step}" if d.agreed_step >= 0 else "none this attempt"
    return f"{REASON_PREFIX}replicas disagree at step {d.step}{where}: {who}; last agreed {agreed}, later checkpoints untrusted"


def untrusted_rows(rows: list[CheckpointStep], divergence: Divergence, attempt: int) -> list[CheckpointStep]:
    """The rows to mark: steps after the last agreed one that attempt ``attempt`` or an earlier one wrote."""
    return [r for r in rows if r.step > divergence.agreed_step and r.attempt <= attempt
            and r.status in (StepStatus.COMMITTED, StepStatus.DRAINING)]


def distrust(catalog: CheckpointCatalog, job: str, divergence: Divergence, attempt: int, why: str) -> list[int]:
    """Mark the untrusted rows (compare-and-swap each: a row changed meanwhile is looked at again next pass).
    Returns the steps marked now."""
    marked = []
    for row in untrusted_rows(catalog.list_checkpoint_steps(job), divergence, attempt):
        new = dataclasses.replace(row, status=StepStatus.UNTRUSTED, message=why[:300], updated_at=time.time())
        if catalog.replace_checkpoint_step(row, new):
            marked.append(row.step)
    if marked:
        log.warning("job %s: checkpoint steps %s marked untrusted: %s", job, sorted(set(marked)), why, extra={"job": job})
    return sorted(set(marked))
