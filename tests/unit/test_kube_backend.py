"""How pods read as workers: pure functions of a pod's status (no API needed)."""

from __future__ import annotations

from unbroken.config.job import JobSpec
from unbroken.controller.job_decisions import Action, decide, is_peer_lost
from unbroken.kubernetes.backend.backend import _pod_phase, _what_failed, _worker_phase
from unbroken.state.phases import DeepHealthStatus, JobPhase, NodeState, WorkerPhase
from unbroken.state.records import Desired, Job, Node, Worker

TORCHRUN_KILLED = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
unbroken.workloads.mlp FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-24_10:00:00
  rank      : 1 (local_rank: 0)
  exitcode  : -9 (pid: 812)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 812
============================================================
"""

PEER_LOST = """\
  File "/x/torch/distributed/distributed_c10d.py", line 10, in all_reduce
    work.wait()
RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4211
"""


def status(terminated: dict, *, where: str = "lastState", phase: str = "Running") -> dict:
    running = {"running": {"startedAt": "2026-11-24T10:00:01Z"}}
    container = {"name": "pytorch", "restartCount": 1,
                 "state": {"terminated": terminated} if where == "state" else running,
                 "lastState": {"terminated": terminated} if where == "lastState" else {}}
    return {"phase": phase, "containerStatuses": [container]}


def test_a_container_restarted_in_place_after_a_failure_is_a_failed_worker() -> None:
    phase, code, message, ended = _pod_phase(status({"exitCode": 1, "message": TORCHRUN_KILLED, "finishedAt": "2026-11-24T10:00:00Z"}))
    assert (phase, code) == (WorkerPhase.FAILED, 1)
    assert message == "exited with code 1: Signal 9 (SIGKILL) received by PID 812"
    assert ended is not None


def test_a_pod_being_deleted_whose_container_runs_again_holds_a_restart_until_it_is_gone() -> None:
    """Attempt 0's Worker, its rank killed: the kubelet restarts the container in place (OnFailure) while the restart
    deletes the pod. Until the container is gone it can join attempt 1's rendezvous (seen on real nodes: it trained
    beside attempt 1's Master for 30 s, then its SIGKILL cost a second restart), so the restart waits for it."""
    failed_before = status({"exitCode": 1, "message": TORCHRUN_KILLED, "finishedAt": "2026-11-24T10:00:00Z"})
    deleting = {"metadata": {"name": "mlp-worker-0", "deletionTimestamp": "2026-11-24T10:00:02Z"}, "status": failed_before}
    assert _worker_phase(deleting) == (WorkerPhase.RUNNING, None, None, None)
    assert _worker_phase({**deleting, "metadata": {"name": "mlp-worker-0"}})[:2] == (WorkerPhase.FAILED, 1), \
        "not being deleted: the failure, which restarts the job"
    about_to_restart = {**deleting, "status": status({"exitCode": 1}, where="state")}  # pod phase Running: OnFailure
    assert _worker_phase(about_to_restart)[0] is WorkerPhase.PENDING, "its container may start again (seen in CI)"
    gone_by_now = {**deleting, "status": status({"exitCode": 137}, where="state", phase="Failed")}
    assert _worker_phase(gone_by_now)[0] is WorkerPhase.FAILED, "being deleted, its phase final: stopped"

    def restarting(pod: dict) -> Action:
        phase, code, message, ended = _worker_phase(pod)
        worker = Worker(job="ns/mlp", attempt=0, node="node-b", node_rank=1, desired=Desired.STOP, phase=phase,
                        rdzv_endpoint="", exit_code=code, message=message, ended_at=ended)
        nodes = {name: Node(name=name, group="workers", instance_type="gpu", state=NodeState.SCHEDULABLE,
                            deep_health=DeepHealthStatus.PASSED, heartbeat_at=999.8) for name in ("node-a", "node-b")}
        spec = JobSpec.model_validate({"name": "mlp", "nodes": 2, "command": ["-m", "x"], "resilience": {"auto_resume": True}})
        return decide(1000.0, Job(name="ns/mlp", spec_json="{}", phase=JobPhase.RESTARTING, created_at=0.0), spec,
                      [worker], nodes, ["node-a", "node-b"]).action
    assert restarting(deleting) is Action.WAIT
    assert restarting(about_to_restart) is Action.WAIT
    assert restarting(gone_by_now) is Action.SCHEDULE


def test_a_signal_exit_code_reads_as_the_signal() -> None:
    phase, code, message, _ = _pod_phase(status({"exitCode": 137}, where="state", phase="Failed"))
    assert (phase, code, message) == (WorkerPhase.FAILED, -9, "killed by SIGKILL (exit code 137)")


def test_a_peer_lost_failure_keeps_the_words_that_say_so() -> None:
    _, code, message, _ = _pod_phase(status({"exitCode": 1, "message": PEER_LOST}))
    assert message is not None and "Connection closed by peer" in message
    worker = Worker(job="j", attempt=0, node="n", node_rank=0, desired=Desired.RUN, phase=WorkerPhase.FAILED,
                    rdzv_endpoint="", exit_code=code, message=message)
    assert is_peer_lost(worker)


def test_pod_phases_without_failures() -> None:
    assert _pod_phase({"phase": "Pending"})[0] is WorkerPhase.PENDING
    assert _pod_phase({"phase": "Running", "containerStatuses": [{"state": {"running": {}}, "restartCount": 0}]})[0] is WorkerPhase.RUNNING
    assert _pod_phase({"phase": "Succeeded", "containerStatuses": [{"state": {"terminated": {"exitCode": 0}}}]})[:2] == (WorkerPhase.SUCCEEDED, 0)
    assert _pod_phase({"phase": "Failed", "message": "Pod was evicted"})[2] == "Pod was evicted"


def test_what_failed_falls_back_to_the_last_lines() -> None:
    assert _what_failed("starting\nstep 10\nbye\n") == "step 10 | bye"
    assert _what_failed("") == ""


def test_node_ranks_follow_training_operators_rank() -> None:
    from unbroken.kubernetes.backend.workloads import PYTORCHJOB

    def pod(kind: str, index: int) -> dict:
        return {"metadata": {"labels": {PYTORCHJOB.replica_type_label: kind, PYTORCHJOB.replica_index_label: str(index)}}}

    assert PYTORCHJOB.node_rank(pod("master", 0), masterless=False) == 0
    assert PYTORCHJOB.node_rank(pod("worker", 0), masterless=False) == 1
    assert PYTORCHJOB.node_rank(pod("worker", 2), masterless=False) == 3
    assert PYTORCHJOB.node_rank(pod("worker", 0), masterless=True) == 0  # a Worker-only job: worker 0 is rank 0


# --- an elastic job's member exits (absorb_member_exits) -------------------------------------------


def member(name: str, *, restarts: int = 0, state: dict | None = None, exited: int | None = None, deleting: bool = False,
           restart_policy: str = "OnFailure", phase: str = "Running") -> tuple[Worker, dict]:
    """A pod of an elastic PyTorchJob and the worker it reads as (kubernetes/backend/backend.py's own reading)."""
    from unbroken.kubernetes.backend.backend import _pod_phase

    container = {"name": "pytorch", "restartCount": restarts, "state": state or {"running": {"startedAt": "2026-11-24T10:00:05Z"}},
                 "lastState": {"terminated": {"exitCode": exited, "finishedAt": "2026-11-24T10:00:04Z"}} if exited else {}}
    pod = {"metadata": {"name": name, **({"deletionTimestamp": "2026-11-24T10:00:06Z"} if deleting else {})},
           "spec": {"restartPolicy": restart_policy}, "status": {"phase": phase, "containerStatuses": [container]}}
    pod_phase, code, message, ended = _pod_phase(pod["status"])
    worker = Worker(job="ns/elastic", attempt=0, node=f"node-{name}", node_rank=0, desired=Desired.RUN, phase=pod_phase,
                    rdzv_endpoint="", exit_code=code, message=message, ended_at=ended)
    return worker, pod


def test_an_elastic_members_exit_restarted_in_place_is_left_to_the_rendezvous() -> None:
    """Kubeflow's elastic example: a member killed, its container restarted by the kubelet, the other agents regroup.
    Within minReplicas and maxRestarts that is no failure: the member reads as running again (it once restarted the
    whole job and spent its retry budget)."""
    from unbroken.kubernetes.backend.backend import absorb_member_exits

    killed = member("w0", restarts=1, exited=137)
    assert killed[0].phase is WorkerPhase.FAILED, "without the elastic policy it is a failure, as before"
    workers = absorb_member_exits([killed, member("w1")], fewest=1, budget=100)
    assert [w.phase for w in workers] == [WorkerPhase.RUNNING, WorkerPhase.RUNNING]
    assert workers[0].exit_code is None and workers[0].message is None

    waiting = member("w0", restarts=1, exited=1, state={"waiting": {"reason": "CrashLoopBackOff"}})
    assert [w.phase for w in absorb_member_exits([waiting, member("w1")], fewest=1, budget=100)] == \
        [WorkerPhase.PENDING, WorkerPhase.RUNNING]
    done = member("w0", restarts=1, exited=1, state={"terminated": {"exitCode": 0}}, phase="Succeeded")
    assert absorb_member_exits([done, member("w1")], fewest=1, budget=100)[0].phase is WorkerPhase.SUCCEEDED


def test_an_elastic_job_past_its_restarts_or_below_its_min_is_a_failure_that_says_which() -> None:
    from unbroken.kubernetes.backend.backend import absorb_member_exits

    over = absorb_member_exits([member("w0", restarts=3, exited=1), member("w1", restarts=1)], fewest=1, budget=3)
    assert over[0].phase is WorkerPhase.FAILED and "4 member restarts, over elasticPolicy.maxRestarts 3" in (over[0].message or "")
    waiting = {"waiting": {"reason": "CrashLoopBackOff"}}
    below = absorb_member_exits([member("w0", restarts=1, exited=1, state=waiting), member("w1")], fewest=2, budget=10)
    assert below[0].phase is WorkerPhase.FAILED and "1 members up, below elasticPolicy.minReplicas 2" in (below[0].message or "")
    assert below[1].phase is WorkerPhase.RUNNING


def test_a_member_that_will_not_be_restarted_in_place_is_a_failure() -> None:
    """``restartPolicy: Never``, a Failed pod or one being deleted: nothing brings the member back in place."""
    from unbroken.kubernetes.backend.backend import absorb_member_exits

    for gone in (member("w0", restarts=0, exited=1, restart_policy="Never", state={"terminated": {"exitCode": 1}}, phase="Failed"),
                 member("w0", restarts=1, exited=1, deleting=True)):
        assert absorb_member_exits([gone, member("w1")], fewest=1, budget=100)[0].phase is WorkerPhase.FAILED
