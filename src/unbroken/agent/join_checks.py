"""Checks a node runs when it joins, before it takes work.

The readiness check is always run. Deep-check suites named by the instance
group's ``OnStartDeepHealthChecks`` are looked up in ``DEEP_SUITES``, which
holds the health catalogue's suites (``unbroken.health.join``). A suite with
nothing registered is reported, not silently passed.
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

DeepSuite = Callable[[str, Path], JoinResult]


def _health_suite(suite: str) -> DeepSuite:
    def run(node: str, node_dir: Path) -> JoinResult:
        verdict = health_join.run_suite(suite, node, node_dir)
        return JoinResult(verdict.passed, verdict.reason, verdict.fault_type)
    return run


DEEP_SUITES: dict[str, DeepSuite] = {suite: _health_suite(suite) for suite in health_join.SUITES}


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


def run_join_checks(node: str, node_dir: Path, suites: list[str]) -> tuple[JoinResult, list[str]]:
    """Readiness then each requested deep suite. Returns the verdict and notes for events."""
    notes: list[str] = []
    result = readiness(node, node_dir)
    if not result.passed:
        return result, notes
    for suite in suites:
        check = DEEP_SUITES.get(suite)
        if check is None:
            notes.append(f"deep-check suite {suite} has no checks in this release; only readiness was verified")
            continue
        result = check(node, node_dir)
        if not result.passed:
            return result, notes
    return JoinResult(True, "join checks passed"), notes
