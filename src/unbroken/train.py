"""The training-side API: ``ctx = unbroken.init()``.

Works the same under an unbroken agent and under plain ``torchrun`` (or plain
``python``): outside an agent, progress goes nowhere and checkpoints go to
``checkpoint_dir`` (argument, ``$UNBROKEN_CHECKPOINT_DIR``, or ``./checkpoints``).
Under an agent, a job file with checkpoint tiers gets the tiered checkpointer
(shared memory, replicas, persistent tier); the memory tier needs the agent
that owns it, so plain torchrun always gets the file checkpointer.
Logging goes out as JSON lines tagged with the rank's job, node, attempt and rank
(``structured_logs=False`` leaves the script's logging alone).
torch is imported lazily so that ``import unbroken`` stays cheap for the CLI.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from unbroken import logs
from unbroken.channel import MessageKind, RankMessage, RankSender
from unbroken.checkpoint.api import Checkpointer, RestoreReport, SaveReport
from unbroken.launch_env import LaunchEnv

_PR_SET_PDEATHSIG = 1


@dataclass
class Context:
    rank: int
    world_size: int
    local_rank: int
    job: str
    node: str
    attempt: int
    checkpoint: Checkpointer
    _sender: RankSender = field(repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def progress(self, step: int, **metrics: float) -> None:
        """Report that ``step`` finished. Cheap (one datagram) and never blocks.

        The agent uses it as this rank's heartbeat: no call for
        ``resilience.hang_timeout`` seconds means the job is hung.
        """
        self._send(MessageKind.PROGRESS, step, {k: float(v) for k, v in metrics.items()})

    def _send(self, kind: MessageKind, step: int | None, metrics: dict[str, float] | None = None, detail: str = "") -> None:
        self._sender.send(
            RankMessage(
                kind=kind, job=self.job, attempt=self.attempt, rank=self.rank, local_rank=self.local_rank,
                pid=os.getpid(), ts=time.time(), step=step, metrics=metrics or {}, detail=detail,
            ),
            must_arrive=kind is MessageKind.HELLO or kind is MessageKind.RESTORED,
        )


@dataclass
class _AgentObserver:
    """Tells the node agent of every save and restore: its metrics and the job's badput come from these."""

    ctx: Context | None = None

    def saved(self, report: SaveReport) -> None:
        if self.ctx is not None:
            self.ctx._send(MessageKind.SAVED, report.step, {"stall_seconds": report.stall_seconds, "bytes": float(report.bytes)},
                           report.tier)

    def restored(self, report: RestoreReport) -> None:
        if self.ctx is not None:
            self.ctx._send(MessageKind.RESTORED, report.step, {"seconds": report.seconds}, report.source)


def init(
    *,
    checkpoint_dir: str | Path | None = None,
    backend: str | None = None,
    init_process_group: bool = True,
    structured_logs: bool = True,
) -> Context:
    """Join the job: read rank and world size, start ``torch.distributed``, say hello to the agent.

    ``backend`` defaults to NCCL when CUDA is available, else gloo. With
    ``structured_logs``, the root logger writes JSON lines to stdout carrying
    ``job``, ``node``, ``attempt``, ``rank`` and ``local_rank`` (what is known), so
    log shippers (Loki, CloudWatch, Fluent Bit) read rank logs without a pattern;
    ``print`` output stays as printed.
    """
    env = LaunchEnv.from_environ()
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if structured_logs:
        known = {"job": env.job, "node": env.node, "attempt": env.attempt if env.managed else None}
        logs.setup(component="rank", **{k: v for k, v in known.items() if v is not None}, rank=rank, local_rank=local_rank)
    if env.managed:
        _die_with_parent()
    _record_uncaught_errors()
    sender = RankSender(env.agent_socket)
    directory = Path(checkpoint_dir) if checkpoint_dir else env.checkpoint_dir or Path("checkpoints")

    observer = _AgentObserver()  # bound to the context below: the checkpointer is part of it
    checkpointer: Checkpointer
    if env.checkpoint_tiers and env.managed:
        from unbroken.config.checkpoint import TierPolicy
        from unbroken.checkpoint.tiered import from_environment

        policy = TierPolicy.model_validate_json(env.checkpoint_tiers)
        checkpointer = from_environment(env, rank, world_size, policy, observer)
    else:
        from unbroken.checkpoint.file import FileCheckpointer

        checkpointer = FileCheckpointer(directory, rank=rank, world_size=world_size, keep=env.checkpoint_keep, observer=observer)
    ctx = Context(
        rank=rank, world_size=world_size, local_rank=local_rank, job=env.job, node=env.node,
        attempt=env.attempt, checkpoint=checkpointer, _sender=sender,
    )
    observer.ctx = ctx
    # Hello before joining the process group: from here on the agent expects progress,
    # so a rank stuck in rendezvous counts against startup_timeout.
    ctx._send(MessageKind.HELLO, None)
    if init_process_group and world_size > 1:
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
            if chosen == "nccl":
                torch.cuda.set_device(local_rank)
            dist.init_process_group(backend=chosen)
    return ctx


def _record_uncaught_errors() -> None:
    """Write an uncaught exception where torchrun looks for it (``TORCHELASTIC_ERROR_FILE``).

    torchrun then names it as the root cause, and the job's failure reason reads
    "rank 1 exited with code 1: CheckpointError: ... No space left on device"
    instead of a bare exit code. Chains to the previous hook; does nothing
    outside torchrun.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb) -> None:  # noqa: ANN001 - sys.excepthook's signature
        record = {"message": {
            "message": f"{exc_type.__name__}: {exc}",
            "extraInfo": {"py_callstack": "".join(traceback.format_exception(exc_type, exc, tb)),
                          "timestamp": str(int(time.time()))},
        }}
        try:
            Path(path).write_text(json.dumps(record))
        except OSError:
            pass  # the error still reaches stderr through the previous hook
        previous(exc_type, exc, tb)

    sys.excepthook = hook


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this rank when its torchrun dies.

    torchrun starts ranks in their own sessions, so a torchrun killed with
    SIGKILL (a node "losing power" under chaos, or an agent stopping a hung
    group) would otherwise leave orphaned ranks holding GPU memory and ports.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        return
    if os.getppid() == 1:  # parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)
