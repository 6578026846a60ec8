"""The data tools killed with SIGKILL at an arbitrary point and run again end with the very
bytes of an uninterrupted run (issue 12, done-when 4)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from unbroken.data.token_shards import INDEX
from unbroken.plumbing.waiting import wait_until


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


def test_imagenet_val_killed_and_rerun_ends_in_the_layout_of_an_uninterrupted_run(tmp_path: Path) -> None:
    from imagenet_fixture import make_imagenet_val

    # 20,000 placeholder images: enough renames (~0.5 s) to kill the tool in the middle of them
    reference, solutions = make_imagenet_val(tmp_path / "reference", classes=8, per_class=2500, empty=True)
    val, _ = make_imagenet_val(tmp_path / "interrupted", classes=8, per_class=2500, empty=True)

    def sort(folder: Path) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", "unbroken", "data", "imagenet-val", str(folder), "--solutions", str(solutions),
                                 "-o", "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    done = sort(reference)
    assert done.wait(120) == 0
    expected = sorted(str(p.relative_to(reference)) for p in reference.rglob("*.JPEG"))

    run = sort(val)
    wait_until(lambda: any(any(d.iterdir()) for d in val.iterdir() if d.is_dir()) or run.poll() is not None, 60, "the first move",
               interval=0.001)
    run.send_signal(signal.SIGKILL)
    assert run.wait(10) == -signal.SIGKILL, "finished before it could be killed: the kill tested nothing"
    moved = sum(1 for _ in val.glob("*/*.JPEG"))
    assert 0 < moved < 20000, moved
    rerun = sort(val)
    assert rerun.wait(120) == 0
    assert sorted(str(p.relative_to(val)) for p in val.rglob("*.JPEG")) == expected
    report = json.loads(rerun.stdout.read() if rerun.stdout else b"{}")
    assert report["moved"] + report["already_in_place"] == 20000 and report["already_in_place"] == moved
