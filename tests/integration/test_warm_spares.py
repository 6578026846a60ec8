"""Warm spares (issue 11, item 3): a restart takes a torchrun that has imported torch already,
whose ranks fork from a forkserver that has imported it too, and the job cannot tell.

The shipped MLP workload on a real local cluster, its final parameters compared bit for bit
with the uninterrupted reference run, as the other fault tests do.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from helpers import STEPS, assert_same_parameters

from unbroken.plumbing import procs
from unbroken.supervision.torchrun import TRAMPOLINE, describe_exit
from unbroken.supervision.spare_pool import SparePool
from unbroken.supervision.warm_spare import READY_MARK, Identity
from unbroken.config.job import JobSpec
from unbroken.rank.registry import REGISTRY_DIR
from unbroken.plumbing.waiting import wait_until

WARM_MARK = "this torchrun is a warm spare"


def test_restarts_run_on_warm_spares_whose_ranks_chaos_and_the_agent_still_find(cluster3, tmp_path, reference):
    output = cluster3.submit(tmp_path, "warm", steps=STEPS, step_time=0.3, checkpoint_every=5, hang_timeout=4, warm_spares=1)
    cluster3.wait_step("warm", 3, 120)
    layout = cluster3.layout

    def spares_log(node: str) -> str:
        path = layout.node_dir(node) / "spares-warm.log"
        return path.read_text() if path.exists() else ""

    # Once the job trains, each node warms one spare for it (never before: warming must not
    # slow a startup), the idle third node too: it would replace a lost one.
    wait_until(lambda: all(READY_MARK in spares_log(n) for n in ("node-1", "node-2", "node-3")), 60, "a ready warm spare on every node")
    killed_at = cluster3.step("warm")
    assert killed_at < STEPS - 15, f"the job is too close to its end ({killed_at}) for the test to mean anything"

    cluster3.cli("chaos", "kill-worker", "warm", "--rank", "3")
    cluster3.wait_step("warm", killed_at + 2, 120, attempt=1)
    # both nodes' torchruns of attempt 1 are the spares, and their ranks are forks, not new processes
    for worker in cluster3.workers("warm", 1):
        log = (layout.worker_log_dir("warm", 1, worker.node) / "torchrun.log").read_text()
        assert WARM_MARK in log, f"attempt 1 on {worker.node} did not start on a warm spare:\n{log[-2000:]}"
    naming = [e.message for e in cluster3.store.list_events(object_kind="Job", object_name="warm")
              if e.reason in ("JobRestarting", "JobRestartCause")]
    assert any("rank 3 (local rank 1)" in m for m in naming), naming

    # A forked rank's environment is its forkserver's: chaos finds it by the rank registry
    # instead, and stops the real rank, which the controller sees as a hang.
    cluster3.cli("chaos", "hang-worker", "warm", "--rank", "1")
    job = cluster3.wait_job_phase("warm", {"Restarting", "Succeeded", "Failed"}, 60)
    assert job.phase.value == "Restarting", job.reason
    assert "hang" in job.reason and "hang_timeout 4" in job.reason, job.reason

    # ranks that end well record it: the job's end is a success, not a rank "killed by a signal"
    job = cluster3.wait_job_phase("warm", {"Succeeded", "Failed"}, 180)
    assert job.phase.value == "Succeeded", job.reason
    assert job.attempt == 2
    assert_same_parameters(reference, output)


SCRIPT = """
import json, os, sys
warm = "torch" in sys.modules  # imported by the forkserver before this rank existed
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
rank = dist.get_rank()
with open(f"rank{rank}.json", "w") as out:
    json.dump({"warm": warm, "world": int(t.item()), "job": os.environ.get("UNBROKEN_JOB"), "argv": sys.argv[1:]}, out)
dist.destroy_process_group()
if rank == 1 and os.environ.get("FAIL_RANK_1"):
    sys.exit(3)
if os.environ.get("EXIT_RANK"):  # how the shipped workloads end (LLM, ResNet): flushed, then at once
    from unbroken.workloads.script import exit_rank
    exit_rank(0)
"""


def _spare_job(tmp_path: Path) -> JobSpec:
    (tmp_path / "script.py").write_text(SCRIPT)
    return JobSpec.model_validate({"name": "s", "nodes": 1, "procs_per_node": 2, "command": ["script.py", "-u", "x"],
                                   "working_dir": str(tmp_path), "resilience": {"warm_spares": 1}})


def _run_on_spare(pool: SparePool, spec: JobSpec, log_dir: Path, env: dict[str, str]) -> int:
    """Hand a ready spare an identity (a standalone torchrun of ``spec``); its exit code, once it and its forkserver are gone."""
    pool.keep({"s": (spec, {"UNBROKEN_JOB": "s"})}, may_start=True)
    spare = pool.take("s")
    assert spare is not None
    wait_until(lambda: len(procs.tree(spare.process.pid)) >= 2, 60, "the spare's forkserver")
    family = procs.tree(spare.process.pid)
    log_dir.mkdir(parents=True)
    args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "--log-dir", str(log_dir), "--redirects", "3",
            *spec.command]
    identity = Identity(args, {**env, REGISTRY_DIR: str(log_dir / "ranks")}, str(spec.working_dir), str(log_dir / "torchrun.log"))
    assert spare.process.stdin is not None
    spare.process.stdin.write(identity.to_line())
    spare.process.stdin.close()
    code = spare.process.wait(timeout=120)
    wait_until(lambda: not [p for p in family if procs.alive(p.pid)], 10, "the spare's forkserver to follow it")
    return code


def test_a_spare_runs_a_plain_script_with_torch_already_imported_and_ranks_record_their_exit(tmp_path):
    pool = SparePool("n", tmp_path / "spares", TRAMPOLINE)
    spec = _spare_job(tmp_path)
    try:
        log_dir = tmp_path / "ok"
        code = _run_on_spare(pool, spec, log_dir, {"UNBROKEN_JOB": "s"})
        assert code == 0, (log_dir / "torchrun.log").read_text()
        assert WARM_MARK in (log_dir / "torchrun.log").read_text()
        for rank in (0, 1):
            out = json.loads((tmp_path / f"rank{rank}.json").read_text())
            # the identity's environment reached the rank; "-u" among the script's own arguments survives
            assert out == {"warm": True, "world": 2, "job": "s", "argv": ["-u", "x"]}, out
        registered = sorted(json.loads(p.read_text())["rank"] for p in (log_dir / "ranks").glob("*.json"))
        assert registered == [0, 1]
        assert [p.read_text() for p in (log_dir / "ranks").glob("*.exit")] == ["0", "0"]

        # a rank that exits 3: torchrun fails as a cold one does, and its root cause names the rank and the code
        log_dir = tmp_path / "fail"
        code = _run_on_spare(pool, spec, log_dir, {"UNBROKEN_JOB": "s", "FAIL_RANK_1": "1"})
        assert code == 1
        assert describe_exit(code, log_dir) == (3, "rank 1 (local rank 1) exited with code 3"), (log_dir / "torchrun.log").read_text()
        exits = {json.loads(p.read_text())["local_rank"]: p.with_suffix(".exit").read_text() for p in (log_dir / "ranks").glob("*.json")}
        assert exits == {0: "0", 1: "3"}
    finally:
        pool.close()


def test_a_spare_whose_ranks_end_with_exit_rank_finishes(tmp_path):
    """On an H100 the LLM workload on a warm spare trained to its last step and its job stayed Running: its ranks
    ended with ``os._exit`` (exit_rank), and torchrun's elastic agent, which runs a spare's ranks as functions,
    counts a rank done only once the function returns its value. The cause is not CUDA's; it shows here."""
    pool = SparePool("n", tmp_path / "spares", TRAMPOLINE)
    try:
        log_dir = tmp_path / "exit-rank"
        code = _run_on_spare(pool, _spare_job(tmp_path), log_dir, {"UNBROKEN_JOB": "s", "EXIT_RANK": "1"})
        assert code == 0, (log_dir / "torchrun.log").read_text()
        assert sorted(p.read_text() for p in (log_dir / "ranks").glob("*.exit")) == ["0", "0"]
    finally:
        pool.close()


LINGERING = """
import threading, time
import unbroken

ctx = unbroken.init()
for step in range(1, 4):
    ctx.progress(step)
ctx.finished()
# a teardown stuck for good: a non-daemon thread that never ends keeps the interpreter from exiting
threading.Thread(target=time.sleep, args=(10**6,), daemon=False).start()
"""


def test_ranks_that_said_they_finished_and_do_not_exit_are_ended_and_the_job_succeeds(make_cluster, tmp_path):
    cluster = make_cluster("--nodes", "1")
    (tmp_path / "linger.py").write_text(LINGERING)
    spec = {"name": "linger", "nodes": 1, "procs_per_node": 2, "command": ["linger.py"], "working_dir": str(tmp_path),
            "resilience": {"auto_resume": True, "max_retry": 1, "hang_timeout": 20}}
    (tmp_path / "linger.yaml").write_text(json.dumps(spec))
    cluster.cli("job", "start", "-f", str(tmp_path / "linger.yaml"))
    job = cluster.wait_job_phase("linger", {"Succeeded", "Failed"}, 120)
    assert job.phase.value == "Succeeded" and job.attempt == 0, job.reason
    events = [e for e in cluster.store.list_events(object_kind="Job", object_name="linger") if e.reason == "RanksEndedAfterFinishing"]
    assert len(events) == 1 and "10 s later" in events[0].message, events
    assert not [p for p in procs.cluster_processes(cluster.dir) if "linger.py" in " ".join(p.cmdline())]


def test_a_released_spare_leaves_no_process_behind(tmp_path):
    pool = SparePool("n", tmp_path / "spares", TRAMPOLINE)
    pool.keep({"s": (_spare_job(tmp_path), {})}, may_start=True)
    log = tmp_path / "spares" / "spares-s.log"
    wait_until(lambda: log.exists() and READY_MARK in log.read_text(), 60, "the spare to warm")
    pid = int(re.search(r"pid (\d+)", log.read_text()).group(1))  # type: ignore[union-attr]
    family = procs.tree(pid)
    assert len(family) >= 2, "the spare and its forkserver"
    pool.keep({}, may_start=True)  # the job no longer runs here: its spares go
    wait_until(lambda: not [p for p in family if procs.alive(p.pid)], 10, "the spare and its forkserver to go")
    assert pool.take("s") is None
