"""The local backend: every node is an agent process on this machine, every worker a row its agent runs.

Agents and the controller run detached (their own session) with logs and pid
files under the cluster directory, and ``UNBROKEN_CLUSTER_DIR`` +
``UNBROKEN_NODE`` in their environment, which every process they start
inherits. That environment tag is how ``stop_node`` and ``cluster down`` find
every process of a node or cluster, orphans included.

Attempts are rows in the :class:`~unbroken.state.worker_table.WorkerTable`, one
per node: the controller's "run attempt 3 on node-1, node-4" becomes two
Pending rows with ``desired=Run``; each node's agent launches ``torchrun`` for
its row and reports its phase and exit, as a kubelet does for its pods.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from unbroken.plumbing import procs
from unbroken.rank import registry as rank_registry
from unbroken.plumbing.ports import free_port
from unbroken.backends.local import netns_launch
from unbroken.backends.base import AttemptWait
from unbroken.config.cluster import ClusterConfig
from unbroken.errors import BackendError, ConflictError
from unbroken.rank.env import CLUSTER_DIR, NODE
from unbroken.plumbing.layout import ClusterLayout
from unbroken.state.phases import DeepHealthStatus, NodeState, WorkerPhase
from unbroken.state.records import ClusterStatus, Desired, Job, Node, Worker
from unbroken.state.store import ClusterStore
from unbroken.state.updates import NodeUpdate, WorkerUpdate
from unbroken.state.worker_table import WorkerTable

_NODE_NUMBER = re.compile(r"^node-(\d+)$")


@dataclass(frozen=True)
class RankProcess:
    """A rank found in a worker's process tree (what chaos hits)."""

    rank: int
    local_rank: int
    pid: int


class LocalBackend:
    places_workers = False
    """unbroken places the workers, one job's per node (backends/base.py)."""

    def __init__(self, layout: ClusterLayout, store: ClusterStore, workers: WorkerTable, config: ClusterConfig) -> None:
        self.layout = layout
        self.store = store
        self.workers = workers
        self.config = config

    def held(self, job: str) -> str | None:
        return None  # nothing but unbroken starts a local job

    def attempt_waits_for(self, job: str, attempt: int) -> AttemptWait | None:
        return None  # the agents start the worker rows they are given; a dead agent is a lost node

    def nudge_attempt(self, job: str, attempt: int) -> None:
        pass  # the worker rows are the launch: there is nothing a controller could have missed

    # -- nodes ----------------------------------------------------------------------

    def provision_node(self, group: str) -> str:
        """Add a new node (``node-<n>``, never a reused name) to ``group`` and start its agent.

        Refused once the cluster is no longer Up: ``cluster down`` fences provisioning
        first, so a replacement decided a moment before cannot outlive it.
        """
        self._fence()
        spec = self.config.group(group)
        while True:
            name = f"node-{self._next_node_number()}"
            try:
                self.store.add_node(Node(
                    name=name, group=group, instance_type=spec.InstanceType, state=NodeState.JOINING,
                    deep_health=DeepHealthStatus.IN_PROGRESS, state_changed_at=time.time(),
                ))
                break
            except ConflictError:
                continue  # someone took that number between our read and our write
        self.store.add_event("Node", name, "NodeProvisioned", f"added to instance group {group} ({spec.InstanceType})")
        self.start_node(name)
        return name

    def start_node(self, name: str) -> None:
        self._fence()
        node_dir = self.layout.node_dir(name)
        node_dir.mkdir(parents=True, exist_ok=True)
        prefix, env, address = netns_launch.prepare(self.layout, self.config, name, self._env(node=name))
        if address is not None:
            self.store.update_node(name, NodeUpdate(address=address))
        pid = _spawn(
            [*prefix, sys.executable, "-m", "unbroken.agent", "--dir", str(self.layout.root), "--node", name],
            log=self.layout.agent_log(name), env=env,
        )
        _write_pid(self.layout.agent_pid(name), pid)

    def stop_node(self, name: str) -> None:
        """Hard stop: SIGKILL the agent and everything of the node in one sweep."""
        procs.kill_now(self.node_processes(name))
        procs.wait_gone(self.node_processes(name), 5.0)

    def reboot_node(self, node: Node) -> None:
        self.stop_node(node.name)
        self.start_node(node.name)

    def replace_node(self, node: Node) -> str | None:
        self.stop_node(node.name)
        return self.provision_node(node.group)

    def node_processes(self, name: str) -> list[psutil.Process]:
        members = procs.tree(_read_pid(self.layout.agent_pid(name)) or 0)
        tagged = [p for p in procs.cluster_processes(self.layout.root) if procs.environ(p).get(NODE) == name]
        seen = {p.pid for p in members}
        return members + [p for p in tagged if p.pid not in seen]

    def _next_node_number(self) -> int:
        numbers = [int(m.group(1)) for n in self.store.list_nodes() if (m := _NODE_NUMBER.match(n.name))]
        return max(numbers, default=0) + 1

    def _fence(self) -> None:
        status = self.store.cluster().status
        if status is not ClusterStatus.UP:
            raise BackendError(f"cluster in {self.layout.root} is {status.value}: not starting nodes")

    # -- attempts -------------------------------------------------------------------

    def launch_attempt(self, job: Job, attempt: int, placement: Sequence[Node]) -> str:
        existing = self.workers.list_workers(job=job.name, attempt=attempt)
        if existing:
            return existing[0].rdzv_endpoint
        first = placement[0]
        endpoint = f"{first.address}:{free_port(first.address)}"
        now = time.time()
        self.workers.add_workers([
            Worker(job=job.name, attempt=attempt, node=node.name, node_rank=rank, desired=Desired.RUN,
                   phase=WorkerPhase.PENDING, rdzv_endpoint=endpoint, created_at=now)
            for rank, node in enumerate(placement)
        ])
        return endpoint

    def stop_attempt(self, job: str, attempt: int, *, hold: Collection[str] = ()) -> None:
        for worker in self.workers.list_workers(job=job, attempt=attempt, active=True):
            desired = Desired.HOLD if worker.node in hold else Desired.STOP
            if worker.desired is not desired and worker.desired is not Desired.STOP:  # a stop is never taken back
                self.workers.update_worker(worker.id, WorkerUpdate(desired=desired))

    def observe_attempt(self, job: str, attempt: int) -> list[Worker]:
        return self.workers.list_workers(job=job, attempt=attempt)

    def active_workers(self) -> list[Worker]:
        return self.workers.list_workers(active=True)

    def worker_history(self, job: str) -> list[Worker]:
        return self.workers.list_workers(job=job)

    def progress_history(self, job: str) -> list[tuple[int, float, int]]:
        return self.workers.progress_samples(job)

    def release_workers(self, node: Node, reason: str) -> None:
        for worker in self.workers.list_workers(node=node.name, active=True):
            self.workers.update_worker(worker.id, WorkerUpdate(
                phase=WorkerPhase.STOPPED, desired=Desired.STOP, ended_at=time.time(), message=reason))

    def rank_processes(self, worker: Worker) -> list[RankProcess]:
        """The worker's rank processes, from its process tree: whatever the script does,
        torchrun gives each rank ``RANK`` and ``LOCAL_RANK``, or, for a warm spare's forked
        ranks, they register in the worker's log folder (rank/registry.py). Processes a rank
        starts (data loader workers) may inherit them; only the topmost one per rank counts."""
        registry = Path(worker.log_dir) / "ranks" if worker.log_dir else None

        def identify(proc: psutil.Process) -> rank_registry.RankIdentity | None:
            return rank_registry.identify(proc.pid, procs.environ(proc), registry)

        found: dict[int, RankProcess] = {}
        for proc in procs.tree(worker.pid or 0):
            identity = identify(proc)
            if identity is None:
                continue
            try:
                parent = proc.parent()
            except psutil.Error:
                parent = None
            if parent is not None and identify(parent) is not None:
                continue
            found[identity.rank] = RankProcess(identity.rank, identity.local_rank, proc.pid)
        return [found[r] for r in sorted(found)]

    # -- the controller and the whole cluster ---------------------------------------

    def start_controller(self) -> int:
        pid = _spawn(
            [sys.executable, "-m", "unbroken.controller", "--dir", str(self.layout.root)],
            log=self.layout.controller_log, env=self._env(node=None),
        )
        _write_pid(self.layout.controller_pid, pid)
        return pid

    def controller_pid(self) -> int | None:
        pid = _read_pid(self.layout.controller_pid)
        return pid if procs.alive(pid) else None

    def stop_cluster(self, timeout: float = 10.0) -> list[int]:
        """SIGKILL every process of the cluster; returns the pids still alive (should be none).

        The controller goes first and is waited for: it is the one process that
        starts agents. Then every process tagged with the cluster is killed, and
        the sweep repeats until a scan finds none: a process forked in the middle
        of a sweep (an agent starting ``torchrun``, a replacement agent mid-exec)
        shows up in the next scan, and its parent is dead by then.
        """
        controller = self.controller_pid()
        if controller:
            victims = procs.tree(controller)
            procs.kill_now(victims)
            procs.wait_gone(victims, timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            members = procs.cluster_processes(self.layout.root)
            if not members:
                return []
            procs.kill_now(members)
            procs.wait_gone(members, max(0.1, deadline - time.monotonic()))
        return [p.pid for p in procs.cluster_processes(self.layout.root)]

    def _env(self, *, node: str | None) -> dict[str, str]:
        env = {**os.environ, CLUSTER_DIR: str(self.layout.root), "PYTHONUNBUFFERED": "1"}
        if node:
            env[NODE] = node
        else:
            env.pop(NODE, None)
        return env


def _spawn(argv: list[str], *, log: Path, env: dict[str, str]) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        process = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
    return process.pid


def _write_pid(path: Path, pid: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{pid}\n")
    os.replace(tmp, path)


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None
