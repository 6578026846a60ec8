"""How pods read as workers: pure functions of a pod's status (no API needed)."""

from __future__ import annotations

from unbroken.controller.job_decisions import is_peer_lost
from unbroken.backends.kubernetes.backend import _pod_phase, _what_failed
from unbroken.state.phases import WorkerPhase
from unbroken.state.records import Desired, Worker

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
    from unbroken.backends.kubernetes.workloads import PYTORCHJOB

    def pod(kind: str, index: int) -> dict:
        return {"metadata": {"labels": {PYTORCHJOB.replica_type_label: kind, PYTORCHJOB.replica_index_label: str(index)}}}

    assert PYTORCHJOB.node_rank(pod("master", 0), masterless=False) == 0
    assert PYTORCHJOB.node_rank(pod("worker", 0), masterless=False) == 1
    assert PYTORCHJOB.node_rank(pod("worker", 2), masterless=False) == 3
    assert PYTORCHJOB.node_rank(pod("worker", 0), masterless=True) == 0  # a Worker-only job: worker 0 is rank 0
