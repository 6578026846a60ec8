"""Images for the real nodes (node.py), built here without a Docker daemon, registry or base image.

A layer is an uncompressed tar of files; ``imagetool`` (image-tools/main.go, go-containerregistry) stacks layers
into an OCI image written as a docker-archive tarball, which a node's containerd imports (``ctr images
import``). Built once per content and kept outside the clone, as the control plane's binaries are
(``~/.cache/unbroken/images/<name>-<key>/image.tar``, ``$UNBROKEN_IMAGE_CACHE`` moves it):

* ``pause_image()``: the pod sandbox's image, one static Go binary (image-tools/pause/main.go) as ``/pause``.
* ``base_image()``: Debian bookworm (``mmdebstrap --variant=minbase``) with Python 3.11 and the venv
  module: what unbroken's own image is built on (the Dockerfile's ``python:3.11-slim``, which no registry here
  can serve). ~20 s and ~230 MB the first time.

The cache key is the recipe (suite, packages, the tool's version), not the mirror's state on the day: a
rebuild on another day may hold newer Debian point releases of the same packages, as a Dockerfile's
``apt-get install`` would.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from controlplane import components

DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
"""Python 3.11 (bookworm's, the ABI unbroken's venv is built for)."""
NONROOT_UID = 65532
"""The operator's user in deploy/ (``runAsUser: 65532``): the image names it, as distroless images do."""
PAUSE_REF = "unbroken.test/pause:1"
"""The sandbox image every node's containerd pins (``pinned_images.sandbox``)."""


class ImageError(RuntimeError):
    pass


@dataclass(frozen=True)
class Image:
    ref: str
    """The name pods use (``imagePullPolicy: Never``: nodes have it imported, no registry is asked)."""
    archive: Path
    """The docker-archive tarball ``ctr images import`` reads."""


def cache_root() -> Path:
    configured = os.environ.get("UNBROKEN_IMAGE_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "unbroken" / "images"


def _key(*parts: str) -> str:
    return hashlib.sha256("\0".join((components.IMAGE_TOOLS.version, *parts)).encode()).hexdigest()[:12]


def _imagetool(layers: list[Path], ref: str, out: Path, *, env: tuple[str, ...] = (), entrypoint: str = "") -> None:
    command = [str(components.IMAGE_TOOLS.binary("imagetool")), "-ref", ref, "-out", str(out), "-entrypoint", entrypoint]
    for layer in layers:
        command += ["-layer", str(layer)]
    for value in env:
        command += ["-env", value]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise ImageError(f"imagetool could not write {ref}: {result.stderr.strip()}")


def _built(name: str, key: str, ref: str, build: Callable[[Path, str], None]) -> Image:
    """The cached image ``name`` at ``key``, built first by ``build(staging, ref)`` if absent, in a staging folder
    renamed into place with ``image.tar`` in it: a build killed half-way leaves nothing that looks built."""
    target = cache_root() / f"{name}-{key}"
    if not (target / "image.tar").exists():
        staging = target.with_name(target.name + ".building")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        build(staging, ref)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    return Image(ref, target / "image.tar")


def pause_image() -> Image:
    """The sandbox image: ``/pause``, waiting for SIGTERM, named ``PAUSE_REF``."""
    def build(staging: Path, ref: str) -> None:
        layer = staging / "layer.tar"
        with tarfile.open(layer, "w") as tar:
            tar.add(components.IMAGE_TOOLS.binary("pause"), arcname="pause")
        _imagetool([layer], ref, staging / "image.tar", entrypoint="/pause")
        layer.unlink()

    return _built("pause", _key("pause", "/pause"), PAUSE_REF, build)


def base_image() -> Image:
    """Debian with Python 3.11 (``BASE_PACKAGES``) and a ``nonroot`` user (65532, as distroless images have), one
    layer."""
    key = _key("base", DEBIAN_SUITE, DEBIAN_MIRROR, *BASE_PACKAGES)

    def build(staging: Path, ref: str) -> None:
        if shutil.which("mmdebstrap") is None:
            raise ImageError("mmdebstrap is not installed (`make test` installs it: apt-get install mmdebstrap)")
        rootfs = staging / "rootfs.tar"
        nonroot = (f'echo "nonroot:x:{NONROOT_UID}:{NONROOT_UID}:nonroot:/home/nonroot:/usr/sbin/nologin" >> "$1/etc/passwd"'
                   f' && echo "nonroot:x:{NONROOT_UID}:" >> "$1/etc/group"'
                   f' && mkdir -p "$1/home/nonroot" && chown {NONROOT_UID}:{NONROOT_UID} "$1/home/nonroot"')
        command = ["mmdebstrap", "--quiet", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
                   "--customize-hook", nonroot, "--customize-hook", 'rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/*',
                   DEBIAN_SUITE, str(rootfs), DEBIAN_MIRROR]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            raise ImageError(f"`{' '.join(command)}` failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
        _imagetool([rootfs], ref, staging / "image.tar",
                   env=("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"))
        rootfs.unlink()

    return _built("debian-python", key, f"unbroken.test/debian-python:{key}", build)
