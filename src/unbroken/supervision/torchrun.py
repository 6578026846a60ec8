"""Start and stop one worker: the ``torchrun`` group of a job attempt on this node."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from unbroken.plumbing import procs
from unbroken.rank import registry as rank_registry, symptoms
from unbroken.plumbing.ports import free_port
from unbroken.plumbing import trampoline
from unbroken.supervision import warm_spare
from unbroken.supervision.spare_pool import Spare
from unbroken.config.job import HANG_TIMEOUT_FALLBACK_S, STARTUP_TIMEOUT_FALLBACK_S, JobSpec
from unbroken.rank.env import GroupPlacement, LaunchEnv
from unbroken.state.records import Worker

TRAMPOLINE = trampoline.TRAMPOLINE
"""What starts torchrun and the warm spares (plumbing/trampoline.py), for those that start them."""

STOP_GRACE_SECONDS = 3.0
"""SIGTERM lets torchrun tear its ranks down cleanly; 3 s is plenty for that and
short enough that a hung (SIGSTOPped) group does not delay the restart."""



def torchrun_args(spec: JobSpec, worker: Worker, log_dir: Path, local_addr: str | None = None, *, nnodes: int | None = None) -> list[str]:
    """torchrun's arguments (what follows ``python -m torch.distributed.run``) for the worker.
    ``nnodes``: the attempt's nodes (default ``spec.nodes``; fewer for an elastic job below its size)."""
    host, port = worker.rdzv_endpoint.rsplit(":", 1)
    if spec.resilience.in_process_restart:
        # Each node's torchrun on its own: its ranks form the job's process group themselves, at the
        # attempt's endpoint (train.py), so a torchrun outlives the attempt it was launched for and
        # never waits on other nodes' torchruns (whose store may be gone with a lost node 0).
        group = ["--nnodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
        local_addr = None
    else:
        # The controller has placed the attempt already (its nodes, their ranks, node 0's address
        # and port), so the static rendezvous: node 0's torchrun hosts the store, the others
        # connect, and they meet at once. c10d's rendezvous found the same answer by polling
        # its store once a second, which cost a restart up to a second.
        group = ["--nnodes", str(nnodes or spec.nodes), "--node-rank", str(worker.node_rank),
                 "--master-addr", host, "--master-port", port]
    argv = [
        *group,
        "--nproc-per-node", str(spec.procs_per_node),
        "--rdzv-backend", "static",
        "--rdzv-id", f"{worker.job}-attempt-{worker.attempt}",
        "--rdzv-conf", f"timeout={int(spec.resilience.startup_timeout or STARTUP_TIMEOUT_FALLBACK_S)}",
        # unbroken owns restarts (on healthy nodes, with a retry budget), not torchrun.
        "--max-restarts", "0",
        "--monitor-interval", "0.2",
        "--log-dir", str(log_dir),
        "--redirects", "3",
    ]
    if local_addr and not local_addr.startswith("127."):
        # a node in its own network namespace: its peers reach it at this address, not at the
        # (shared) hostname torchrun would otherwise advertise
        argv += ["--local-addr", local_addr]
    command = list(spec.command)
    if command[0] == "-m":
        argv += ["--module", *command[1:]]
    else:
        argv += command
    return argv


@dataclass(frozen=True)
class NodeSettings:
    """What the node's agent tells every rank it launches, besides the job's own settings."""

    agent_socket: Path
    """Where ``ctx.progress`` sends to (the agent's channel)."""
    checkpoint_endpoint: str | None
    """The agent's shard server, for the tiered checkpoint's restore catalog."""
    local_addr: str
    """The node's address: ranks in a network namespace advertise it to their peers."""


@dataclass
class RunningWorker:
    worker_id: int
    process: subprocess.Popen[bytes]
    log_dir: Path
    stop_started: float | None = None
    members: list[psutil.Process] = field(default_factory=list)
    reported: bool = False
    """Its failure is written already (a rank seen dying): its exit closes nothing more."""
    reported_unread: bool = False
    """What it reported named a rank whose end torchrun reaped unread, or a SIGTERM (maybe torchrun's
    teardown): its exit reads torchrun's root cause (symptoms.says_exit_unread)."""
    warm: bool = False
    """A warm spare became this torchrun: its ranks are forks of the spare's forkserver, and say who they are
    in ``log_dir/ranks`` (rank/registry.py), not in their environment."""
    rejoin_dir: Path | None = None
    """Its ranks' handshake folder for in-process restarts (rank/rejoin.py); None for a job without them."""
    ranks: int = 1
    abort_timeout: float = 0.0
    """In-process restarts: how long its ranks have to leave their process group once asked to hold."""
    hold_started: float | None = None
    finished_lingering: bool = False
    """Its ranks all said they finished and it was ended for not exiting: it succeeded, whatever its exit code."""

    def begin_stop(self) -> None:
        """SIGTERM (+SIGCONT) the whole tree once; :meth:`continue_stop` escalates."""
        if self.stop_started is not None:
            return
        self.stop_started = time.monotonic()
        self.members = procs.tree(self.process.pid)
        procs.signal_all(self.members, signal.SIGTERM)
        procs.signal_all(self.members, signal.SIGCONT)

    def continue_stop(self) -> None:
        if self.stop_started is not None and time.monotonic() - self.stop_started > STOP_GRACE_SECONDS:
            procs.kill_now(self.members + procs.tree(self.process.pid))

    def kill(self) -> None:
        procs.kill_now(procs.tree(self.process.pid))
        self.process.wait()

    def exited(self) -> int | None:
        """torchrun's return code once the whole tree is gone, else None."""
        code = self.process.poll()
        if code is None:
            return None
        if any(procs.alive(p.pid) for p in self.members):
            return None  # torchrun is gone but a rank lingers: not stopped yet
        return code


def group_placement(spec: JobSpec, worker: Worker, log_dir: Path, nnodes: int | None) -> GroupPlacement | None:
    """For a job with in-process restarts: the worker's place in its attempt, for its ranks' own rendezvous."""
    if not spec.resilience.in_process_restart:
        return None
    return GroupPlacement(group_rank=worker.node_rank, nnodes=nnodes or spec.nodes, rendezvous=worker.rdzv_endpoint,
                          rejoin_dir=log_dir / "rejoin", collective_timeout=spec.resilience.hang_timeout or HANG_TIMEOUT_FALLBACK_S)


def job_environ(spec: JobSpec, launch_env: LaunchEnv) -> dict[str, str]:
    """The job's part of a rank's environment, on top of the agent's own."""
    return {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **spec.env, **launch_env.to_environ()}


def launch(
    spec: JobSpec, worker: Worker, *, cluster_dir: Path, node: str, log_dir: Path, checkpoint_dir: Path, settings: NodeSettings,
    nnodes: int | None = None, spare: Spare | None = None,
) -> RunningWorker:
    """Start the worker's torchrun: a new process, or ``spare`` (a warm one, see supervision/warm_spare.py) given its identity."""
    log_dir.mkdir(parents=True, exist_ok=True)
    group = group_placement(spec, worker, log_dir, nnodes)
    job_env = job_environ(spec, launch_environ(spec, worker.job, worker.attempt, cluster_dir=cluster_dir, node=node,
                                               checkpoint_dir=checkpoint_dir, settings=settings, group=group))
    args = torchrun_args(spec, worker, log_dir, settings.local_addr, nnodes=nnodes)
    in_process: dict[str, Any] = {"ranks": spec.procs_per_node}
    if group is not None:
        in_process.update(rejoin_dir=group.rejoin_dir, abort_timeout=spec.resilience.in_process_abort_timeout)
    process, warm = start_torchrun(args, job_env, working_dir=str(spec.working_dir or Path.cwd()), log_dir=log_dir,
                                   log=str(log_dir / "torchrun.log"), spare=spare)
    return RunningWorker(worker_id=worker.id, process=process, log_dir=log_dir, warm=warm, **in_process)


def start_torchrun(args: list[str], job_env: dict[str, str], *, working_dir: str, log_dir: Path, log: str,
                   spare: Spare | None = None, base_env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], bool]:
    """torchrun with ``args``: ``spare`` given its identity (then True: warm, its ranks register in ``log_dir/ranks``),
    else a new process in ``base_env`` (default: ours) plus ``job_env``. Its output goes to ``log``."""
    if spare is not None and spare.process.stdin is not None:
        identity = warm_spare.Identity(args, {**job_env, rank_registry.REGISTRY_DIR: str(log_dir / "ranks")}, working_dir, log)
        try:
            spare.process.stdin.write(identity.to_line())
            spare.process.stdin.close()
            return spare.process, True
        except BrokenPipeError:
            spare.process.wait()  # it died since it was taken: start cold, as without a spare
    env = {**(os.environ if base_env is None else base_env), **job_env}
    argv = trampoline.command("-m", "torch.distributed.run", *args)
    with open(log, "ab") as out:
        process = subprocess.Popen(
            argv, cwd=working_dir, env=env, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
    return process, False


def launch_environ(spec: JobSpec, job: str, attempt: int, *, cluster_dir: Path, node: str, checkpoint_dir: Path,
                   settings: NodeSettings, group: GroupPlacement | None = None) -> LaunchEnv:
    tiers = spec.checkpoint.tiers
    return LaunchEnv(
        cluster_dir=cluster_dir.resolve(), node=node, job=job, attempt=attempt,
        checkpoint_dir=checkpoint_dir, checkpoint_keep=spec.checkpoint.keep,
        checkpoint_tiers=tiers.model_dump_json() if tiers else None, checkpoint_endpoint=settings.checkpoint_endpoint,
        agent_socket=settings.agent_socket, group=group,
    )


_ROOT_CAUSE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE)


def describe_exit(code: int, log_dir: Path) -> tuple[int, str]:
    """The failing rank's exit code (negative: signal) and a sentence for the event.

    torchrun exits 1 whatever killed its rank; its "Root Cause" block in the
    log names the rank and the real exit code, which is what a person (and the
    ExitCode restart policy) needs.
    """
    cause = root_cause(log_dir) if code != 0 else None
    return cause if cause is not None else (code, f"torchrun {_exit_words(code)}")


def root_cause(log_dir: Path) -> tuple[int, str] | None:
    """The failing rank's exit code and sentence from torchrun's "Root Cause" block, once it wrote one."""
    matches = _ROOT_CAUSE.findall(_tail(log_dir / "torchrun.log"))
    if not matches:
        return None
    # torchrun stops a failed rank's siblings with SIGTERM, and its "first observed failure" goes by
    # one-second time stamps, so a sibling's SIGTERM can be named the root cause of a rank's own exit.
    # Blame a rank that failed of its own accord when torchrun lists one; the root cause block
    # comes last, so it is still preferred among those.
    own = [m for m in matches if int(m[2]) != -signal.SIGTERM]
    rank, local_rank, rank_code = (own or matches)[-1]
    return int(rank_code), rank_exit_message(int(rank), int(local_rank), int(rank_code), log_dir)


def rank_exit_message(rank: int | str, local_rank: int, code: int | None, log_dir: Path) -> str:
    """``rank 3 (local rank 1) exited with signal 9 (SIGKILL)``, with the exception it died of if it left one."""
    error = _rank_error(log_dir, local_rank)
    detail = f": {error}" if error else ""
    return f"rank {rank} (local rank {local_rank}) {_exit_words(code)}{detail}"


_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt)\b.*$")


def _rank_error(log_dir: Path, local_rank: int, limit: int = 300) -> str | None:
    """The exception a rank died of, on one line: from torchrun's error file (``unbroken.init()``
    writes it), else the last exception line of the rank's stderr (a plain script's traceback)."""
    for path in sorted(log_dir.glob(f"*/attempt_*/{local_rank}/error.json"), reverse=True):
        try:
            message = json.loads(path.read_text())["message"]
            text = message["message"] if isinstance(message, dict) else str(message)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        return _one_line(text, limit)
    for path in sorted(log_dir.glob(f"*/attempt_*/{local_rank}/stderr.log"), reverse=True):
        lines = [line for line in _tail(path).splitlines() if _EXCEPTION_LINE.match(line)]
        if lines:
            return _one_line(lines[-1], limit)
    return None


def _one_line(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _exit_words(code: int | None) -> str:
    if code is None:
        # reaped (by a warm spare's forkserver, or by a cold torchrun on a busy node) before the
        # agent could read its status
        return f"{symptoms.UNREAD_EXIT} (it reaped the rank before the agent read its status)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown"
        return f"exited with signal {-code} ({name})"
    return f"exited with code {code}"


def _tail(path: Path, size: int = 64 * 1024) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
