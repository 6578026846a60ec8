"""Test helpers: run the real CLI, poll for conditions (never sleep to synchronise)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from unbroken.checkpoint.node.credentials import Credentials
from unbroken.controller.jobs import current_step
from unbroken.plumbing.layout import ClusterLayout
from unbroken.runtime import Runtime, open_local
from unbroken.state.records import Worker
from unbroken.state.sqlite import SqliteStore
from unbroken.plumbing.waiting import wait_until

T = TypeVar("T")

STEPS = 60
"""Steps of the integration tests' MLP jobs (and of their reference run)."""


def free_port() -> int:
    """A loopback port nothing listens on now (a rendezvous endpoint; its owner binds it right after)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def tls_handshake(server: Credentials, client: Credentials) -> None:
    """Mutual TLS between the two over a real socket pair: raises if either refuses the other."""
    left, right = socket.socketpair()
    failures: list[BaseException] = []

    def serve() -> None:
        try:
            with server.server_context().wrap_socket(left, server_side=True) as tls:
                tls.sendall(b"ok")
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            failures.append(exc)

    thread = threading.Thread(target=serve)
    thread.start()
    with client.client_context().wrap_socket(right) as tls:
        assert tls.recv(2) == b"ok"
    thread.join(10)
    assert not failures, failures


def race(count: int, contender: Callable[[int], None], timeout: float = 30) -> list[BaseException]:
    """Run ``contender(0..count-1)`` on ``count`` threads released together by a barrier (the closest
    start a test can make); returns what they raised, so the test asserts on it."""
    errors: list[BaseException] = []
    start = threading.Barrier(count)

    def run(i: int) -> None:
        try:
            start.wait()
            contender(i)
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(t.is_alive() for t in threads), f"a contender still runs after {timeout:g} s"
    return errors


def assert_same_parameters(a: Path, b: Path) -> None:
    import torch

    left, right = torch.load(a), torch.load(b)
    assert left.keys() == right.keys()
    for key in left:
        assert torch.equal(left[key], right[key]), f"parameter {key} differs"


def run_cli(*args: str, cluster_dir: Path | None = None, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    if cluster_dir is not None:
        env["UNBROKEN_DIR"] = str(cluster_dir)
    result = subprocess.run([sys.executable, "-m", "unbroken", *args], capture_output=True, text=True, env=env, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"unbroken {' '.join(args)} exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    return result


@dataclass
class Cluster:
    dir: Path

    @property
    def runtime(self) -> Runtime:
        return open_local(self.layout)

    @property
    def store(self) -> SqliteStore:
        """The local cluster's one SQLite file: its cluster store, catalog and worker table."""
        store = self.runtime.cluster
        assert isinstance(store, SqliteStore)
        return store

    def workers(self, job: str, attempt: int | None = None) -> list[Worker]:
        backend = self.runtime.backend
        return backend.worker_history(job) if attempt is None else backend.observe_attempt(job, attempt)

    @property
    def layout(self) -> ClusterLayout:
        return ClusterLayout.at(self.dir)

    def cli(self, *args: str, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return run_cli(*args, cluster_dir=self.dir, check=check, timeout=timeout)

    def json(self, *args: str) -> Any:
        return json.loads(self.cli(*args, "-o", "json").stdout)

    def job(self, name: str):
        return self.store.get_job(name)

    def step(self, name: str) -> int:
        job = self.store.get_job(name)
        return current_step(self.workers(name, job.attempt))

    def wait_job_phase(self, name: str, phases: set[str], timeout: float):
        return wait_until(lambda: (j := self.job(name)).phase.value in phases and j, timeout, f"job {name} in {phases}")

    def wait_step(self, name: str, step: int, timeout: float, attempt: int = 0) -> int:
        def reached() -> int:
            job = self.job(name)
            if job.phase.is_terminal:
                raise AssertionError(f"job {name} ended {job.phase.value} before step {step}: {job.reason}")
            if job.attempt != attempt:
                return 0
            return self.step(name) >= step and self.step(name)
        return wait_until(reached, timeout, f"job {name} attempt {attempt} at step >= {step}")

    def wait_for_replicas(self, job: str, node: str, timeout: float = 60) -> None:
        """Until every shard ``node`` holds of the newest committed memory step has a replica elsewhere."""
        from unbroken.state.records import CheckpointTier

        def replicated() -> bool:
            copies = self.store.list_shard_copies(job)
            mine = {(c.step, c.rank) for c in copies if c.tier is CheckpointTier.MEMORY and c.node == node}
            held = {(c.step, c.rank) for c in copies if c.tier is CheckpointTier.REPLICA and c.node != node}
            return bool(mine) and bool(mine & held) and max(mine) in held
        wait_until(replicated, timeout, f"replicas of {node}'s shards of {job}")

    def submit(self, tmp: Path, name: str, *, steps: int, nodes: int = 2, procs: int = 2, checkpoint_every: int = 10,
               step_time: float = 0.02, extra_args: list[str] | None = None, checkpoint: dict[str, Any] | None = None,
               **resilience: Any) -> Path:
        output = tmp / f"{name}.params.pt"
        spec = {
            "name": name, "nodes": nodes, "procs_per_node": procs,
            "command": ["-m", "unbroken.workloads.mlp", "--steps", str(steps), "--checkpoint-every", str(checkpoint_every),
                        "--step-time", str(step_time), "--output", str(output), *(extra_args or [])],
            "resilience": {"auto_resume": True, "max_retry": 3, "hang_timeout": 60, **resilience},
            "checkpoint": checkpoint if checkpoint is not None else {"dir": str(tmp / f"{name}-ckpt")},
        }
        job_file = tmp / f"{name}.yaml"
        job_file.write_text(yaml.safe_dump(spec))
        self.cli("job", "start", "-f", str(job_file))
        return output
