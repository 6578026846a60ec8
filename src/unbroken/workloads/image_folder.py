"""An ImageFolder dataset (``root/<class>/<image>``) read with Pillow, with seeded augmentation.

Classes are the sorted folder names, samples the sorted file paths, so every rank and
every run sees the same numbering. Augmentation (a random resized crop and a horizontal
flip for training; resize and centre crop for evaluation) draws from a generator seeded by
(seed, epoch, sample), not from global state: a resumed run, or a data loader with any
number of workers, produces the very same tensors.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from unbroken.errors import ConfigError

SUFFIXES = frozenset({".jpeg", ".jpg", ".png", ".bmp", ".webp"})
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


class ImageFolder(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    def __init__(self, root: Path, size: int, *, train: bool, seed: int = 0) -> None:
        if not root.is_dir():
            raise ConfigError(f"{root}: no such folder (expected one folder of images per class)")
        self.classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        self.samples = [(path, label) for label, name in enumerate(self.classes)
                        for path in sorted((root / name).iterdir()) if path.suffix.lower() in SUFFIXES]
        if not self.samples:
            raise ConfigError(f"{root}: no images in class folders (expected {root}/<class>/<image>.JPEG; "
                              "for ImageNet's flat val/ run unbroken data imagenet-val first)")
        self.size, self.train, self.seed = size, train, seed
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        with Image.open(path) as file:
            image: Image.Image = file.convert("RGB")
        rng = np.random.default_rng([self.seed, self.epoch, index])
        image = self._random_crop(image, rng) if self.train else self._centre_crop(image)
        if self.train and rng.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        pixels = (np.asarray(image, dtype=np.float32) / 255.0 - MEAN) / STD
        return torch.from_numpy(pixels.transpose(2, 0, 1).copy()), label

    def _random_crop(self, image: Image.Image, rng: np.random.Generator) -> Image.Image:
        """Inception-style: 8-100 % of the area, aspect 3/4-4/3; the whole image if ten draws miss."""
        width, height = image.size
        for _ in range(10):
            area = width * height * rng.uniform(0.08, 1.0)
            aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
            w, h = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
            if 0 < w <= width and 0 < h <= height:
                left, top = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
                return image.resize((self.size, self.size), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
        return image.resize((self.size, self.size), Image.Resampling.BILINEAR)

    def _centre_crop(self, image: Image.Image) -> Image.Image:
        scale = self.size / 0.875 / min(image.size)
        image = image.resize((round(image.size[0] * scale), round(image.size[1] * scale)), Image.Resampling.BILINEAR)
        left, top = (image.size[0] - self.size) // 2, (image.size[1] - self.size) // 2
        return image.crop((left, top, left + self.size, top + self.size))
