"""Deep-check suites on join (``OnStartDeepHealthChecks``), for the agent's join checks.

InstanceStress runs on the joining node alone. InstanceConnectivity runs the
collective sweep across the joining node and up to ``MAX_PEERS`` peers that
already passed (idle ones first, so a running job is disturbed as little as
possible); a node with no such peer checks itself with two ranks. When the
sweep names a peer (and not the joining node) as the slow one, the peer is
the one taken out.
"""

from __future__ import annotations

from collections.abc import Callable, Set
from dataclasses import dataclass

from unbroken.config.cluster import ClusterConfig
from unbroken.health import catalogue, events, faults, runner, targets
from unbroken.health.context import Peer
from unbroken.health.result import CheckResult, FaultAction, Suite, worst
from unbroken.plumbing.layout import ClusterLayout
from unbroken.state.phases import DeepHealthStatus, NodeState
from unbroken.state.store import ClusterStore

MAX_PEERS = 2
"""Enough for the pairwise blame to name a slow node (three nodes), cheap enough to run on every join."""

SUITES = (Suite.INSTANCE_STRESS.value, Suite.INSTANCE_CONNECTIVITY.value)


@dataclass(frozen=True)
class Verdict:
    passed: bool
    reason: str
    fault_type: str | None = None


def connectivity_peers(store: ClusterStore, layout: ClusterLayout, cluster: ClusterConfig, me: str, busy: Set[str]) -> tuple[Peer, ...]:
    ready = [n for n in store.list_nodes() if n.name != me and n.state is NodeState.SCHEDULABLE
             and n.deep_health is DeepHealthStatus.PASSED]
    ready.sort(key=lambda n: (n.name in busy, n.name))
    return tuple(targets.peer(layout, cluster, n) for n in ready[:MAX_PEERS])


def run_suite(suite: str, node: str, *, store: ClusterStore, jobs_on: events.JobsOn, layout: ClusterLayout,
              cluster: ClusterConfig, busy: Set[str] = frozenset(),
              on_result: Callable[[CheckResult], None] | None = None) -> Verdict:
    """Run ``suite`` for the joining ``node``; ``busy`` nodes (running a job) are the last picked as peers.
    ``on_result`` sees every result (the agent's metrics)."""
    me = store.get_node(node)
    peers: tuple[Peer, ...] = ()
    if suite == Suite.INSTANCE_CONNECTIVITY.value:
        peers = (targets.peer(layout, cluster, me), *connectivity_peers(store, layout, cluster, node, busy))
    ctx = targets.context(layout, cluster, me, peers=peers)
    results = runner.run_suite(catalogue.for_suite(Suite(suite), cluster.Health), ctx, Suite(suite))
    for result in results:
        events.record(store, result)
        if on_result is not None:
            on_result(result)
    return verdict(store, jobs_on, node, results)


def verdict(store: ClusterStore, jobs_on: events.JobsOn, node: str, results: list[CheckResult]) -> Verdict:
    """Judge ``node`` and take out the peers a multi-node check blamed instead of it."""
    for result in results:
        for other in blamed_peers(node, result):
            events.apply_fault(store, jobs_on, other, result.action, f"{result.check}: {result.message}", source=result.check)
    return judge(node, results)


def blamed_peers(node: str, result: CheckResult) -> tuple[str, ...]:
    """The nodes ``result`` blames when it is not ``node`` itself (a sweep named a slow peer)."""
    if not result.failed or result.action is FaultAction.NONE or not result.faulty_nodes or node in result.faulty_nodes:
        return ()
    return result.faulty_nodes


def judge(node: str, results: list[CheckResult]) -> Verdict:
    """Whether ``node`` passed: a failed check counts against it unless it blamed only other nodes."""
    mine = [r for r in results if r.failed and r.action is not FaultAction.NONE and not blamed_peers(node, r)]
    if not mine:
        return Verdict(True, f"{len(results)} checks passed")
    action = worst([r.action for r in mine])
    reason = "; ".join(f"{r.check}: {r.message}" for r in mine)
    if any(r.reason == faults.SILENT_DATA_CORRUPTION for r in mine):
        return Verdict(False, reason, faults.SILENT_DATA_CORRUPTION)  # replaced, and named for what it does wrong
    return Verdict(False, reason, faults.REBOOT_REQUIRED if action is FaultAction.REBOOT else faults.FAULTY_INSTANCE)
