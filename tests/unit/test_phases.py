"""The lifecycle tables and the persisted vocabulary of node, job and worker states."""

from __future__ import annotations

import pytest

from unbroken.state.phases import (
    JOB_TRANSITIONS,
    NODE_TRANSITIONS,
    WORKER_TRANSITIONS,
    DeepHealthStatus,
    IllegalTransition,
    JobPhase,
    NodeState,
    WorkerPhase,
    check_transition,
)
from unbroken.state.records import Desired, EventType

HEALTH_LABELS = {"Schedulable", "Unschedulable", "UnschedulablePendingReboot", "UnschedulablePendingReplacement"}


# -- persisted values: a rename must break a test ------------------------------------


def test_node_state_values_are_stable():
    assert {s.name: s.value for s in NodeState} == {
        "JOINING": "Joining",
        "SCHEDULABLE": "Schedulable",
        "UNSCHEDULABLE": "Unschedulable",
        "PENDING_REBOOT": "UnschedulablePendingReboot",
        "PENDING_REPLACEMENT": "UnschedulablePendingReplacement",
        "REBOOTING": "Rebooting",
        "RETIRED": "Retired",
    }


def test_job_phase_values_are_stable():
    assert {p.name: p.value for p in JobPhase} == {
        "PENDING": "Pending",
        "RUNNING": "Running",
        "RESTARTING": "Restarting",
        "SUCCEEDED": "Succeeded",
        "FAILED": "Failed",
        "CANCELLED": "Cancelled",
    }


def test_worker_phase_values_are_stable():
    assert {p.name: p.value for p in WorkerPhase} == {
        "PENDING": "Pending",
        "RUNNING": "Running",
        "INTERRUPTED": "Interrupted",
        "SUCCEEDED": "Succeeded",
        "FAILED": "Failed",
        "STOPPED": "Stopped",
    }


def test_other_persisted_enums_are_stable():
    assert {s.name: s.value for s in DeepHealthStatus} == {
        "NOT_RUN": "NotRun",
        "IN_PROGRESS": "InProgress",
        "PASSED": "Passed",
        "FAILED": "Failed",
    }
    assert {d.name: d.value for d in Desired} == {"RUN": "Run", "STOP": "Stop", "HOLD": "Hold"}
    assert {t.name: t.value for t in EventType} == {"NORMAL": "Normal", "WARNING": "Warning"}


def test_enum_members_are_plain_strings():
    # Persisted as text and compared with text read back from the store.
    assert NodeState.SCHEDULABLE == "Schedulable"
    assert str(JobPhase.RESTARTING) == "Restarting"
    assert f"{WorkerPhase.STOPPED}" == "Stopped"


# -- tables are complete and well-formed ---------------------------------------------


@pytest.mark.parametrize(
    ("table", "enum"),
    [(NODE_TRANSITIONS, NodeState), (JOB_TRANSITIONS, JobPhase), (WORKER_TRANSITIONS, WorkerPhase)],
    ids=["node", "job", "worker"],
)
def test_every_state_has_an_entry_and_targets_are_members(table, enum):
    assert set(table) == set(enum)
    for source, targets in table.items():
        assert isinstance(targets, frozenset)
        assert targets <= set(enum), f"{source} -> {targets - set(enum)}"
        assert source not in targets, f"{source} lists itself; a no-op is allowed without it"


@pytest.mark.parametrize("phase", list(JobPhase))
def test_terminal_job_phases_have_no_way_out(phase):
    assert (JOB_TRANSITIONS[phase] == frozenset()) == phase.is_terminal


@pytest.mark.parametrize("phase", list(WorkerPhase))
def test_terminal_worker_phases_have_no_way_out(phase):
    assert (WORKER_TRANSITIONS[phase] == frozenset()) == phase.is_terminal


def test_retired_is_the_only_node_dead_end():
    assert [s for s, targets in NODE_TRANSITIONS.items() if not targets] == [NodeState.RETIRED]


def test_every_non_terminal_state_can_reach_a_terminal_one():
    def reachable(table, start):
        seen, todo = {start}, [start]
        while todo:
            for nxt in table[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    for phase in JobPhase:
        assert any(p.is_terminal for p in reachable(JOB_TRANSITIONS, phase)), phase
    for phase in WorkerPhase:
        assert any(p.is_terminal for p in reachable(WORKER_TRANSITIONS, phase)), phase
    for state in NodeState:
        assert NodeState.RETIRED in reachable(NODE_TRANSITIONS, state), state


def test_documented_lifecycle_edges():
    # The node lifecycle: Joining -> Schedulable or Pending{Reboot,Replacement}; recovery -> Joining.
    assert NodeState.SCHEDULABLE in NODE_TRANSITIONS[NodeState.JOINING]
    assert NodeState.PENDING_REBOOT in NODE_TRANSITIONS[NodeState.JOINING]
    assert NodeState.PENDING_REPLACEMENT in NODE_TRANSITIONS[NodeState.JOINING]
    assert NODE_TRANSITIONS[NodeState.PENDING_REBOOT] == {NodeState.REBOOTING, NodeState.PENDING_REPLACEMENT}
    assert NODE_TRANSITIONS[NodeState.REBOOTING] == {NodeState.JOINING, NodeState.PENDING_REPLACEMENT}
    assert NODE_TRANSITIONS[NodeState.PENDING_REPLACEMENT] == {NodeState.RETIRED}
    # Job: Running -> Restarting -> Running while retries remain.
    assert JobPhase.RESTARTING in JOB_TRANSITIONS[JobPhase.RUNNING]
    assert JobPhase.RUNNING in JOB_TRANSITIONS[JobPhase.RESTARTING]
    assert JobPhase.SUCCEEDED not in JOB_TRANSITIONS[JobPhase.PENDING]
    assert JobPhase.SUCCEEDED not in JOB_TRANSITIONS[JobPhase.RESTARTING]


# -- check_transition ---------------------------------------------------------------


def test_check_transition_allows_listed_and_no_op():
    check_transition("job j", JOB_TRANSITIONS, JobPhase.PENDING, JobPhase.RUNNING)
    check_transition("job j", JOB_TRANSITIONS, JobPhase.SUCCEEDED, JobPhase.SUCCEEDED)
    check_transition("node n", NODE_TRANSITIONS, NodeState.RETIRED, NodeState.RETIRED)


@pytest.mark.parametrize(
    ("table", "current", "new"),
    [
        (NODE_TRANSITIONS, NodeState.RETIRED, NodeState.SCHEDULABLE),
        (NODE_TRANSITIONS, NodeState.PENDING_REPLACEMENT, NodeState.SCHEDULABLE),
        (NODE_TRANSITIONS, NodeState.SCHEDULABLE, NodeState.JOINING),
        (JOB_TRANSITIONS, JobPhase.SUCCEEDED, JobPhase.RUNNING),
        (JOB_TRANSITIONS, JobPhase.PENDING, JobPhase.RESTARTING),
        (WORKER_TRANSITIONS, WorkerPhase.STOPPED, WorkerPhase.RUNNING),
        (WORKER_TRANSITIONS, WorkerPhase.RUNNING, WorkerPhase.PENDING),
    ],
)
def test_check_transition_rejects_unlisted(table, current, new):
    with pytest.raises(IllegalTransition, match=f"{current.value} -> {new.value}"):
        check_transition("thing", table, current, new)


# -- derived properties --------------------------------------------------------------


def test_job_is_terminal():
    assert {p for p in JobPhase if p.is_terminal} == {JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.CANCELLED}


def test_worker_is_terminal():
    assert {p for p in WorkerPhase if p.is_terminal} == {WorkerPhase.SUCCEEDED, WorkerPhase.FAILED, WorkerPhase.STOPPED}


def test_node_is_active():
    assert {s for s in NodeState if s.is_active} == {NodeState.JOINING, NodeState.SCHEDULABLE, NodeState.UNSCHEDULABLE}


def test_health_status_label_values():
    assert {s: s.health_status_label for s in NodeState} == {
        NodeState.JOINING: "Unschedulable",
        NodeState.SCHEDULABLE: "Schedulable",
        NodeState.UNSCHEDULABLE: "Unschedulable",
        NodeState.PENDING_REBOOT: "UnschedulablePendingReboot",
        NodeState.PENDING_REPLACEMENT: "UnschedulablePendingReplacement",
        NodeState.REBOOTING: "UnschedulablePendingReboot",
        NodeState.RETIRED: "UnschedulablePendingReplacement",
    }


def test_health_status_label_uses_only_the_four_design_values():
    labels = {s.health_status_label for s in NodeState}
    assert labels == HEALTH_LABELS
    assert all(type(label) is str for label in labels)
    # Only a Schedulable node advertises itself as schedulable.
    assert [s for s in NodeState if s.health_status_label == "Schedulable"] == [NodeState.SCHEDULABLE]
