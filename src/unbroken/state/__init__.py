"""Shared state: records, lifecycles, the store protocols (cluster store, checkpoint catalog, worker table)."""

from unbroken.state.phases import DeepHealthStatus, JobPhase, NodeState, WorkerPhase
from unbroken.state.catalog import CheckpointCatalog
from unbroken.state.records import Desired, Event, EventType, Job, Node, RankInfo, Worker
from unbroken.state.store import ClusterStore, StaleUpdate
from unbroken.state.worker_table import WorkerTable

__all__ = [
    "CheckpointCatalog",
    "ClusterStore",
    "DeepHealthStatus",
    "Desired",
    "Event",
    "EventType",
    "Job",
    "JobPhase",
    "Node",
    "NodeState",
    "RankInfo",
    "StaleUpdate",
    "Worker",
    "WorkerPhase",
    "WorkerTable",
]
