"""The Kubernetes control plane under the end-to-end tests: which components, at which versions, built how.

Each component is a small Go module beside this file (its own ``go.mod``/``go.sum``, so versions are
pinned and reproducible) whose ``tool`` directives (or ``main.go``) name the commands to build. The
binaries land in a cache outside the clone, one folder per component and version
(``~/.cache/unbroken/control-plane/kubernetes-v1.35.4/kube-apiserver``), so that a fresh clone on a
machine that built them once reuses them; ``$UNBROKEN_CONTROL_PLANE_CACHE`` moves the cache.

Files a component needs at run time that live in its Go module (the Kubeflow CRDs) are copied into the
same folder by the build, so running the tests needs no Go and no module cache.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Component:
    name: str
    """The Go module's folder beside this file, and the first part of the cache folder's name."""
    version: str
    """The pinned version of what is built (the cache key): bump it together with the module's go.mod."""
    packages: tuple[str, ...]
    """Go packages to build (``.`` for the module's own main package)."""
    binaries: tuple[str, ...]
    """What the build leaves in the cache folder, in the order of ``packages``."""
    ldflags: tuple[str, ...] = ()
    data: tuple[tuple[str, str, str], ...] = field(default=())
    """(Go module@version, folder inside it, name): that folder's ``*.yaml`` files (not kustomizations),
    copied to ``<cache folder>/<name>/``."""
    tags: tuple[str, ...] = ()
    """Go build tags."""
    module: str = ""
    """The Go module's folder beside this file, where it is not ``name`` (the kubelet is built from the
    control plane's Kubernetes module, so that both are the same release by construction)."""

    @property
    def module_dir(self) -> Path:
        return HERE / (self.module or self.name)

    @property
    def directory(self) -> Path:
        return cache_root() / f"{self.name}-{self.version}"

    def binary(self, name: str) -> Path:
        return self.directory / name

    def is_built(self) -> bool:
        return (self.directory / ".complete").exists()


def cache_root() -> Path:
    configured = os.environ.get("UNBROKEN_CONTROL_PLANE_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "unbroken" / "control-plane"


def _kubernetes_version_flags(version: str) -> tuple[str, ...]:
    """``/version`` and the components' ``--version`` report the real release, not ``v0.0.0-master``."""
    major, minor, _ = version.removeprefix("v").split(".")
    flags = []
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [f"-X {package}.gitVersion={version}", f"-X {package}.gitMajor={major}",
                  f"-X {package}.gitMinor={minor}", f"-X {package}.gitTreeState=clean"]
    return tuple(flags)


KUBERNETES_VERSION = "v1.35.4"

ETCD = Component("etcd", "v3.6.16", (".",), ("etcd",))
KUBERNETES = Component(
    "kubernetes", KUBERNETES_VERSION,
    ("k8s.io/kubernetes/cmd/kube-apiserver", "k8s.io/kubernetes/cmd/kube-controller-manager",
     "k8s.io/kubernetes/cmd/kube-scheduler"),
    ("kube-apiserver", "kube-controller-manager", "kube-scheduler"),
    ldflags=_kubernetes_version_flags(KUBERNETES_VERSION))
TRAINING_OPERATOR = Component(
    "training-operator", "v1.9.3", ("github.com/kubeflow/training-operator/cmd/training-operator.v1",),
    ("training-operator",),
    data=(("github.com/kubeflow/training-operator@v1.9.3", "manifests/base/crds", "crds"),
          ("github.com/kubeflow/training-operator@v1.9.3", "manifests/base/webhook", "webhook")))
TRAINER = Component(
    "trainer", "v2.3.0", ("github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager", "sigs.k8s.io/jobset"),
    ("trainer-controller-manager", "jobset"),
    data=(("github.com/kubeflow/trainer/v2@v2.3.0", "manifests/base/crds", "trainer-crds"),
          ("github.com/kubeflow/trainer/v2@v2.3.0", "manifests/base/webhook", "trainer-webhook"),
          ("github.com/kubeflow/trainer/v2@v2.3.0", "manifests/base/runtimes", "trainer-runtimes"),
          ("github.com/kubeflow/trainer/v2@v2.3.0", "manifests/base/manager", "trainer-manager"),
          ("sigs.k8s.io/jobset@v0.12.0", "config/components/crd/bases", "jobset-crds"),
          ("sigs.k8s.io/jobset@v0.12.0", "config/components/webhook", "jobset-webhook")))

KUEUE = Component(
    "kueue", "v0.17.0", ("sigs.k8s.io/kueue/cmd/kueue",), ("kueue",),
    data=(("sigs.k8s.io/kueue@v0.17.0", "config/components/crd/bases", "crds"),
          ("sigs.k8s.io/kueue@v0.17.0", "config/components/webhook", "webhook")))

# A real node (tests/controlplane/node.py): the kubelet, containerd with its runc shim and ctr, and the
# tools that write the nodes' images. runc and the CNI plugins are Debian's (the Makefile installs them).
KUBELET = Component("kubelet", KUBERNETES_VERSION,
                    ("k8s.io/kubernetes/cmd/kubelet", "k8s.io/kubernetes/cmd/kube-proxy", "./fake-gpu-plugin"),
                    ("kubelet", "kube-proxy", "fake-gpu-plugin"), ldflags=_kubernetes_version_flags(KUBERNETES_VERSION),
                    module="kubernetes")
CONTAINERD_VERSION = "v2.4.2"
CONTAINERD = Component(
    "containerd", CONTAINERD_VERSION,
    tuple(f"github.com/containerd/containerd/v2/cmd/{c}" for c in ("containerd", "containerd-shim-runc-v2", "ctr")),
    ("containerd", "containerd-shim-runc-v2", "ctr"),
    ldflags=(f"-X github.com/containerd/containerd/v2/version.Version={CONTAINERD_VERSION}",),
    # the snapshotters that need C libraries or kernel features this machine lacks are left out
    tags=("no_btrfs", "no_devmapper", "no_zfs"))
IMAGE_TOOLS = Component("image-tools", "v1", (".", "./pause"), ("imagetool", "pause"))
"""Bump the version with any change to image-tools/**.go: the cache is keyed by it."""

COREDNS = Component("coredns", "v1.13.2", (".",), ("coredns",))
"""The cluster DNS: CoreDNS with the kubernetes plugin (coredns/main.go)."""

NODE = (KUBELET, CONTAINERD, IMAGE_TOOLS, COREDNS)

ALL = (ETCD, KUBERNETES, TRAINING_OPERATOR, TRAINER, KUEUE, *NODE)
