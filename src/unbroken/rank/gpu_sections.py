"""The time ``ctx.section`` spends on the GPU, from CUDA events, read without stalling the step.

On a GPU the host only queues kernels: a section timed on the host measured
0.28 ms for a forward whose kernels took 1.39 ms (an H100). What a straggler
score must compare is where the *GPU* is slow, so on a rank whose CUDA is in
use each section also records a CUDA event on the current stream when it
starts and when it ends (as NVIDIA's resiliency extension's straggler detector
does); the time between the two is the section's time on the device.

Reading an event's time before the GPU got there would wait for it. So the
sections of one progress interval are read at the *next* ``ctx.progress``: by
then the GPU has almost always finished them (a training loop rarely runs
more than a step ahead of its GPU); if it has not, the read waits for the last
of them, which keeps the host at most one interval ahead. Events are reused.
Cost: two event records per section (a few µs each) and one read per progress.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

EventFactory = Callable[[], Any]
"""Makes an event with ``record()``, ``synchronize()`` and ``elapsed_time(other)`` in ms (``torch.cuda.Event``)."""


class GpuSections:
    def __init__(self, make_event: EventFactory, current_stream: Callable[[], Any] | None = None) -> None:
        self._make_event = make_event
        self._current_stream = current_stream
        """The stream a section's events go on (looked up once a section: each lookup makes a Python object)."""
        self._free: list[Any] = []
        self._current: list[tuple[str, Any, Any]] = []
        """(metric key, start, end) of the sections since the last progress."""
        self._previous: list[tuple[str, Any, Any]] = []

    @classmethod
    def for_cuda(cls) -> GpuSections:
        import torch

        return cls(lambda: torch.cuda.Event(enable_timing=True), torch.cuda.current_stream)

    def start(self) -> tuple[Any, Any]:
        event = self._free.pop() if self._free else self._make_event()
        stream = self._current_stream() if self._current_stream is not None else None
        event.record(stream) if stream is not None else event.record()
        return event, stream

    def stop(self, key: str, started: tuple[Any, Any]) -> None:
        event = self._free.pop() if self._free else self._make_event()
        start_event, stream = started
        event.record(stream) if stream is not None else event.record()
        self._current.append((key, start_event, event))

    def interval(self) -> dict[str, float]:
        """At a progress: the GPU seconds per section key of the interval before this one (waiting, if need be,
        for its last event); the sections since the last progress become the next one read."""
        seconds: dict[str, float] = defaultdict(float)
        if self._previous:
            for _, _, ended in self._previous:
                ended.synchronize()  # done already, as a rule: a query
            for key, started, ended in self._previous:
                seconds[key] += started.elapsed_time(ended) / 1000.0
                self._free += (started, ended)
        self._previous, self._current = self._current, []
        return dict(seconds)
