"""Standby ranks (issue 33, a warm spare under 2 s on a GPU): a spare's ranks handed to processes that started CUDA
before the fault, while torchrun, the agent and the rank registry see what they see of a forked rank.

What a standby prepares on a GPU (CUDA's context, the first kernels) cannot happen here; ``UNBROKEN_STANDBY_RANKS=
always`` starts standbys on this CPU machine, and everything else, the hand-over (environment, folder, command, the
rank's stdin/stdout/stderr), signals, exit codes, a killed rank, a killed proxy, a refused hand-over, runs for real:
a real warm spare, a real torchrun, real gloo ranks.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import psutil

from unbroken.config.job import JobSpec
from unbroken.plumbing import procs
from unbroken.plumbing.waiting import wait_until
from unbroken.rank.registry import REGISTRY_DIR
from unbroken.supervision import standby_rank
from unbroken.supervision.spare_pool import SparePool
from unbroken.supervision.torchrun import TRAMPOLINE, describe_exit
from unbroken.supervision.warm_spare import Identity

IN_STANDBY = "runs in a standby rank"

SCRIPT = """
import json, os, sys, time
from pathlib import Path
import torch
import torch.distributed as dist

print(f"rank script on stdout {os.environ['RANK']}", flush=True)
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
rank = dist.get_rank()
with open(f"rank{rank}.json", "w") as out:
    json.dump({"pid": os.getpid(), "world": int(t.item()), "job": os.environ.get("UNBROKEN_JOB"), "argv": sys.argv[1:],
               "cwd": os.getcwd()}, out)
if os.environ.get("WAIT_FOR"):  # the test kills something meanwhile
    while not Path(os.environ["WAIT_FOR"]).exists():
        time.sleep(0.05)
dist.destroy_process_group()
if rank == 1 and os.environ.get("FAIL_RANK_1"):
    sys.exit(3)
if os.environ.get("EXIT_RANK"):
    from unbroken.workloads.script import exit_rank
    exit_rank(0)
"""


def _spec(tmp_path: Path) -> JobSpec:
    (tmp_path / "script.py").write_text(SCRIPT)
    return JobSpec.model_validate({"name": "s", "nodes": 1, "procs_per_node": 2, "command": ["script.py", "-u", "x"],
                                   "working_dir": str(tmp_path), "resilience": {"warm_spares": 1}})


class SpareRun:
    """One warm spare with standbys (``always``) given a standalone torchrun of the test job."""

    def __init__(self, tmp_path: Path, name: str, env: dict[str, str], spare_env: dict[str, str] | None = None) -> None:
        self.tmp_path = tmp_path
        self.log_dir = tmp_path / name
        self.pool = SparePool("n", tmp_path / "spares", TRAMPOLINE)
        spec = _spec(tmp_path)
        self.pool.keep({"s": (spec, {standby_rank.POLICY: "always", **(spare_env or {})})}, may_start=True)
        spare = self.pool.take("s")
        assert spare is not None
        self.spare = spare
        spares_log = tmp_path / "spares" / "spares-s.log"
        wait_until(lambda: spares_log.exists() and spares_log.read_text().count("standby rank") >= 2, 120,
                   "the spare's two standby ranks to be ready")
        self.family = procs.tree(spare.process.pid)
        self.log_dir.mkdir(parents=True)
        args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "--log-dir", str(self.log_dir), "--redirects", "3",
                *spec.command]
        identity = Identity(args, {"UNBROKEN_JOB": "s", **env, REGISTRY_DIR: str(self.log_dir / "ranks")}, str(tmp_path),
                            str(self.log_dir / "torchrun.log"))
        assert spare.process.stdin is not None
        spare.process.stdin.write(identity.to_line())
        spare.process.stdin.close()

    def ranks(self) -> dict[int, int]:
        """rank -> pid, as the rank registry says."""
        return {json.loads(p.read_text())["rank"]: int(p.stem) for p in (self.log_dir / "ranks").glob("*.json")}

    def end(self) -> int:
        code = self.spare.process.wait(timeout=120)
        wait_until(lambda: not [p for p in self.family if procs.alive(p.pid)], 10, "the spare, its forkserver and standbys to go")
        self.pool.close()
        return code

    def torchrun_log(self) -> str:
        return (self.log_dir / "torchrun.log").read_text()

    def in_standby(self) -> int:
        """How many ranks said, on their stderr, that they run in a standby."""
        return sum(IN_STANDBY in p.read_text() for p in self.log_dir.rglob("stderr.log"))


def _cmdline(pid: int) -> str:
    return " ".join(psutil.Process(pid).cmdline())


def test_ranks_run_in_standbys_and_end_as_forked_ranks_do(tmp_path):
    run = SpareRun(tmp_path, "ok", {"WAIT_FOR": str(tmp_path / "go")})
    try:
        wait_until(lambda: len(run.ranks()) == 2 and all((tmp_path / f"rank{r}.json").exists() for r in (0, 1)), 60, "both ranks")
        for rank, pid in run.ranks().items():
            # the registered rank is the standby process (not torchrun's fork), and it is the process running the script
            assert "standby_rank" in _cmdline(pid), _cmdline(pid)
            out = json.loads((tmp_path / f"rank{rank}.json").read_text())
            assert out == {"pid": pid, "world": 2, "job": "s", "argv": ["-u", "x"], "cwd": str(tmp_path)}, out
        (tmp_path / "go").touch()
        assert run.end() == 0, run.torchrun_log()
    finally:
        run.pool.close()
    assert run.in_standby() == 2
    # the rank's stdout reached torchrun's per-rank files through the hand-over
    stdout = sorted(run.log_dir.rglob("stdout.log"))
    assert sorted(p.read_text().strip() for p in stdout) == ["rank script on stdout 0", "rank script on stdout 1"]
    assert sorted(p.read_text() for p in (run.log_dir / "ranks").glob("*.exit")) == ["0", "0"]


def test_a_standby_ranks_exit_code_and_exit_rank_are_torchruns_to_see(tmp_path):
    run = SpareRun(tmp_path, "fail", {"FAIL_RANK_1": "1"})
    code = run.end()
    assert code == 1
    assert describe_exit(code, run.log_dir) == (3, "rank 1 (local rank 1) exited with code 3"), run.torchrun_log()

    run = SpareRun(tmp_path, "exit-rank", {"EXIT_RANK": "1"})
    assert run.end() == 0, run.torchrun_log()
    assert run.in_standby() == 2


def test_a_killed_standby_rank_reads_as_a_killed_rank(tmp_path):
    run = SpareRun(tmp_path, "kill", {"WAIT_FOR": str(tmp_path / "never")})
    wait_until(lambda: len(run.ranks()) == 2 and (tmp_path / "rank1.json").exists(), 60, "both ranks")
    psutil.Process(run.ranks()[1]).send_signal(signal.SIGKILL)
    code = run.end()
    assert code == 1
    assert describe_exit(code, run.log_dir)[1] == "rank 1 (local rank 1) exited with signal 9 (SIGKILL)", run.torchrun_log()


def test_a_standby_rank_follows_its_proxy_when_torchrun_kills_that(tmp_path):
    run = SpareRun(tmp_path, "proxy", {"WAIT_FOR": str(tmp_path / "never")})
    try:
        wait_until(lambda: len(run.ranks()) == 2 and (tmp_path / "rank0.json").exists(), 60, "both ranks")
        rank0 = run.ranks()[0]
        family = procs.tree(run.spare.process.pid)
        forkserver = [p.pid for p in family if "forkserver" in " ".join(p.cmdline())]
        proxies = [p for p in family if p.ppid() in forkserver]  # torchrun's ranks, forked by the forkserver
        assert len(proxies) == 2, [(p.pid, p.cmdline()) for p in procs.tree(run.spare.process.pid)]
        started = time.monotonic()
        for proxy in proxies:
            proxy.send_signal(signal.SIGKILL)
        wait_until(lambda: not procs.alive(rank0), 5, "the standby rank to follow its killed proxy")
        assert time.monotonic() - started < 5
        run.end()
    finally:
        run.pool.close()


def test_a_rank_whose_devices_differ_from_the_standbys_forks_as_before(tmp_path):
    # the standbys started CUDA (here: nothing) under the spare's CUDA_VISIBLE_DEVICES; a job that names other devices
    # must not run on them
    run = SpareRun(tmp_path, "devices", {"CUDA_VISIBLE_DEVICES": "", "WAIT_FOR": str(tmp_path / "go")})
    try:
        wait_until(lambda: len(run.ranks()) == 2, 60, "both ranks")
        assert not [pid for pid in run.ranks().values() if "standby_rank" in _cmdline(pid)]
        (tmp_path / "go").touch()
        assert run.end() == 0, run.torchrun_log()
    finally:
        run.pool.close()
    assert run.in_standby() == 0


def test_no_standby_where_a_job_says_never_or_there_is_no_cuda():
    assert standby_rank.wanted({standby_rank.LOCAL_RANKS: "8", standby_rank.POLICY: "never"}) == 0
    assert standby_rank.wanted({standby_rank.LOCAL_RANKS: "8", standby_rank.POLICY: "always"}) == 8
    assert standby_rank.wanted({standby_rank.LOCAL_RANKS: "8"}) == 0  # this machine has no CUDA
    assert standby_rank.wanted({standby_rank.LOCAL_RANKS: "8", standby_rank.POLICY: "sometimes"}) == 0  # read as cuda
