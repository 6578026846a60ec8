"""Whole files or nothing (atomic_file.py), and a file's mode set before its first byte."""

from __future__ import annotations

import stat
from pathlib import Path

from unbroken.plumbing.atomic_file import write_bytes_atomically


def test_a_file_replaced_atomically_keeps_the_mode_it_was_asked_for_and_leaves_no_tmp(tmp_path: Path) -> None:
    key = tmp_path / "cluster.key"
    key.write_bytes(b"old")
    key.chmod(0o644)
    write_bytes_atomically(key, b"secret", mode=0o600)
    assert key.read_bytes() == b"secret"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["cluster.key"]
