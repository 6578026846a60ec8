"""Stopping a server process a test started (stdlib only)."""

from __future__ import annotations

import signal
import subprocess


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
