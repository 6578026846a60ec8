"""Images for the real nodes (node.py), built here without a Docker daemon, registry or base image.

A layer is an uncompressed tar of files; ``imagetool`` (image-tools/main.go, go-containerregistry) stacks layers
into an OCI image written as a docker-archive tarball, which a node's containerd imports (``ctr images
import``). Built once per content and kept outside the clone, as the control plane's binaries are
(``~/.cache/unbroken/images/<name>-<key>/image.tar``, ``$UNBROKEN_IMAGE_CACHE`` moves it):

* ``pause_image()``: the pod sandbox's image, one static Go binary (image-tools/pause/main.go) as ``/pause``.
* ``base_image()``: Debian bookworm (``mmdebstrap --variant=minbase``) with Python 3.11 and the venv
  module: what unbroken's own image is built on (the Dockerfile's ``python:3.11-slim``, which no registry here
  can serve). ~20 s and ~230 MB the first time.
* ``unbroken_image()``: the Dockerfile's layout on that Debian: a venv at ``/opt/unbroken`` with unbroken (a
  wheel of this checkout) and its dependencies (two layers: Debian and the dependencies, then unbroken), ``PATH``
  through it, no USER and no ENTRYPOINT. One difference: no torch. The operator and the node agent never import
  it (``import-linter`` holds them to that), and the only torch PyPI has for Linux is the CUDA build, 5 GB with its
  NVIDIA libraries: an image that size, imported into every node's containerd, does not fit this machine. The Dockerfile's image has it (the GPU checks and
  the training pods need it). Keyed by the dependencies and the checkout's sources: rebuilt when either changes,
  but only its second layer when only the sources did.

The cache key is the recipe (suite, packages, the tool's version), not the mirror's state on the day: a
rebuild on another day may hold newer Debian point releases of the same packages, as a Dockerfile's
``apt-get install`` would.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from controlplane import components

DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
"""Python 3.11 (bookworm's, the ABI unbroken's venv is built for)."""
REPOSITORY = Path(__file__).resolve().parents[2]
"""The checkout whose unbroken goes into ``unbroken_image()``."""
NOT_IN_THE_IMAGE = ("torch",)
"""unbroken's dependencies the test image leaves out (see the module's docstring)."""
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


def _run(command: list[str]) -> None:
    """``command``, or an ImageError with its exit status and the end of its stderr."""
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise ImageError(f"`{' '.join(command)}` failed ({result.returncode}): {result.stderr.strip()[-2000:]}")


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
    """The cached image ``name`` at ``key``, built first by ``build(staging, ref)`` if absent (``_cached``)."""
    return Image(ref, _cached(name, key, lambda staging: build(staging, ref), "image.tar"))


def _cached(name: str, key: str, build: Callable[[Path], None], product: str) -> Path:
    """``name-key/product`` in the cache, built first by ``build(staging)`` if absent, in a staging folder renamed
    into place with ``product`` in it: a build killed half-way leaves nothing that looks built."""
    target = cache_root() / f"{name}-{key}"
    if not (target / product).exists():
        staging = target.with_name(target.name + ".building")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        build(staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        _forget_older(name, keep=target)
    return target / product


STALE_AFTER_S = 3600.0
"""An image of an older recipe unused this long is deleted when a new one is built (unbroken's changes with every edit
of the sources: ~200 MB each); younger ones may still be in use by another checkout's run."""


def _forget_older(name: str, keep: Path) -> None:
    for other in cache_root().glob(f"{name}-*"):
        # ``name-<key>`` exactly: "unbroken-*" also matches the cache of "unbroken-dependencies"
        if other != keep and other.is_dir() and re.fullmatch(rf"{re.escape(name)}-[0-9a-f]{{12}}", other.name) \
                and time.time() - other.stat().st_mtime > STALE_AFTER_S:
            shutil.rmtree(other, ignore_errors=True)


def pause_image() -> Image:
    """The sandbox image: ``/pause``, waiting for SIGTERM, named ``PAUSE_REF``."""
    def build(staging: Path, ref: str) -> None:
        layer = staging / "layer.tar"
        with tarfile.open(layer, "w") as tar:
            tar.add(components.IMAGE_TOOLS.binary("pause"), arcname="pause")
        _imagetool([layer], ref, staging / "image.tar", entrypoint="/pause")
        layer.unlink()

    return _built("pause", _key("pause", "/pause"), PAUSE_REF, build)


def _debian(rootfs: Path, hooks: tuple[str, ...] = ()) -> None:
    """``BASE_PACKAGES`` on Debian's minbase, with the ``nonroot`` user, then ``hooks`` (mmdebstrap customize hooks:
    shell with the root filesystem in ``$1``), written as a tarball at ``rootfs``."""
    if shutil.which("mmdebstrap") is None:
        raise ImageError("mmdebstrap is not installed (`make test` installs it: apt-get install mmdebstrap)")
    nonroot = (f'echo "nonroot:x:{NONROOT_UID}:{NONROOT_UID}:nonroot:/home/nonroot:/usr/sbin/nologin" >> "$1/etc/passwd"'
               f' && echo "nonroot:x:{NONROOT_UID}:" >> "$1/etc/group"'
               f' && mkdir -p "$1/home/nonroot" && chown {NONROOT_UID}:{NONROOT_UID} "$1/home/nonroot"')
    command = ["mmdebstrap", "--quiet", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
               "--customize-hook", nonroot]
    for hook in hooks:
        command += ["--customize-hook", hook]
    command += ["--customize-hook", 'rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/*', DEBIAN_SUITE, str(rootfs), DEBIAN_MIRROR]
    _run(command)


BASE_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8")


def base_image() -> Image:
    """Debian with Python 3.11 (``BASE_PACKAGES``) and a ``nonroot`` user (65532, as distroless images have), one
    layer."""
    key = _key("base", DEBIAN_SUITE, DEBIAN_MIRROR, *BASE_PACKAGES)

    def build(staging: Path, ref: str) -> None:
        rootfs = staging / "rootfs.tar"
        _debian(rootfs)
        _imagetool([rootfs], ref, staging / "image.tar", env=BASE_ENV)
        rootfs.unlink()

    return _built("debian-python", key, f"unbroken.test/debian-python:{key}", build)


BUSYBOX_APPLETS = ("sh", "nslookup", "grep", "seq", "echo", "sleep", "cat", "ls")
"""What training-operator's init container runs (a loop of ``nslookup`` until the master's name resolves), and a few more."""


def busybox_image() -> Image:
    """Debian's static busybox as ``/bin/busybox`` and its ``BUSYBOX_APPLETS``: the image of the init container
    training-operator puts in a PyTorchJob's worker pods (``ControlPlane(init_image=...)``)."""
    def build(staging: Path, ref: str) -> None:
        download = subprocess.run(["apt-get", "download", "busybox-static"], cwd=staging, capture_output=True, text=True)
        debs = list(staging.glob("busybox-static_*.deb"))
        if download.returncode or not debs:
            raise ImageError(f"apt-get download busybox-static failed ({download.returncode}): {download.stderr.strip()}")
        root = staging / "root"
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(root)], check=True)
        layer = staging / "layer.tar"
        with tarfile.open(layer, "w") as tar:
            tar.add(root / "bin" / "busybox", arcname="bin/busybox")
            for applet in BUSYBOX_APPLETS:
                link = tarfile.TarInfo(f"bin/{applet}")
                link.type, link.linkname = tarfile.SYMTYPE, "busybox"
                tar.addfile(link)
        _imagetool([layer], ref, staging / "image.tar", env=BASE_ENV)
        layer.unlink()
        debs[0].unlink()
        shutil.rmtree(root)

    key = _key("busybox", "busybox-static", *BUSYBOX_APPLETS)
    return _built("busybox", key, f"unbroken.test/busybox:{key}", build)


def dependencies() -> list[str]:
    """unbroken's requirements (pyproject.toml) that go into the test image."""
    declared = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["project"]["dependencies"]
    return sorted(d for d in declared if not any(d.startswith(name) for name in NOT_IN_THE_IMAGE))


def _sources_digest() -> str:
    """What the checkout's unbroken is made of: pyproject.toml and every file under src/unbroken (caches left out)."""
    digest = hashlib.sha256((REPOSITORY / "pyproject.toml").read_bytes())
    for path in sorted((REPOSITORY / "src" / "unbroken").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(REPOSITORY)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _pip(*args: str) -> None:
    _run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet", *args])


def _wheelhouse(requirements: list[str]) -> Path:
    """Wheels of ``requirements`` and everything they need, for CPython 3.11 on Linux, from PyPI once, then cached."""
    folder = cache_root() / f"wheels-{_key('wheels', *requirements)}"
    if not (folder / "complete").exists():
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        _pip("download", "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp", "--platform",
             "manylinux2014_x86_64", "--platform", "manylinux_2_28_x86_64", "--dest", str(folder), *requirements)
        (folder / "complete").touch()
    return folder


VENV = "/opt/unbroken"
"""Where the Dockerfile's venv is, in the image."""


def _dependencies_layer(requirements: list[str]) -> Path:
    """The first of unbroken's image's two layers: Debian (``_debian``) with a venv at ``VENV`` holding
    ``requirements`` and nothing of this checkout, as one gzipped tarball (~195 MB). Keyed by the recipe and the
    requirements alone, so an edit of the sources reuses it (it is ~60 s of the ~85 s first build)."""
    key = _key("unbroken-dependencies", DEBIAN_SUITE, DEBIAN_MIRROR, *BASE_PACKAGES, *requirements)

    def build(staging: Path) -> None:
        wheels = staging / "wheels"
        shutil.copytree(_wheelhouse(requirements), wheels)
        (wheels / "complete").unlink()
        _debian(staging / "rootfs.tar", (
            f'cp -r "{wheels}" "$1/tmp/wheels"',
            f'chroot "$1" python3 -m venv {VENV}',
            # every wheel is one of the resolved set: no resolver, no index
            f'chroot "$1" sh -c "{VENV}/bin/pip install --quiet --no-index --no-deps /tmp/wheels/*.whl"',
            'rm -rf "$1/tmp/wheels" "$1/root/.cache"',
        ))
        shutil.rmtree(wheels)
        # compressed once here, not by every image built on it (imagetool takes a gzipped layer as it is)
        _run(["gzip", "-1", "-n", str(staging / "rootfs.tar")])

    return _cached("unbroken-dependencies", key, build, "rootfs.tar.gz")


def _installed_files(root: Path, distribution: str) -> list[str]:
    """The paths (relative to ``root``, parents first) of what pip installed of ``distribution`` into the venv, from
    its RECORD: the layer that adds them to the layer under it."""
    site = next((root / VENV.lstrip("/") / "lib").glob("python3*/site-packages"))
    record = next(site.glob(f"{distribution}-*.dist-info")) / "RECORD"
    files = {(site / line.split(",")[0]).resolve() for line in record.read_text().splitlines() if line.strip()}
    paths = set()
    for path in files:
        paths.add(path)
        parent = path.parent
        while parent != site and site in parent.parents:  # the package's own folders, with their modes
            paths.add(parent)
            parent = parent.parent
    return sorted(str(p.relative_to(root)) for p in paths)


def unbroken_image() -> Image:
    """unbroken's image (the Dockerfile's layout, without torch: see the module's docstring), named
    ``unbroken.test/unbroken:<key>``, in two layers: Debian and the venv with unbroken's dependencies
    (``_dependencies_layer``, cached on its own), then unbroken itself (a wheel of this checkout) installed into
    that venv, which is all an edit of the sources rebuilds (~25 s)."""
    requirements = dependencies()
    key = _key("unbroken", "two layers", DEBIAN_SUITE, DEBIAN_MIRROR, *BASE_PACKAGES, *requirements, _sources_digest())

    def build(staging: Path, ref: str) -> None:
        dependencies_layer = _dependencies_layer(requirements)
        root = staging / "root"
        root.mkdir()
        _run(["tar", "-xzf", str(dependencies_layer), "-C", str(root), "--numeric-owner"])
        _pip("wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(root / "tmp"), str(REPOSITORY))
        _run(["chroot", str(root), "sh", "-c", f"{VENV}/bin/pip install --quiet --no-index --no-deps /tmp/unbroken-*.whl"])
        _run(["chroot", str(root), f"{VENV}/bin/unbroken", "--help"])
        layer = staging / "unbroken.tar"
        _run(["tar", "-cf", str(layer), "-C", str(root), "--numeric-owner", "--no-recursion", "--",
              *_installed_files(root, "unbroken")])
        shutil.rmtree(root)
        _imagetool([dependencies_layer, layer], ref, staging / "image.tar",
                   env=(f"PATH={VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8",
                        "PYTHONUNBUFFERED=1", "PYTHONDONTWRITEBYTECODE=1"))
        layer.unlink()

    return _built("unbroken", key, f"unbroken.test/unbroken:{key}", build)
