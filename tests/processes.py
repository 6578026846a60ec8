"""Stopping a process a test started, and slowing one down (stdlib only, but for the slower's own process)."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager


def stop_process(proc: subprocess.Popen[bytes], *, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
    """Send ``sig`` (SIGCONT first: a stopped process cannot act on it), wait up to ``timeout``
    seconds, then SIGKILL; always reaped. Nothing to do for one that already exited."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


_SLOWER = """
import signal, sys, threading
from unbroken.plumbing import procs
done = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: done.set())
root = int(sys.argv[1])
procs.duty_cycle(lambda: [p.pid for p in procs.tree(root)], float(sys.argv[2]), float(sys.argv[3]), done)
"""


@contextmanager
def slowed(root_pid: int, factor: float, period: float) -> Iterator[None]:
    """Run the process tree under ``root_pid`` ``factor`` times slower (stopped for ``1 - 1/factor`` of every
    ``period``) while the block runs. The stop/continue loop is a process of its own, as ``chaos slow-node``'s is:
    a thread of the test's process waits for the GIL behind the test's polling, and on a loaded machine its 33 ms
    stops stretched into irregular long ones that land on whichever section runs (CI named a 20 us ``data``
    section the slowest). Every stopped process is continued when it ends."""
    slower = subprocess.Popen([sys.executable, "-c", _SLOWER, str(root_pid), repr(factor), repr(period)])
    try:
        yield
    finally:
        stop_process(slower)
