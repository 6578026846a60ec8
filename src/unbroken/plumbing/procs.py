"""Process-tree plumbing shared by the agent, the local backend and chaos.

torchrun puts each rank in its own session, so process groups do not cover a
worker; we walk the parent/child tree with psutil instead and signal every
member, collected *before* the first signal so nothing escapes by reparenting.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from unbroken.plumbing.layout import CLUSTER_DIR


def tree(pid: int) -> list[psutil.Process]:
    """``pid`` and all its descendants that are alive now (empty if ``pid`` is gone)."""
    if pid <= 1:
        return []  # never walk from the idle task or init: that would be every process
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def signal_all(processes: list[psutil.Process], sig: int) -> None:
    for proc in processes:
        try:
            proc.send_signal(sig)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def kill_now(processes: list[psutil.Process]) -> None:
    """SIGKILL every process in the list in one sweep, as a power loss would."""
    signal_all(processes, signal.SIGKILL)


def wait_gone(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait up to ``timeout`` s; return those still alive (zombies count as gone).

    A zombie is dead, so the wait ends as soon as each process is a zombie or reaped:
    ``psutil.wait_procs`` alone waits for orphans' zombies until init reaps them, which
    takes seconds under some inits (it made every ``cluster down`` take 4-5 s)."""
    deadline = time.monotonic() + timeout
    alive = [p for p in processes if _running(p)]
    while alive and time.monotonic() < deadline:
        # reaps our own children (they would stay zombies otherwise) and waits a moment for the others
        psutil.wait_procs(alive, timeout=min(0.05, max(0.0, deadline - time.monotonic())))
        alive = [p for p in alive if _running(p)]
    return alive


def terminate_tree(pid: int, grace: float = 3.0) -> None:
    """SIGTERM (and SIGCONT, for stopped ones) the tree, SIGKILL whatever outlives ``grace``."""
    members = tree(pid)
    if not members:
        return
    signal_all(members, signal.SIGTERM)
    signal_all(members, signal.SIGCONT)
    survivors = wait_gone(members, grace)
    if survivors:
        kill_now(survivors + tree(pid))
        wait_gone(survivors, 5.0)


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        return _running(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def environ(proc: psutil.Process) -> dict[str, str]:
    """The process's environment; empty if it vanished or cannot be read meanwhile (a scan races exits)."""
    try:
        return proc.environ()
    except (psutil.Error, OSError):
        return {}


def cluster_processes(cluster_dir: Path) -> list[psutil.Process]:
    """Every live process started for this cluster (agents, controller, torchrun, ranks).

    They all carry ``UNBROKEN_CLUSTER_DIR`` in their environment, which survives
    reparenting: this finds orphans that no parent/child walk can.
    """
    wanted = str(cluster_dir.resolve())
    found = []
    me = os.getpid()
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == me:
            continue
        try:
            if proc.environ().get(CLUSTER_DIR) == wanted and _running(proc):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return found



def duty_cycle(victims: Callable[[], list[int]], factor: float, period: float, done: threading.Event, *,
               started: Callable[[], None] | None = None, refresh: float = 1.0) -> None:
    """Until ``done``: stop the processes ``victims()`` names (SIGSTOP) for ``1 - 1/factor`` of every
    ``period``, let them run the rest, re-reading ``victims()`` every ``refresh`` seconds. They run
    ``factor`` times slower for CPU work. Whatever ends it, every process it stopped is continued."""
    run_s, stop_s = period / factor, period - period / factor
    pids: list[int] = []
    refreshed = -refresh
    try:
        while not done.is_set():
            if time.monotonic() - refreshed >= refresh:
                _send(pids, signal.SIGCONT)  # one that is no longer a victim must not stay stopped
                pids, refreshed = victims(), time.monotonic()
            _send(pids, signal.SIGSTOP)
            if started is not None:
                started()
                started = None
            done.wait(stop_s)
            _send(pids, signal.SIGCONT)
            done.wait(run_s)
    finally:
        _send(pids, signal.SIGCONT)


def _send(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
