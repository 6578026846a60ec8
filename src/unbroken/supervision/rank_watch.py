"""Seeing a rank die the moment it dies, not when torchrun's monitor notices.

torchrun polls its ranks every ``--monitor-interval``, then stops the others and
exits, and only then did the agent see the worker fail: a rank's death reached
the controller most of a second after it happened. The agent now watches each
rank process itself. A pidfd (``os.pidfd_open``) is readable the instant its
process exits; the dead rank is then a zombie until torchrun reaps it, and its
``/proc/<pid>/stat`` still holds the wait status, so the agent knows the signal
or the exit code as well as torchrun will.

Ranks are the direct children of a worker's torchrun that carry ``LOCAL_RANK``
in their environment (their own children, a data loader's workers, are not
ranks). A warm spare's ranks are children of its forkserver, one level down,
and name themselves in the worker's rank registry (rank/registry.py). One thread finds new ranks and waits on all pidfds, waking at least
every ``SCAN_SECONDS`` to look for the ranks of workers not all found yet.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from unbroken.plumbing import procs
from unbroken.rank import registry as rank_registry

log = logging.getLogger("unbroken.supervision.rank_watch")

SCAN_SECONDS = 0.05


@dataclass(frozen=True)
class Rank:
    worker_id: int
    pid: int
    rank: str
    """The global ``RANK`` (as the environment says it)."""
    local_rank: int


@dataclass(frozen=True)
class RankDeath:
    rank: Rank
    exit_code: int | None
    """Negative: killed by that signal; None: reaped before the agent looked (torchrun will tell)."""
    warm: bool = False
    """A warm spare's rank: its forkserver reaps it at once, so a None code is a death by some signal
    (a rank that ends on its own records its code), not a clean exit the agent was too late to see."""


def wait_status(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The exit code of a zombie (negative: the signal), from field 52 of ``/proc/<pid>/stat``; None if the
    process is not a zombie (still running, or already reaped)."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
    if not fields or fields[0] != "Z" or len(fields) < 50:
        return None
    status = int(fields[49])
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


@dataclass
class _Tracked:
    torchrun_pid: int
    expected: int
    """Ranks torchrun starts (``--nproc-per-node``); once all were found the worker is not scanned again
    (it never restarts one: ``--max-restarts 0``), so a running job costs the node no /proc reads."""
    registry: Path | None = None
    """Where a warm spare's ranks register (None: a cold torchrun's, known by their environment)."""
    found: set[int] = field(default_factory=set)
    """Pids of its ranks found so far."""


class RankWatch:
    """Calls ``on_death`` (from its own thread) for every rank of a tracked worker that exits."""

    def __init__(self, on_death: Callable[[RankDeath], None]) -> None:
        self.on_death = on_death
        self._lock = threading.Lock()
        self._workers: dict[int, _Tracked] = {}  # by worker id
        self._ranks: dict[int, Rank] = {}  # by pidfd
        self._registries: dict[int, Path] = {}  # by pidfd, for a warm worker's ranks
        self._poll = select.poll()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rank-watch", daemon=True)
        self._thread.start()

    def track(self, worker_id: int, torchrun_pid: int, ranks: int, registry: Path | None = None) -> None:
        """Watch the ``ranks`` rank processes the worker's torchrun (``torchrun_pid``) starts."""
        with self._lock:
            self._workers[worker_id] = _Tracked(torchrun_pid, ranks, registry)

    def forget(self, worker_id: int) -> None:
        with self._lock:
            self._workers.pop(worker_id, None)

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)
        for fd in list(self._ranks):
            os.close(fd)
        self._ranks.clear()

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._scan()
                deaths = [self._died(fd) for fd, _ in self._poll.poll(SCAN_SECONDS * 1000)]
                # Seen together, the cause before the teardown: torchrun stops the other ranks with SIGTERM.
                for death in sorted(deaths, key=lambda d: d.exit_code == -signal.SIGTERM):
                    self.on_death(death)
            except Exception:  # noqa: BLE001 - the watch is a shortcut; torchrun's own exit still reports every death
                log.exception("rank watch pass failed")
                self._stopping.wait(1.0)

    def _scan(self) -> None:
        with self._lock:
            workers = dict(self._workers)
        for fd, rank in list(self._ranks.items()):
            if rank.worker_id not in workers:
                self._unwatch(fd)
        for worker_id, tracked in workers.items():
            if len(tracked.found) >= tracked.expected:
                continue
            try:
                torchrun = psutil.Process(tracked.torchrun_pid)
                # a warm spare's ranks are its forkserver's children
                children = torchrun.children(recursive=True) if tracked.registry else torchrun.children()
            except psutil.Error:
                continue
            for child in children:
                if child.pid in tracked.found:
                    continue
                # None: not a rank, or one not exec'ed (still torchrun's environment) or registered yet,
                # which the next scan sees. A warm worker's ranks count only by the registry: a rank's
                # own children (a data loader's) may carry RANK in their environment.
                identity = rank_registry.identify(child.pid, {} if tracked.registry else procs.environ(child), tracked.registry)
                if identity is None:
                    continue
                tracked.found.add(child.pid)
                try:
                    fd = os.pidfd_open(child.pid)
                except OSError:
                    continue  # exited between the listing and now: torchrun reports it
                self._ranks[fd] = Rank(worker_id, child.pid, str(identity.rank), identity.local_rank)
                if tracked.registry is not None:
                    self._registries[fd] = tracked.registry
                self._poll.register(fd, select.POLLIN)

    def _died(self, fd: int) -> RankDeath:
        rank = self._ranks[fd]
        code = wait_status(rank.pid)
        registry = self._registries.get(fd)
        if code is None and registry is not None:
            code = rank_registry.exit_code(registry, rank.pid)
        self._unwatch(fd)
        return RankDeath(rank, code, warm=registry is not None)

    def _unwatch(self, fd: int) -> None:
        self._poll.unregister(fd)
        os.close(fd)
        del self._ranks[fd]
        self._registries.pop(fd, None)
