"""``unbroken data imagenet-val``: ImageNet's flat ``val/`` folder into one folder per class.

ImageNet ships its 50,000 validation images in one folder, their classes in a CSV
(``LOC_val_solution.csv``: ``ImageId,PredictionString``, the class being the first word of
the prediction string, e.g. ``n01751748 17 142 475 340``). Training scripts read an
ImageFolder layout (``val/<class>/<image>.JPEG``), so this moves each image into its class's
folder, as the TorchElastic-on-EKS guide's preparation script does.

Safe to interrupt and re-run: each image moves by one rename, and a re-run skips images
already in place, so any mix of moved and unmoved images converges to the same layout.
Nothing is overwritten or deleted; an image missing from both places is reported, not guessed.
"""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from unbroken.errors import ConfigError

SYNSET = re.compile(r"^n\d{8}$")
"""A WordNet synset id, ImageNet's class names: also what keeps a row from naming a path."""
IMAGE_SUFFIX = ".JPEG"


@dataclass
class SortReport:
    moved: int = 0
    already_in_place: int = 0
    missing: list[str] = field(default_factory=list)
    classes: int = 0
    not_in_solutions: int = 0
    """Images left at the top level because the CSV does not name them."""


def read_solutions(path: Path) -> dict[str, str]:
    """ImageId → class, from a ``LOC_val_solution.csv``."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
    except FileNotFoundError:
        raise ConfigError(f"--solutions {path}: no such file") from None
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ConfigError(f"--solutions {path}: not a CSV file ({exc})") from None
    if not rows or [c.strip() for c in rows[0][:2]] != ["ImageId", "PredictionString"]:
        raise ConfigError(f"--solutions {path}: line 1 must be the header ImageId,PredictionString (got {','.join(rows[0]) if rows else 'an empty file'!r})")
    solutions: dict[str, str] = {}
    for number, row in enumerate(rows[1:], start=2):
        if not row:
            continue
        image, words = row[0].strip(), (row[1].split() if len(row) > 1 else [])
        if not image or "/" in image or image.startswith(".") or not words or not SYNSET.match(words[0]):
            raise ConfigError(f"--solutions {path}: line {number}: {','.join(row)[:80]!r} is not ImageId,<synset like n01751748> ...")
        if solutions.setdefault(image, words[0]) != words[0]:
            raise ConfigError(f"--solutions {path}: line {number}: {image} is listed twice with different classes")
    return solutions


def sort_into_classes(val_dir: Path, solutions_csv: Path, progress: Callable[[int, int], None] | None = None) -> SortReport:
    """Move every image the CSV names from ``val_dir`` into ``val_dir/<class>/``."""
    if not val_dir.is_dir():
        raise ConfigError(f"{val_dir}: no such folder (the flat ImageNet val/ folder of *.JPEG images)")
    solutions = read_solutions(solutions_csv)
    report = SortReport(classes=len(set(solutions.values())))
    for synset in sorted(set(solutions.values())):
        (val_dir / synset).mkdir(exist_ok=True)
    for done, (image, synset) in enumerate(sorted(solutions.items()), start=1):
        flat, sorted_path = val_dir / f"{image}{IMAGE_SUFFIX}", val_dir / synset / f"{image}{IMAGE_SUFFIX}"
        if sorted_path.exists():
            if flat.exists():
                raise ConfigError(f"{flat} and {sorted_path} both exist; remove the one that is not the image and run again")
            report.already_in_place += 1
        elif flat.exists():
            os.rename(flat, sorted_path)  # atomic: the image is in exactly one of the two places at any time
            report.moved += 1
        else:
            report.missing.append(image)
        if progress is not None and (done % 1000 == 0 or done == len(solutions)):
            progress(done, len(solutions))
    _fsync_dirs([val_dir, *(val_dir / s for s in set(solutions.values()))])
    report.not_in_solutions = sum(1 for p in val_dir.glob(f"*{IMAGE_SUFFIX}"))
    return report


def _fsync_dirs(folders: list[Path]) -> None:
    """Renames are durable once their folders are synced: a crash right after "done" loses no move."""
    for folder in folders:
        fd = os.open(folder, os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
