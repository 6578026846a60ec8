"""A baseline commit's sources, for benchmarks that run today's design beside the one before it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def sources(commit: str) -> Path:
    """``src`` of ``commit`` (``git archive``), extracted once into ``~/.cache/unbroken/baseline-<commit>``: put it
    first on ``PYTHONPATH`` to run that commit's code."""
    target = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "unbroken" / f"baseline-{commit}"
    if not (target / "src" / "unbroken").is_dir():
        target.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "src"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target / "src"
