"""The disruption guard (controller/liveness.py): the pure rule, then the node reconciler holding on a
real local runtime (SQLite store, local backend, no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from unbroken.config.cluster import ClusterConfig
from unbroken.controller import liveness
from unbroken.controller.node_reconciler import CLUSTER_OBJECT, NodeReconciler
from unbroken.plumbing.layout import ClusterLayout
from unbroken.runtime import Runtime, create_local
from unbroken.state.phases import DeepHealthStatus, NodeState
from unbroken.state.records import Node

NOW = 10_000.0
LOST_AFTER = 4.0


def node(name: str, heartbeat_at: float, state: NodeState = NodeState.SCHEDULABLE) -> Node:
    return Node(name=name, group="workers", instance_type="cpu-dev", state=state, deep_health=DeepHealthStatus.PASSED,
                heartbeat_at=heartbeat_at, state_changed_at=NOW - 100)


@pytest.mark.parametrize(("silent", "talking", "holds"), [
    (0, 3, False), (1, 2, False), (2, 1, True), (3, 0, True), (1, 1, False), (2, 0, True), (50, 50, False), (51, 49, True),
])
def test_the_guard_holds_when_most_active_nodes_and_at_least_two_are_silent(silent: int, talking: int, holds: bool) -> None:
    nodes = [node(f"s{i}", NOW - 10) for i in range(silent)] + [node(f"t{i}", NOW - 0.5) for i in range(talking)]
    nodes.append(node("faulty", NOW - 60, NodeState.PENDING_REPLACEMENT))  # not active: neither silent nor counted
    hold = liveness.hold(NOW, nodes, LOST_AFTER)
    assert (hold is not None) is holds
    if hold is not None:
        assert hold.active == silent + talking and len(hold.silent) == silent
        assert f"{silent} of {silent + talking} active nodes are silent" in hold.reason


@pytest.fixture
def runtime(tmp_path: Path) -> Runtime:
    config = ClusterConfig.with_nodes(3)
    return create_local(ClusterLayout.at(tmp_path / "cluster"), config)


def add(runtime: Runtime, name: str, heartbeat: float) -> None:
    runtime.cluster.add_node(node(name, heartbeat))
    runtime.cluster.renew_lease(name, at=heartbeat)


def test_the_reconciler_holds_then_judges_as_usual_when_heartbeats_return(runtime: Runtime) -> None:
    for name in ("node-1", "node-2", "node-3"):
        add(runtime, name, NOW)
    reconciler = NodeReconciler(runtime.cluster, runtime.backend, runtime.config)
    store = runtime.cluster

    # every agent paused for 8 s: nothing is declared lost, one Event says why
    for second in range(5, 9):
        reconciler.reconcile_all(NOW + second)
    assert all(n.state is NodeState.SCHEDULABLE for n in store.list_nodes())
    held = store.list_events(object_kind=CLUSTER_OBJECT[0], object_name=CLUSTER_OBJECT[1])
    assert [e.reason for e in held] == ["LivenessHold"] and "3 of 3 active nodes are silent" in held[0].message

    # two agents come back, one does not: the hold is lifted and the silent one is lost as usual
    store.renew_lease("node-1", at=NOW + 9)
    store.renew_lease("node-2", at=NOW + 9)
    reconciler.reconcile_all(NOW + 9.5)
    states = {n.name: n.state for n in store.list_nodes()}
    assert states == {"node-1": NodeState.SCHEDULABLE, "node-2": NodeState.SCHEDULABLE,
                      "node-3": NodeState.PENDING_REPLACEMENT}
    events = store.list_events(object_kind=CLUSTER_OBJECT[0], object_name=CLUSTER_OBJECT[1])
    assert [e.reason for e in events] == ["LivenessHold", "LivenessHoldLifted"]
    assert reconciler.holding is None


def test_agents_that_stop_together_are_held_before_the_first_crosses_the_threshold() -> None:
    """Beats stop at the same moment but were sent at different points of the second: when the first node is
    4.0 s silent the others are 3.2-3.8 s silent. The crowd is counted at half the threshold, so the hold is in
    force before the first is judged alone."""
    nodes = [node("a", NOW - 4.01), node("b", NOW - 3.8), node("c", NOW - 3.2)]
    hold = liveness.hold(NOW, nodes, LOST_AFTER)
    assert hold is not None and hold.silent == ("a", "b", "c")
    assert liveness.hold(NOW, [node("a", NOW - 4.01), node("b", NOW - 0.9), node("c", NOW - 0.2)], LOST_AFTER) is None, \
        "one node really lost among talking ones"


def test_the_next_pass_is_timed_for_the_first_heard_node_that_would_turn_silent() -> None:
    nodes = [node("a", NOW - 0.5), node("b", NOW - 3.2), node("gone", NOW - 9),
             node("faulty", NOW - 1, NodeState.PENDING_REPLACEMENT)]
    assert liveness.next_loss_at(NOW, nodes, LOST_AFTER) == pytest.approx(NOW + 0.8), \
        "b turns silent first; a node already silent or not active times nothing"
    assert liveness.next_loss_at(NOW, [node("gone", NOW - 9)], LOST_AFTER) is None
