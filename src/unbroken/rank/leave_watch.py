"""A rank's watch for its launcher's request to leave the round (``rejoin.request_leave``), under ``unbroken run``.

The launcher asks every rank of a round to leave when the round ends elsewhere: a
peer of another pod failed, a pod is lost, the job grows, or the ranks are hung. A
rank blocked in a collective on a hung or lost peer never reaches its next
``ctx.progress``, so the request is watched from a thread (torch releases the GIL
while a collective waits): on a request the thread ends this rank's side of the
process group (``on_leave``), the collective fails at once, and ``Context.run``
holds the rank with the live state of its last step. A rank that is computing
fails at its next collective instead, within a step.

Why a thread per rank and not a signal: a Python signal handler runs only between
bytecodes, which a rank blocked in C++ never reaches.

The watch lives for one round. ``stop`` ends and joins it before the rank leaves
the group or returns from ``train``: a late request to leave a round this rank
already left, or a job that finished, means nothing, and a finished rank must exit
at once (its launcher reads a silent rank as hung). Cost: one failed ``open``
every ``POLL_SECONDS`` per rank.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from unbroken.rank import rejoin

POLL_SECONDS = 0.05
"""How often a rank looks for its request to leave: the latency of a leave, at the cost of a failed ``open``."""


class LeaveWatch:
    def __init__(self, rejoin_dir: Path, round_number: int, on_leave: Callable[[str], None]) -> None:
        self._rejoin_dir = rejoin_dir
        self._round = round_number
        self._on_leave = on_leave
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"unbroken-leave-watch-{round_number}", daemon=True)

    def start(self) -> LeaveWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the watch and wait for it: after this, ``on_leave`` is not running and will not run."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            why = rejoin.leave_requested(self._rejoin_dir, self._round)
            if why is not None:
                if not self._stop.is_set():
                    self._on_leave(why)
                return
