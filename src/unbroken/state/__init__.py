"""Shared state: records, lifecycles, the Store protocol and its SQLite implementation."""

from unbroken.state.phases import DeepHealthStatus, JobPhase, NodeState, WorkerPhase
from unbroken.state.records import Desired, Event, EventType, Job, Node, RankInfo, Worker
from unbroken.state.store import Store

__all__ = [
    "DeepHealthStatus",
    "Desired",
    "Event",
    "EventType",
    "Job",
    "JobPhase",
    "Node",
    "NodeState",
    "RankInfo",
    "Store",
    "Worker",
    "WorkerPhase",
]
