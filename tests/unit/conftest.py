"""Fixtures: shared-memory folders, a loopback S3, small mounts (checkpoint tiers); a real Kubernetes control plane
(etcd and kube-apiserver with the Kubeflow CRDs, tests/controlplane) per module."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from unbroken.checkpoint.node import credentials
from unbroken.checkpoint.node.credentials import Credentials
from controlplane.cluster import ControlPlane
from s3 import CREDENTIALS, MotoServer, moto_server


@pytest.fixture(scope="session")
def cluster_credentials(tmp_path_factory: pytest.TempPathFactory) -> Credentials:
    """One cluster's TLS credentials (a CA and the certificate every node holds), as ``cluster up`` makes them."""
    return credentials.create(tmp_path_factory.mktemp("credentials"), "test")


@pytest.fixture(scope="session")
def other_credentials(tmp_path_factory: pytest.TempPathFactory) -> Credentials:
    """Another cluster's: what a stranger, or a node of a cluster next door, holds."""
    return credentials.create(tmp_path_factory.mktemp("other-credentials"), "other")


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A fresh folder in /dev/shm (the memory tier's home), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="unbroken-test-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def mount_tmpfs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """``mount_tmpfs("small", size="1m", read_only=False)``: a real tmpfs, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted: list[Path] = []

    def mount(name: str, *, size: str = "1m", read_only: bool = False) -> Path:
        target = tmp_path / name
        target.mkdir()
        options = f"size={size}" + (",ro" if read_only else "")
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)], check=True)
        mounted.append(target)
        return target

    yield mount
    for target in reversed(mounted):
        subprocess.run(["umount", str(target)], check=True)


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """One moto S3 server per test module (it takes a second to start); tests use their own bucket."""
    with moto_server(tmp_path_factory.mktemp("moto")) as server:
        yield server


@dataclass(frozen=True)
class Bucket:
    name: str
    server: MotoServer
    client: object
    """A boto3 S3 client for the test to inspect or break the bucket."""


@pytest.fixture
def s3_bucket(moto: MotoServer, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    """A new, empty bucket; the AWS variables point every S3 client of this process at moto."""
    import boto3

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.endpoint)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    client = boto3.client("s3", endpoint_url=moto.endpoint, region_name="us-east-1")
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    return Bucket(name, moto, client)


@pytest.fixture(scope="module")
def k8s(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A real control plane for one test module: etcd, kube-apiserver (RBAC), the controller-manager and the
    scheduler, with the Kubeflow CRDs installed and no Kubeflow controller and no kubelet (~5 s to start)."""
    with ControlPlane(tmp_path_factory.mktemp("k8s"), kubeflow=False, crds=True) as plane:
        yield plane


@pytest.fixture(scope="module")
def kubeconfig(k8s: ControlPlane) -> Path:
    """The admin's kubeconfig (group ``system:masters``)."""
    return k8s.kubeconfig


@pytest.fixture
def namespace(k8s: ControlPlane) -> str:
    """A fresh namespace in the module's control plane, so that tests sharing it do not see each other's objects."""
    return k8s.create_namespace(f"t-{uuid.uuid4().hex[:8]}")
