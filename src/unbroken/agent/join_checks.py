"""Checks a node runs when it joins, before it takes work.

The readiness check is always run. Deep-check suites named by the instance
group's ``OnStartDeepHealthChecks`` are the health catalogue's suites
(``unbroken.health.join.SUITES``), run by the ``deep`` function the agent
passes in. A suite the catalogue does not know is reported, not silently passed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from unbroken.health import join as health_join


@dataclass(frozen=True)
class JoinResult:
    passed: bool
    reason: str
    fault_type: str | None = None


MIN_FREE_BYTES = 1 << 30
"""A node with under 1 GiB free cannot hold logs and a checkpoint shard."""

DeepSuite = Callable[[str], health_join.Verdict]
"""Runs one deep-check suite on this node and says how it went."""


def readiness(node: str, node_dir: Path) -> JoinResult:
    try:
        node_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=node_dir) as probe:
            probe.write(b"ok")
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as exc:
        return JoinResult(False, f"node directory {node_dir} not writable: {exc.strerror}", "StorageFault")
    free = shutil.disk_usage(node_dir).free
    if free < MIN_FREE_BYTES:
        return JoinResult(False, f"only {free / 2**30:.2f} GiB free under {node_dir}, need >= 1 GiB", "StorageFault")
    if importlib.util.find_spec("torch") is None:
        return JoinResult(False, "torch is not importable by the agent's Python", "SoftwareFault")
    return JoinResult(True, "ready")


def run_join_checks(node: str, node_dir: Path, suites: list[str], deep: DeepSuite) -> tuple[JoinResult, list[str]]:
    """Readiness then each requested deep suite. Returns the verdict and notes for events."""
    notes: list[str] = []
    result = readiness(node, node_dir)
    if not result.passed:
        return result, notes
    for suite in suites:
        if suite not in health_join.SUITES:
            notes.append(f"deep-check suite {suite} has no checks in this release; only readiness was verified")
            continue
        verdict = deep(suite)
        if not verdict.passed:
            return JoinResult(False, verdict.reason, verdict.fault_type), notes
    return JoinResult(True, "join checks passed"), notes
