"""State from live peers (issue 11, item 4): after an in-process restart, restore from a survivor's memory.

A survivor of an in-process restart still holds the job's state as of its last
``ctx.progress(step)`` -- newer than any checkpoint. When that state is replicated
on every rank (DDP: the model, the optimizer, a sampler position shared by all
ranks), the replacement ranks can take it from a survivor over the new process
group instead of reading a checkpoint, and the job loses at most the step that was
in flight. The script says what that state is, once, with ``ctx.keep_live(fn)``:
``fn()`` returns the replicated part of what it would save (never per-rank parts).

``LiveFirst`` wraps the job's checkpointer for the first restore of an attempt:

1. every rank says which step it holds live (-1: none, a fresh process);
2. if some rank holds one, the lowest such rank with the newest step sends its
   state (``collectives.from_rank``) and every rank restores it, with the RNG
   state captured at that step (survivors their own, new ranks the sender's);
3. else the wrapped checkpointer restores, as without it.

A survivor's live step is the last one it reported: the state it holds is that
step's as long as the script steps its optimizer before ``ctx.progress`` and
only after the step's collectives (true of DDP and FSDP loops), so a peer failing
in a collective leaves every survivor at the reported step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from unbroken.checkpoint.rank import collectives, rng
from unbroken.checkpoint.api import Checkpointer, CheckpointObserver, RestoreReport, Restored


@dataclass(frozen=True)
class LiveState:
    """What a survivor keeps across an in-process restart."""

    step: int
    state: dict[str, Any]
    rng: dict[str, Any]


class LiveFirst:
    """A checkpointer whose first restore asks the live peers before the checkpoints."""

    def __init__(self, inner: Checkpointer, live: LiveState | None, *, rank: int,
                 observer: CheckpointObserver | None = None) -> None:
        self.inner = inner
        self.live = live
        self.rank = rank
        self.observer = observer

    def save(self, step: int, state: dict[str, Any]) -> None:
        self.inner.save(step, state)

    def fence(self) -> None:
        self.inner.fence()

    def prepare(self, state: dict[str, Any]) -> None:
        self.inner.prepare(state)

    def close(self) -> None:
        self.inner.close()

    def agreed(self, step: int) -> None:
        self.inner.agreed(step)

    def distrust_after(self, step: int, why: str) -> None:
        self.inner.distrust_after(step, why)

    def restore(self, device: Any = None) -> Restored | None:
        """A live peer's state where one holds a newer step than the checkpoints (as it is: the peers' state is on
        their devices already), else the inner checkpointer's, on ``device``."""
        live, self.live = self.live, None  # a later restore in the same attempt reads the checkpoints
        started = time.perf_counter()
        if not collectives.distributed():
            # a group of one (an elastic job shrunk to one rank): the survivor's own memory, if it held a step
            return self.inner.restore(device) if live is None else self._restored(live.step, live.state, live.rng, "own memory", started)
        held = collectives.everyones(live.step if live is not None else -1)
        newest = max(held)
        if newest < 0:
            return self.inner.restore(device)
        sender = held.index(newest)
        mine = (live.state, live.rng) if self.rank == sender and live is not None else None
        state, sender_rng = collectives.from_rank(sender, mine)
        # a survivor at the newest step keeps its own RNG stream; anyone else takes the sender's
        own_rng = live.rng if live is not None and live.step == newest else sender_rng
        return self._restored(newest, state, own_rng, "own memory" if self.rank == sender else f"live peer (rank {sender})", started)

    def _restored(self, step: int, state: dict[str, Any], rng_state: dict[str, Any], source: str, started: float) -> Restored:
        rng.apply(rng_state)
        if self.observer is not None:
            self.observer.restored(RestoreReport(step, "memory" if source == "own memory" else "peer",
                                                 time.perf_counter() - started))
        print(f"unbroken: restored step {step} from {source}", flush=True)
        return Restored(step=step, state=state, source=source)


__all__ = ["LiveFirst", "LiveState"]
