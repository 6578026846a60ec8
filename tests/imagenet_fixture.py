"""A small ImageNet-shaped validation set: a flat val/ of ILSVRC2012_val_*.JPEG images (real JPEGs
made by Pillow, each class its own colour and stripe pattern, so a network can learn them) and
the LOC_val_solution.csv that names their classes, in ImageNet's format."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

SYNSETS = ["n01440764", "n01443537", "n01484850", "n01491361", "n01494475", "n01496331", "n01498041", "n01514668"]


def make_imagenet_val(root: Path, *, classes: int = 4, per_class: int = 16, size: int = 48, empty: bool = False,
                      seed: int = 0) -> tuple[Path, Path]:
    """(val folder, solutions CSV). ``empty``: zero-byte placeholders instead of JPEGs (for tests of
    the file moves alone, where thousands of images are wanted fast)."""
    rng = np.random.default_rng(seed)
    val = root / "val"
    val.mkdir(parents=True)
    total = classes * per_class
    numbers = rng.permutation(total) + 1  # classes interleave in the flat folder, as in ImageNet's
    rows = ["ImageId,PredictionString"]
    for sample, number in enumerate(numbers):
        label = sample % classes
        synset = SYNSETS[label] if label < len(SYNSETS) else f"n{2000000 + label:08d}"
        image_id = f"ILSVRC2012_val_{number:08d}"
        rows.append(f"{image_id},{synset} 10 12 {size - 5} {size - 3} {synset} 1 2 {size - 1} {size - 1}")
        path = val / f"{image_id}.JPEG"
        if empty:
            path.touch()
            continue
        pixels = np.empty((size, size, 3), dtype=np.float32)
        pixels[:] = np.array([(label * 67) % 256, (label * 131) % 256, (label * 29 + 90) % 256], dtype=np.float32)
        stripes = (np.arange(size) // (2 + label % 4)) % 2 == 0
        pixels[stripes if label % 2 else slice(None), stripes if not label % 2 else slice(None)] *= 0.5
        pixels += rng.normal(0, 18, pixels.shape)
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(path, quality=90)
    solutions = root / "LOC_val_solution.csv"
    solutions.write_text("\n".join(rows) + "\n")
    return val, solutions
