"""Where a local cluster keeps its files, in one place.

    <dir>/state.db                         the store (SQLite, WAL)
    <dir>/cluster-ca.crt, cluster.{crt,key} the cluster's TLS credentials (checkpoint/node/credentials.py)
    <dir>/controller.{pid,log,lock}
    <dir>/nodes/<node>/agent.{pid,log}     one folder per node (its "disk")
    <dir>/nodes/<node>/kmsg.log            the node's kernel log (health monitor source; chaos xid)
    <dir>/logs/<job>/attempt-<k>/<node>/   torchrun.log + per-rank logs
    <dir>/checkpoints/<job>/               default checkpoint directory
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DIR_ENV = "UNBROKEN_DIR"
"""Where the CLI looks for the cluster when ``--dir`` is not given."""
CLUSTER_DIR = "UNBROKEN_CLUSTER_DIR"
"""Set in the environment of every process a cluster starts (agents, ranks, slowers): it is how
``plumbing/procs.py`` finds a cluster's processes, and how a rank finds its cluster's files."""


def default_cluster_dir() -> Path:
    return Path(os.environ.get(DIR_ENV) or ".unbroken")


@dataclass(frozen=True)
class ClusterLayout:
    root: Path

    @classmethod
    def at(cls, root: Path | str) -> "ClusterLayout":
        return cls(Path(root).resolve())

    @property
    def state_db(self) -> Path:
        return self.root / "state.db"

    @property
    def controller_pid(self) -> Path:
        return self.root / "controller.pid"

    @property
    def controller_log(self) -> Path:
        return self.root / "controller.log"

    @property
    def controller_doorbell(self) -> Path:
        """A named pipe: agents wake the controller through it (doorbell.py)."""
        return self.root / "controller.wake"

    @property
    def controller_lock(self) -> Path:
        return self.root / "controller.lock"

    def node_dir(self, node: str) -> Path:
        return self.root / "nodes" / node

    def agent_pid(self, node: str) -> Path:
        return self.node_dir(node) / "agent.pid"

    def agent_log(self, node: str) -> Path:
        return self.node_dir(node) / "agent.log"

    def kernel_log(self, node: str) -> Path:
        return self.node_dir(node) / "kmsg.log"

    @classmethod
    def of_node_dir(cls, node_dir: Path) -> "ClusterLayout":
        """The layout a node directory (``<dir>/nodes/<node>``) belongs to."""
        return cls.at(node_dir.parent.parent)

    def worker_log_dir(self, job: str, attempt: int, node: str) -> Path:
        return self.root / "logs" / job / f"attempt-{attempt}" / node

    def checkpoint_dir(self, job: str) -> Path:
        return self.root / "checkpoints" / job
