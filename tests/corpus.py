"""Real text for the data tools and the LLM workload: the King James Bible (public domain),
as Debian's bible-kjv package prints it, one verse per line without its reference."""

from __future__ import annotations

import subprocess
from pathlib import Path

WHOLE_BIBLE = "Gen1:1-Rev22:21"


def write_kjv(path: Path, passage: str = WHOLE_BIBLE) -> Path:
    """``passage`` (the whole book by default: 31,102 verses, 4.3 MB) into ``path``, a verse per line."""
    printed = subprocess.run(["bible", "-f", passage], check=True, capture_output=True, text=True).stdout
    verses = [line.split(" ", 1)[1] for line in printed.splitlines() if " " in line]
    path.write_text("\n".join(verses) + "\n")
    return path
