"""The data tools killed with SIGKILL at an arbitrary point and run again end with the very
bytes of an uninterrupted run (issue 12, done-when 4)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from unbroken.data.token_shards import INDEX
from unbroken.waiting import wait_until


def _prepare(corpus: Path, out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "unbroken", "data", "prepare-text", str(corpus), "--out", str(out),
                             "--vocab-size", "2048", "--shard-tokens", "4096", "-o", "json"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _shards_listed(out: Path) -> int:
    try:
        return len(json.loads((out / INDEX).read_text())["shards"])
    except (FileNotFoundError, json.JSONDecodeError):  # not yet written; each write is an atomic rename
        return 0


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if not p.name.endswith(".tmp")}


def test_prepare_text_killed_twice_and_rerun_writes_the_same_shards(kjv: Path, tmp_path: Path) -> None:
    reference = _prepare(kjv, tmp_path / "reference")
    assert reference.wait(120) == 0, reference.stderr.read() if reference.stderr else ""
    expected = _files(tmp_path / "reference")
    assert len([n for n in expected if n.startswith("shard-")]) > 200  # the KJV is ~1.1 M tokens of 4096-token shards

    out = tmp_path / "interrupted"
    for at_least in (5, 100):  # once early, once again after the first resume got going
        run = _prepare(kjv, out)
        wait_until(lambda: _shards_listed(out) >= at_least or run.poll() is not None, 120, f"{at_least} shards listed")  # noqa: B023
        run.send_signal(signal.SIGKILL)
        assert run.wait(10) == -signal.SIGKILL, "finished before it could be killed: the kill tested nothing"
        assert not json.loads((out / INDEX).read_text())["complete"]
    rerun = _prepare(kjv, out)
    assert rerun.wait(120) == 0, rerun.stderr.read() if rerun.stderr else ""
    assert _files(out) == expected
