"""Job reconciler decisions: hand-built records and an injected clock, no store, no processes."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from unbroken.config.job import JobSpec
from unbroken.controller.job_decisions import Action, Decision, decide, eligible
from unbroken.state.phases import DeepHealthStatus, JobPhase, NodeState, WorkerPhase
from unbroken.state.records import RankInfo, Desired, Job, Node, Worker

NOW = 50_000.0
SILENT_AFTER = 1.5


def spec(nodes: int = 2, **resilience: Any) -> JobSpec:
    base = {"auto_resume": True, "max_retry": 3, "hang_timeout": 30.0, "startup_timeout": 120.0}
    return JobSpec.model_validate(
        {"name": "train", "nodes": nodes, "command": ["-m", "x"], "resilience": {**base, **resilience}}
    )


def job(phase: JobPhase = JobPhase.RUNNING, attempt: int = 0, **fields: Any) -> Job:
    return Job(name="train", spec_json="{}", phase=phase, attempt=attempt, created_at=NOW - 1000, **fields)


def node(name: str, state: NodeState = NodeState.SCHEDULABLE, **fields: Any) -> Node:
    defaults: dict[str, Any] = dict(deep_health=DeepHealthStatus.PASSED, heartbeat_at=NOW - 0.2, state_changed_at=NOW - 500)
    return Node(name=name, group="workers", instance_type="cpu-dev", state=state, **{**defaults, **fields})


def worker(id: int, node_name: str, phase: WorkerPhase = WorkerPhase.RUNNING, **fields: Any) -> Worker:
    defaults: dict[str, Any] = dict(
        desired=Desired.RUN, started_at=NOW - 200, first_step=1, first_progress_at=NOW - 190,
        last_step=100, last_progress_at=NOW - 1,
    )
    return Worker(job="train", attempt=0, node=node_name, node_rank=id - 1, phase=phase,
                  rdzv_endpoint="127.0.0.1:29500", id=id, **{**defaults, **fields})


def nodes(*items: Node) -> dict[str, Node]:
    return {n.name: n for n in items}


HEALTHY = nodes(node("node-1"), node("node-2"), node("node-3"))


def running(*workers: Worker, j: Job | None = None, s: JobSpec | None = None, ns: dict[str, Node] | None = None) -> Decision:
    return decide(NOW, j or job(), s or spec(), list(workers), HEALTHY if ns is None else ns, [], silent_after=SILENT_AFTER)


# -- placement ------------------------------------------------------------------------


def test_pending_with_enough_free_nodes_schedules_the_first_n():
    d = decide(NOW, job(JobPhase.PENDING), spec(nodes=2), [], HEALTHY, ["node-3", "node-1", "node-2"])
    assert d.action is Action.SCHEDULE
    assert d.nodes == ("node-3", "node-1")


def test_pending_without_enough_nodes_waits_all_or_nothing():
    d = decide(NOW, job(JobPhase.PENDING), spec(nodes=2), [], HEALTHY, ["node-1"])
    assert d.action is Action.WAIT
    assert d.nodes == ()
    assert "needs 2" in d.reason and "1 available" in d.reason


def test_pending_with_no_nodes_waits():
    d = decide(NOW, job(JobPhase.PENDING), spec(nodes=1), [], {}, [])
    assert d.action is Action.WAIT and "0 available" in d.reason


# -- eligibility ----------------------------------------------------------------------


def test_eligible_requires_deep_health_passed_by_default():
    s = spec()
    assert s.resilience.require_deep_health_passed
    assert eligible(node("node-1"), s, NOW, SILENT_AFTER)
    for status in (DeepHealthStatus.IN_PROGRESS, DeepHealthStatus.FAILED):
        assert not eligible(node("node-1", deep_health=status), s, NOW, SILENT_AFTER)


def test_eligible_without_deep_health_requirement():
    s = spec(require_deep_health_passed=False)
    assert eligible(node("node-1", deep_health=DeepHealthStatus.IN_PROGRESS), s, NOW, SILENT_AFTER)
    assert eligible(node("node-1", deep_health=DeepHealthStatus.FAILED), s, NOW, SILENT_AFTER)


@pytest.mark.parametrize("state", [s for s in NodeState if s is not NodeState.SCHEDULABLE])
@pytest.mark.parametrize("require", [True, False])
def test_non_schedulable_nodes_are_never_eligible(state, require):
    assert not eligible(node("node-1", state=state), spec(require_deep_health_passed=require), NOW, SILENT_AFTER)


def test_silent_node_is_not_eligible():
    s = spec()
    assert not eligible(node("node-1", heartbeat_at=NOW - SILENT_AFTER - 0.1), s, NOW, SILENT_AFTER)
    assert eligible(node("node-1", heartbeat_at=NOW - SILENT_AFTER + 0.1), s, NOW, SILENT_AFTER)


# -- failed workers -------------------------------------------------------------------


def failed(id: int = 1, node_name: str = "node-1", **fields: Any) -> Worker:
    fields = {"exit_code": 1, "message": "exited with code 1", "ended_at": NOW - 1, **fields}
    return worker(id, node_name, WorkerPhase.FAILED, **fields)


def test_failed_worker_restarts_while_retries_remain():
    d = running(failed(), worker(2, "node-2"))
    assert d.action is Action.RESTART
    assert "worker on node-1: exited with code 1" in d.reason
    assert "restart 1 of 3" in d.reason


def test_restart_count_follows_attempt():
    d = running(failed(), worker(2, "node-2"), j=job(attempt=2))
    assert d.action is Action.RESTART and "restart 3 of 3" in d.reason


def test_failed_worker_fails_the_job_when_retries_are_used():
    d = running(failed(), worker(2, "node-2"), j=job(attempt=3))
    assert d.action is Action.FAIL
    assert "worker on node-1: exited with code 1" in d.reason
    assert "max_retry 3 restarts used" in d.reason


def test_max_retry_zero_fails_first_failure():
    d = running(failed(), worker(2, "node-2"), s=spec(max_retry=0))
    assert d.action is Action.FAIL and "max_retry 0 restarts used" in d.reason


def test_failed_worker_fails_the_job_without_auto_resume():
    d = running(failed(), worker(2, "node-2"), s=spec(auto_resume=False))
    assert d.action is Action.FAIL
    assert "auto_resume is off" in d.reason


def test_auto_resume_is_off_by_default():
    s = JobSpec.model_validate({"name": "train", "command": ["-m", "x"]})
    d = decide(NOW, job(), s, [failed()], HEALTHY, [])
    assert d.action is Action.FAIL and "auto_resume is off" in d.reason


def test_restart_policy_never_fails():
    d = running(failed(), worker(2, "node-2"), s=spec(restart_policy="Never"))
    assert d.action is Action.FAIL
    assert "restart_policy is Never" in d.reason


def test_exit_code_policy_does_not_retry_program_errors():
    d = running(failed(exit_code=3, message="exited with code 3"), worker(2, "node-2"), s=spec(restart_policy="ExitCode"))
    assert d.action is Action.FAIL
    assert "not retried" in d.reason


@pytest.mark.parametrize("code", [-9, 137, 128])
def test_exit_code_policy_retries_signals(code):
    d = running(failed(exit_code=code, message=f"exited with {code}"), worker(2, "node-2"), s=spec(restart_policy="ExitCode"))
    assert d.action is Action.RESTART
    assert "restart 1 of 3" in d.reason


def test_on_failure_policy_retries_program_errors():
    d = running(failed(exit_code=3), worker(2, "node-2"), s=spec(restart_policy="OnFailure"))
    assert d.action is Action.RESTART


def test_worker_stopped_while_desired_run_is_a_failure():
    d = running(worker(1, "node-1", WorkerPhase.STOPPED, message=None), worker(2, "node-2"))
    assert d.action is Action.RESTART
    assert "worker on node-1 stopped unexpectedly" in d.reason


# -- nodes of running workers -----------------------------------------------------------


def test_node_pending_replacement_restarts_the_job():
    ns = nodes(node("node-1"), node("node-2", NodeState.PENDING_REPLACEMENT, fault_type="NodeLost",
                                    fault_reason="heartbeat lost: last seen 4.2 s ago"))
    d = running(worker(1, "node-1"), worker(2, "node-2"), ns=ns)
    assert d.action is Action.RESTART
    assert "node node-2 is UnschedulablePendingReplacement: heartbeat lost: last seen 4.2 s ago" in d.reason


def test_a_job_whose_pods_regroup_goes_on_without_a_lost_node_but_never_without_node_rank_0_or_past_its_losses():
    """``node_losses_in_place`` (spare pods, an elastic job's slack): the pods regroup without the lost one."""
    lost = NodeState.PENDING_REPLACEMENT
    s = spec(nodes=3, node_losses_in_place=1)
    three = (worker(1, "node-1"), worker(2, "node-2"), worker(3, "node-3"))
    assert running(*three, s=s, ns=nodes(node("node-1"), node("node-2"), node("node-3", lost))).action is Action.WAIT
    two_lost = running(*three, s=s, ns=nodes(node("node-1"), node("node-2", lost), node("node-3", lost)))
    assert two_lost.action is Action.RESTART and "node node-2 is UnschedulablePendingReplacement" in two_lost.reason
    master_lost = running(*three, s=s, ns=nodes(node("node-1", lost), node("node-2"), node("node-3")))
    assert master_lost.action is Action.RESTART, "node rank 0 hosts the rendezvous: its loss is a restart"
    assert running(*three, ns=nodes(node("node-1"), node("node-2"), node("node-3", lost)), s=spec(nodes=3)).action is Action.RESTART


def test_missing_node_restarts_the_job():
    d = running(worker(1, "node-1"), worker(2, "node-9"))
    assert d.action is Action.RESTART and "node node-9 is missing" in d.reason


def test_cordoned_node_keeps_running_work():
    ns = nodes(node("node-1"), node("node-2", NodeState.UNSCHEDULABLE))
    d = running(worker(1, "node-1"), worker(2, "node-2"), ns=ns)
    assert d == Decision(Action.WAIT, "running")


def test_healthy_running_job_waits():
    assert running(worker(1, "node-1"), worker(2, "node-2")) == Decision(Action.WAIT, "running")


# -- hangs ----------------------------------------------------------------------------


def test_no_progress_for_longer_than_hang_timeout_restarts():
    d = running(worker(1, "node-1"), worker(2, "node-2", last_progress_at=NOW - 30.5, last_step=42))
    assert d.action is Action.RESTART
    assert "hang" in d.reason and "node-2" in d.reason and "last step 42" in d.reason


def test_progress_just_under_hang_timeout_waits():
    d = running(worker(1, "node-1"), worker(2, "node-2", last_progress_at=NOW - 29.9))
    assert d.action is Action.WAIT


HELLO = (RankInfo(rank=0, local_rank=0, pid=100),)


def test_no_first_progress_past_startup_timeout_restarts():
    starting = dict(first_step=None, first_progress_at=None, last_step=None, last_progress_at=None, ranks=HELLO)
    d = running(worker(1, "node-1", started_at=NOW - 121, **starting), worker(2, "node-2", started_at=NOW - 121, **starting))
    assert d.action is Action.RESTART
    assert "hang" in d.reason and "startup_timeout 120" in d.reason


def test_script_without_the_training_api_is_never_called_hung():
    # No rank said hello: the script does not call unbroken.init(), so silence means nothing.
    silent = dict(first_step=None, first_progress_at=None, last_step=None, last_progress_at=None, ranks=())
    d = running(worker(1, "node-1", started_at=NOW - 10_000, **silent), worker(2, "node-2", started_at=NOW - 10_000, **silent))
    assert d.action is Action.WAIT


def test_no_first_progress_within_startup_timeout_waits():
    # Older than hang_timeout (30 s) but younger than startup_timeout (120 s): still starting.
    starting = dict(first_step=None, first_progress_at=None, last_step=None, last_progress_at=None, ranks=HELLO)
    d = running(worker(1, "node-1", started_at=NOW - 119, **starting), worker(2, "node-2", started_at=NOW - 60, **starting))
    assert d.action is Action.WAIT


def test_pending_worker_is_not_checked_for_hangs():
    d = running(worker(1, "node-1", WorkerPhase.PENDING, started_at=None, last_progress_at=None, first_progress_at=None))
    assert d.action is Action.WAIT


# -- suspects -------------------------------------------------------------------------


def test_failure_names_silent_peer_as_suspect():
    ns = nodes(node("node-1"), node("node-2", heartbeat_at=NOW - 2.5))
    d = running(failed(), worker(2, "node-2"), ns=ns)
    assert d.action is Action.RESTART
    assert "(suspect: node-2 silent for 2.5 s)" in d.reason
    assert d.reason.endswith("restart 1 of 3")


def test_no_suspect_when_peers_heartbeat():
    d = running(failed(), worker(2, "node-2"))
    assert "suspect" not in d.reason


def test_failing_node_itself_is_not_its_own_suspect():
    ns = nodes(node("node-1", heartbeat_at=NOW - 3), node("node-2"))
    d = running(failed(), worker(2, "node-2"), ns=ns)
    assert "suspect" not in d.reason


def test_suspect_with_a_name_that_prefixes_the_failing_node():
    # node-1 went quiet; the failure was seen on node-10 whose name contains "node-1".
    ns = nodes(node("node-1", heartbeat_at=NOW - 2.0), node("node-10"))
    d = running(worker(1, "node-1"), failed(id=2, node_name="node-10"), ns=ns)
    assert d.action is Action.RESTART
    assert "(suspect: node-1 silent for 2.0 s)" in d.reason


# -- success and cancel -----------------------------------------------------------------


def test_all_workers_succeeded_succeeds():
    d = running(worker(1, "node-1", WorkerPhase.SUCCEEDED), worker(2, "node-2", WorkerPhase.SUCCEEDED))
    assert d.action is Action.SUCCEED and "2 workers" in d.reason


def test_some_workers_succeeded_waits():
    d = running(worker(1, "node-1", WorkerPhase.SUCCEEDED), worker(2, "node-2"))
    assert d.action is Action.WAIT


def test_running_with_no_workers_does_not_succeed():
    assert running().action is Action.WAIT


@pytest.mark.parametrize("phase", [JobPhase.PENDING, JobPhase.RUNNING, JobPhase.RESTARTING])
def test_cancel_requested_cancels(phase):
    d = decide(NOW, job(phase, cancel_requested=True), spec(), [failed()], HEALTHY, ["node-1", "node-2"])
    assert d.action is Action.CANCEL


@pytest.mark.parametrize("phase", [JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.CANCELLED])
def test_terminal_jobs_wait(phase):
    d = decide(NOW, job(phase, cancel_requested=True), spec(), [failed()], HEALTHY, ["node-1", "node-2"])
    assert d.action is Action.WAIT


# -- restarting -----------------------------------------------------------------------


def restarting(*workers: Worker, ns: dict[str, Node] | None = None, free: list[str] | None = None) -> Decision:
    return decide(NOW, job(JobPhase.RESTARTING), spec(nodes=2), list(workers), HEALTHY if ns is None else ns,
                  free if free is not None else ["node-1", "node-2", "node-3"], silent_after=SILENT_AFTER)


def stopping(id: int, node_name: str) -> Worker:
    return worker(id, node_name, WorkerPhase.RUNNING, desired=Desired.STOP)


def test_restarting_waits_for_workers_on_alive_nodes_to_stop():
    d = restarting(failed(), stopping(2, "node-2"))
    assert d.action is Action.WAIT
    assert "node-2" in d.reason and d.nodes == ()


def test_restarting_does_not_wait_for_workers_on_lost_or_missing_nodes():
    ns = nodes(node("node-1"), node("node-2", NodeState.PENDING_REPLACEMENT))
    d = restarting(failed(), stopping(2, "node-2"), stopping(3, "node-3"), ns=ns, free=["node-1", "node-4"])
    assert d.action is Action.SCHEDULE  # node-3 is not in the map at all: also gone
    assert d.nodes == ("node-1", "node-4")


def test_restarting_does_not_wait_for_a_silent_node_but_waits_for_a_live_one():
    ns = nodes(node("node-1"), node("node-2", heartbeat_at=NOW - 3.0))
    d = restarting(failed(), stopping(2, "node-2"), ns=ns, free=["node-3", "node-4"])
    assert d.action is Action.SCHEDULE
    ns = nodes(node("node-1"), node("node-2", heartbeat_at=NOW - 0.5))
    d = restarting(failed(), stopping(2, "node-2"), ns=ns, free=["node-3", "node-4"])
    assert d.action is Action.WAIT and "node-2" in d.reason


def test_restarting_does_not_forget_terminal_workers_on_lost_nodes():
    ns = nodes(node("node-1"), node("node-2", NodeState.PENDING_REPLACEMENT))
    d = restarting(failed(), worker(2, "node-2", WorkerPhase.STOPPED, desired=Desired.STOP), ns=ns, free=["node-1", "node-3"])
    assert d.action is Action.SCHEDULE


def test_restarting_schedules_when_all_stopped_and_nodes_free():
    stopped = worker(2, "node-2", WorkerPhase.STOPPED, desired=Desired.STOP)
    d = restarting(failed(), stopped, free=["node-3", "node-1"])
    assert d.action is Action.SCHEDULE
    assert d.nodes == ("node-3", "node-1")


def test_restarting_waits_for_free_nodes():
    stopped = worker(2, "node-2", WorkerPhase.STOPPED, desired=Desired.STOP)
    d = restarting(failed(), stopped, free=["node-3"])
    assert d.action is Action.WAIT
    assert "needs 2" in d.reason and "1 available" in d.reason


def test_decide_does_not_mutate_inputs():
    ws = [failed(), worker(2, "node-2")]
    before = [dataclasses.replace(w) for w in ws]
    running(*ws)
    assert ws == before


def test_agent_gone_only_when_nobody_can_stop_the_workers():
    from unbroken.controller.job_decisions import agent_gone

    assert agent_gone(NOW, node("node-1", NodeState.RETIRED), SILENT_AFTER)
    assert agent_gone(NOW, node("node-1", NodeState.REBOOTING), SILENT_AFTER)
    # a faulty node whose agent still heartbeats stops its own workers
    assert not agent_gone(NOW, node("node-1", NodeState.PENDING_REPLACEMENT, heartbeat_at=NOW - 0.2), SILENT_AFTER)
    assert agent_gone(NOW, node("node-1", NodeState.PENDING_REPLACEMENT, heartbeat_at=NOW - 5.0), SILENT_AFTER)


# -- naming the root cause among several failures ---------------------------------------

PEER_LOST = ("rank 0 (local rank 0) exited with code 1: RuntimeError: [gloo/transport/tcp/pair.cc:534] "
             "Connection closed by peer [127.0.0.1]:40123")
KILLED = "rank 3 (local rank 1) exited with signal 9 (SIGKILL)"


def test_the_rank_that_died_is_named_not_the_peers_that_lost_it():
    d = running(worker(1, "node-1", WorkerPhase.FAILED, exit_code=1, message=PEER_LOST, ended_at=NOW - 0.3),
                worker(2, "node-2", WorkerPhase.FAILED, exit_code=-9, message=KILLED, ended_at=NOW - 0.1))
    assert d.action is Action.RESTART and d.reason.startswith(f"worker on node-2: {KILLED}")


def test_a_lost_peer_restarts_at_once_and_is_retried_whatever_the_exit_code_policy():
    """The rank that died may never report (its node is gone): the restart does not wait for it.
    A peer-lost exit code 1 is a symptom, not the program's own error: retried under ExitCode too."""
    symptom = worker(1, "node-1", WorkerPhase.FAILED, exit_code=1, message=PEER_LOST, ended_at=NOW - 0.1)
    d = running(symptom, worker(2, "node-2"), s=spec(restart_policy="ExitCode"))
    assert d.action is Action.RESTART and "Connection closed by peer" in d.reason


def test_the_cause_of_a_restart_decided_on_a_symptom_is_found_once_it_reports():
    from unbroken.controller.job_decisions import restart_cause

    symptom = worker(1, "node-1", WorkerPhase.FAILED, exit_code=1, message=PEER_LOST, ended_at=NOW - 0.3)
    killed = worker(2, "node-2", WorkerPhase.FAILED, exit_code=-9, message=KILLED, ended_at=NOW - 0.1)
    reason = f"worker on node-1: {PEER_LOST}; restart 1 of 3"
    assert restart_cause([symptom, worker(2, "node-2", WorkerPhase.STOPPED)], reason) is None, "not reported (yet)"
    assert restart_cause([symptom, killed], reason) == killed
    assert restart_cause([symptom, killed], f"worker on node-2: {KILLED}; restart 1 of 3") is None, "the event named it already"


def test_a_restart_on_a_rank_whose_end_was_unread_names_how_it_ended_once_torchrun_said():
    """torchrun reaped the killed rank before its agent read the status: the restart names the rank at
    once, and the signal once the agent read torchrun's root cause into the worker's row."""
    from unbroken.controller.job_decisions import restart_cause
    from unbroken.rank.symptoms import UNREAD_EXIT

    unread = f"rank 2 (local rank 0) {UNREAD_EXIT} (it reaped the rank before the agent read its status)"
    reason = f"worker on node-2: {unread}; restart 1 of 3"
    first = worker(2, "node-2", WorkerPhase.FAILED, exit_code=None, message=unread, ended_at=NOW - 0.2)
    assert restart_cause([first, worker(1, "node-1", WorkerPhase.STOPPED)], reason) is None, "nothing better known yet"
    named = worker(2, "node-2", WorkerPhase.FAILED, exit_code=-9, message="rank 2 (local rank 0) exited with signal 9 (SIGKILL)",
                   ended_at=NOW - 0.2)
    assert restart_cause([named, worker(1, "node-1", WorkerPhase.STOPPED)], reason) == named


def test_an_error_of_its_own_is_not_waited_on():
    own = worker(1, "node-1", WorkerPhase.FAILED, exit_code=1, message="rank 0 exited with code 1: ValueError: bad batch",
                 ended_at=NOW - 0.1)
    d = running(own, worker(2, "node-2"))
    assert d.action is Action.RESTART and "ValueError: bad batch" in d.reason


# -- elastic jobs (nodes: {min, max}) ---------------------------------------------------


def elastic(low: int = 1, high: int = 2, **resilience: Any) -> JobSpec:
    base = {"auto_resume": True, "max_retry": 3, "hang_timeout": 30.0, "startup_timeout": 120.0}
    return JobSpec.model_validate({"name": "train", "nodes": {"min": low, "max": high}, "command": ["-m", "x"],
                                   "resilience": {**base, **resilience}})


def test_an_elastic_job_starts_on_what_is_free_down_to_its_min():
    assert decide(NOW, job(JobPhase.PENDING), elastic(1, 3), [], HEALTHY, ["node-2"]).nodes == ("node-2",)
    assert decide(NOW, job(JobPhase.PENDING), elastic(1, 2), [], HEALTHY, ["node-2", "node-1", "node-3"]).nodes == ("node-2", "node-1")
    waiting = decide(NOW, job(JobPhase.PENDING), elastic(2, 3), [], HEALTHY, ["node-2"])
    assert waiting.action is Action.WAIT and "needs at least 2 (up to 3) schedulable idle nodes, 1 available" in waiting.reason


def test_an_elastic_job_restarting_after_a_lost_node_shrinks_onto_the_survivors():
    d = decide(NOW, job(JobPhase.RESTARTING, attempt=1, nodes=("node-1", "node-2")), elastic(1, 2), [], HEALTHY, ["node-1"])
    assert d.action is Action.SCHEDULE and d.nodes == ("node-1",)


def grow(saved: int | None, last: int, grow_after: int | None, free: list[str] | None = None) -> Decision:
    return decide(NOW, job(nodes=("node-1",)), elastic(1, 2), [worker(1, "node-1", saved_step=saved, last_step=last)], HEALTHY,
                  ["node-1", "node-2"] if free is None else free, silent_after=SILENT_AFTER, grow_after=grow_after)


def test_a_shrunk_job_grows_only_after_a_checkpoint_newer_than_when_the_node_came_back():
    assert grow(saved=None, last=5, grow_after=None).action is Action.WAIT  # not noticed yet
    waiting = grow(saved=40, last=45, grow_after=40)
    assert waiting.action is Action.WAIT and "growing to 2 after the next checkpoint" in waiting.reason
    assert grow(saved=50, last=50, grow_after=40).action is Action.WAIT  # saved, but no step past it: maybe not published
    d = grow(saved=50, last=51, grow_after=40)
    assert d.action is Action.RESIZE and d.nodes == ("node-2",)
    assert "growing from 1 to 2 nodes (node-2 schedulable) at the checkpoint of step 50" in d.reason
    assert grow(saved=50, last=51, grow_after=40, free=["node-1"]).action is Action.WAIT  # nothing to grow onto


def test_a_job_at_its_max_or_a_fixed_size_job_never_grows():
    full = decide(NOW, job(nodes=("node-1", "node-2")), elastic(1, 2), [worker(1, "node-1", saved_step=50, last_step=51)],
                  HEALTHY, ["node-1", "node-2", "node-3"], grow_after=-1)
    assert full.action is Action.WAIT and full.reason == "running"
    fixed = decide(NOW, job(nodes=("node-1",)), spec(nodes=1), [worker(1, "node-1", saved_step=50, last_step=51)],
                   HEALTHY, ["node-1", "node-2"], grow_after=-1)
    assert fixed.action is Action.WAIT and fixed.reason == "running"


def test_resizes_do_not_use_up_the_restart_budget():
    failed = worker(1, "node-1", WorkerPhase.FAILED, exit_code=-9, message="rank 0 killed")
    spent = decide(NOW, job(attempt=3, resizes=0), spec(max_retry=3), [failed], HEALTHY, [])
    assert spent.action is Action.FAIL
    resized = decide(NOW, job(attempt=3, resizes=2), spec(max_retry=3), [failed], HEALTHY, [])
    assert resized.action is Action.RESTART and "restart 2 of 3" in resized.reason


@pytest.mark.parametrize(("nodes", "message"), [
    ({"min": 3, "max": 2}, "nodes: min 3 is more than max 2"),
    ("2:x", "nodes: '2:x' is not N or MIN:MAX"),
    ({"min": 1}, "must have exactly the keys min and max"),
])
def test_a_bad_node_range_is_refused_with_what_would_be_valid(nodes: Any, message: str):
    with pytest.raises(ValueError, match=message):
        JobSpec.model_validate({"name": "train", "nodes": nodes, "command": ["-m", "x"]})


def test_the_cli_form_min_colon_max_reads_like_torchrun():
    parsed = JobSpec.model_validate({"name": "train", "nodes": "2:4", "command": ["-m", "x"]})
    assert (parsed.min_nodes, parsed.nodes, parsed.elastic, parsed.fewest_nodes) == (2, 4, True, 2)
    assert not JobSpec.model_validate({"name": "train", "nodes": "3", "command": ["-m", "x"]}).elastic


# -- in-process restarts --------------------------------------------------------------


def test_an_in_process_restart_holds_the_workers_still_stepping_on_healthy_nodes():
    s = spec(nodes=3, in_process_restart=True)
    ns = nodes(node("node-1"), node("node-2"), node("node-3", NodeState.UNSCHEDULABLE))
    d = running(failed(2, "node-2"), worker(1, "node-1"), worker(3, "node-3"), s=s, ns=ns)
    assert d.action is Action.RESTART
    assert d.hold == ("node-1",), "not the failed worker, not the one on a node taken out"
    assert d.reason.endswith("; in-process: the ranks on node-1 stay"), d.reason
    assert running(failed(2, "node-2"), worker(1, "node-1")).hold == (), "only a job that asks for it"


def test_a_hang_restarts_in_full_every_rank_is_stuck_in_a_collective():
    s = spec(in_process_restart=True)
    silent = dict(last_progress_at=NOW - 31)
    d = running(worker(1, "node-1", **silent), worker(2, "node-2", **silent), s=s)
    assert d.action is Action.RESTART and "hang" in d.reason
    assert d.hold == ()


def test_ranks_that_left_their_group_restart_the_job_at_once_and_are_held_naming_the_silent_node():
    """A lost node reports nothing; the survivors' agent does (Interrupted), so the restart need not
    wait for the node to be declared lost."""
    s = spec(in_process_restart=True)
    ns = nodes(node("node-1"), node("node-2", heartbeat_at=NOW - 3))
    left = worker(1, "node-1", WorkerPhase.INTERRUPTED, message="ranks left the process group: rank 0: Connection reset by peer")
    d = running(left, worker(2, "node-2", last_progress_at=NOW - 3), s=s, ns=ns)
    assert d.action is Action.RESTART
    assert d.reason.startswith("worker on node-1: ranks left the process group: rank 0: Connection reset by peer"), d.reason
    assert "suspect: node-2 silent for 3.0 s" in d.reason, d.reason
    assert d.hold == ("node-1",), "not the worker of a node gone silent (no agent would hold it)"


def test_an_in_process_restart_places_around_a_held_worker_that_never_left_once_a_spare_is_free():
    """A lost node's worker was stepping a moment before, so it was asked to hold with the survivors;
    it never answers. Once the survivors left, the next attempt goes to them and a spare instead of
    waiting for the dead node's heartbeat to be overdue."""
    s = spec(in_process_restart=True)
    restarting = job(JobPhase.RESTARTING)
    held = worker(1, "node-1", WorkerPhase.STOPPED, desired=Desired.HOLD, ended_at=NOW - 0.6)
    unanswered = worker(2, "node-2", desired=Desired.HOLD)  # its node's heartbeat is still fresh (0.2 s)

    def restart(*ws: Worker, free: list[str], s: JobSpec = s) -> Decision:
        return decide(NOW, restarting, s, list(ws), HEALTHY, free, silent_after=SILENT_AFTER)

    d = restart(held, unanswered, free=["node-1", "node-2", "node-3"])
    assert d.action is Action.SCHEDULE and d.nodes == ("node-1", "node-3"), d
    assert "without node-2" in d.reason

    just_left = worker(1, "node-1", WorkerPhase.STOPPED, desired=Desired.HOLD, ended_at=NOW - 0.1)
    assert restart(just_left, unanswered, free=["node-1", "node-2", "node-3"]).action is Action.WAIT, "its peer may follow yet"
    assert restart(held, unanswered, free=["node-1", "node-2"]).action is Action.WAIT, "no spare: wait for node-2"
    stopping = worker(2, "node-2", desired=Desired.STOP)
    assert restart(held, stopping, free=["node-1", "node-2", "node-3"]).action is Action.WAIT, "a stop, not a hold: it confirms"
    assert restart(held, unanswered, free=["node-1", "node-2", "node-3"], s=spec()).action is Action.WAIT, "a full restart waits"
