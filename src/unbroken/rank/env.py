"""Environment variables the agent sets for a job's ranks (on top of torchrun's).

One place for the names, read by :mod:`unbroken.train` and written by the
agent's launcher, so the two sides cannot drift apart.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from unbroken.plumbing.layout import CLUSTER_DIR

NODE = "UNBROKEN_NODE"
JOB = "UNBROKEN_JOB"
ATTEMPT = "UNBROKEN_ATTEMPT"
CHECKPOINT_DIR = "UNBROKEN_CHECKPOINT_DIR"
CHECKPOINT_KEEP = "UNBROKEN_CHECKPOINT_KEEP"
CHECKPOINT_TIERS = "UNBROKEN_CHECKPOINT_TIERS"
"""The job's tier policy as JSON; set only when the job file declares tiers."""
CHECKPOINT_ENDPOINT = "UNBROKEN_CHECKPOINT_ENDPOINT"
"""The local agent's shard server, ``host:port``."""
AGENT_SOCKET = "UNBROKEN_AGENT_SOCKET"
"""The node agent's socket file (``channel.py``): where ``ctx.progress`` goes."""
SHM_BASE = "UNBROKEN_SHM_BASE"
"""Where the memory tier's folders are (default ``/dev/shm``); agent and ranks must agree."""
REJOIN_DIR = "UNBROKEN_REJOIN_DIR"
"""Set for a job with in-process restarts: the worker's handshake folder with its agent (rejoin.py)."""
GROUP_RANK = "UNBROKEN_GROUP_RANK"
NNODES = "UNBROKEN_NNODES"
RENDEZVOUS = "UNBROKEN_RENDEZVOUS"
"""With in-process restarts, the attempt's store ``host:port`` (hosted by global rank 0), this node's
rank among ``UNBROKEN_NNODES``: torchrun runs each node on its own, so its RANK is node-local."""
COLLECTIVE_TIMEOUT = "UNBROKEN_COLLECTIVE_TIMEOUT"
ROUND = "UNBROKEN_ROUND"
"""Set by ``unbroken run`` in a pod: the in-place restart round the ranks start in (rejoin.py); absent: the attempt."""
ENDPOINT_FILE = "checkpoint-endpoint"
"""Beside the agent's socket on Kubernetes: the shard server's ``host:port``, written by the agent
(a pod's env is fixed when it starts; the agent's port is not known then)."""


@dataclass(frozen=True)
class GroupPlacement:
    """Where a worker of a job with in-process restarts stands in its attempt, and how its ranks talk to its agent."""

    group_rank: int
    nnodes: int
    rendezvous: str
    rejoin_dir: Path
    collective_timeout: float
    round: int | None = None
    """The rejoin handshake's round (rejoin.py); None: the attempt (the local agent's rounds are its attempts)."""

    def to_environ(self) -> dict[str, str]:
        env = {GROUP_RANK: str(self.group_rank), NNODES: str(self.nnodes), RENDEZVOUS: self.rendezvous,
               REJOIN_DIR: str(self.rejoin_dir), COLLECTIVE_TIMEOUT: f"{self.collective_timeout:g}"}
        if self.round is not None:
            env[ROUND] = str(self.round)
        return env

    def rank_environ(self, local_rank: int, local_world_size: int) -> dict[str, str]:
        """torch.distributed's variables for a rank of this group (torchrun's own are node-local here).
        Global rank 0 hosts the store at ``rendezvous``."""
        host, port = self.rendezvous.rsplit(":", 1)
        return {"RANK": str(self.group_rank * local_world_size + local_rank), "WORLD_SIZE": str(self.nnodes * local_world_size),
                "GROUP_RANK": str(self.group_rank), "GROUP_WORLD_SIZE": str(self.nnodes), "MASTER_ADDR": host, "MASTER_PORT": port,
                # the ranks' own store, not their (node-local) torchrun's
                "TORCHELASTIC_USE_AGENT_STORE": "False"}

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> GroupPlacement | None:
        if not env.get(REJOIN_DIR):
            return None
        return cls(group_rank=int(env[GROUP_RANK]), nnodes=int(env[NNODES]), rendezvous=env[RENDEZVOUS],
                   rejoin_dir=Path(env[REJOIN_DIR]), collective_timeout=float(env[COLLECTIVE_TIMEOUT]),
                   round=int(env[ROUND]) if env.get(ROUND) else None)


@dataclass(frozen=True)
class LaunchEnv:
    """What a rank learns about its job; every field has a plain-torchrun fallback."""

    cluster_dir: Path | None
    node: str
    job: str
    attempt: int
    checkpoint_dir: Path | None
    checkpoint_keep: int
    checkpoint_tiers: str | None = None
    checkpoint_endpoint: str | None = None
    agent_socket: Path | None = None
    group: GroupPlacement | None = None
    """Set for a job with in-process restarts (the ranks form their process group themselves)."""

    @property
    def advertised_endpoint(self) -> str | None:
        """``checkpoint_endpoint``, else what the agent wrote beside its socket (Kubernetes), else None."""
        if self.checkpoint_endpoint or self.agent_socket is None:
            return self.checkpoint_endpoint
        try:
            return (self.agent_socket.parent / ENDPOINT_FILE).read_text().strip() or None
        except OSError:
            return None

    @property
    def managed(self) -> bool:
        """Launched by an unbroken agent (as opposed to plain torchrun or python)."""
        return self.cluster_dir is not None

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> "LaunchEnv":
        env = os.environ if environ is None else environ
        cluster_dir = env.get(CLUSTER_DIR)
        checkpoint_dir = env.get(CHECKPOINT_DIR)
        return cls(
            cluster_dir=Path(cluster_dir) if cluster_dir else None,
            node=env.get(NODE) or os.uname().nodename,
            job=env.get(JOB) or env.get("TORCHELASTIC_RUN_ID") or "local",
            attempt=int(env.get(ATTEMPT) or "0"),  # empty: a pod whose attempt annotation is not set yet
            checkpoint_dir=Path(checkpoint_dir) if checkpoint_dir else None,
            checkpoint_keep=int(env.get(CHECKPOINT_KEEP, "2")),
            checkpoint_tiers=env.get(CHECKPOINT_TIERS) or None,
            checkpoint_endpoint=env.get(CHECKPOINT_ENDPOINT) or None,
            agent_socket=Path(env[AGENT_SOCKET]) if env.get(AGENT_SOCKET) else None,
            group=GroupPlacement.from_environ(env),
        )

    def to_environ(self) -> dict[str, str]:
        env = {NODE: self.node, JOB: self.job, ATTEMPT: str(self.attempt), CHECKPOINT_KEEP: str(self.checkpoint_keep)}
        if self.cluster_dir is not None:
            env[CLUSTER_DIR] = str(self.cluster_dir)
        if self.checkpoint_dir is not None:
            env[CHECKPOINT_DIR] = str(self.checkpoint_dir)
        if self.checkpoint_tiers is not None:
            env[CHECKPOINT_TIERS] = self.checkpoint_tiers
        if self.checkpoint_endpoint is not None:
            env[CHECKPOINT_ENDPOINT] = self.checkpoint_endpoint
        if self.agent_socket is not None:
            env[AGENT_SOCKET] = str(self.agent_socket)
        if self.group is not None:
            env.update(self.group.to_environ())
        return env
