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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from unbroken.plumbing import logs
from unbroken.rank import process_group, rejoin
from unbroken.rank.channel import HOST_PREFIX, SECTION_NAME, SECTION_PREFIX, WAIT_PREFIX, MessageKind, RankMessage, RankSender
from unbroken.checkpoint.api import Checkpointer, RestoreReport, SaveReport
from unbroken.rank.gpu_sections import GpuSections
from unbroken.rank.group_sockets import GroupSockets
from unbroken.rank.env import LaunchEnv
from unbroken.rank.leave_watch import LeaveWatch
from unbroken.rank.rejoin import RejoinNotice

if TYPE_CHECKING:
    from unbroken.checkpoint.rank.agreement import ReplicaWatch, Verdict
    from unbroken.checkpoint.rank.live import LiveState
    from unbroken.rank.bit_flip import BitFlipper

T = TypeVar("T")

_PR_SET_PDEATHSIG = 1
_SECTION_KEYS: dict[tuple[str, bool], str] = {}
"""Section names already checked, to their metric key: a step's sections cost two clock reads, not a regex."""


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
    _env: LaunchEnv = field(repr=False, default_factory=LaunchEnv.from_environ)
    _make_checkpointer: Callable[[LaunchEnv, int, int, LiveState | None], Checkpointer] | None = field(repr=False, default=None)
    _live: Callable[[], dict[str, Any]] | None = field(repr=False, default=None)
    _live_state: LiveState | None = field(repr=False, default=None)
    _backend: str | None = field(repr=False, default=None)
    _structured_logs: bool = field(repr=False, default=False)
    _group_sockets: GroupSockets | None = field(repr=False, default=None)
    _leave_asked: str | None = field(repr=False, default=None)
    """Why the launcher asked this rank to leave the current round (``_break_group``); None: not asked."""
    _leave_watch: LeaveWatch | None = field(repr=False, default=None)
    """Under ``unbroken run``: the current round's watch for a request to leave it (rank/leave_watch.py)."""
    _sections: dict[str, float] = field(repr=False, default_factory=dict)
    """Seconds in each ``section`` since the last ``progress``, keyed as the agent reads them (host time; on a GPU
    under ``host:<name>``, the scored time being the GPU's)."""
    _gpu: GpuSections | None = field(repr=False, default=None)
    """The sections' CUDA-event times (gpu_sections.py), once this rank's CUDA is in use."""
    _replicas: ReplicaWatch | None = field(repr=False, default=None)
    """``watch_replicas``: the replicated state compared across replicas every few steps (checkpoint/rank/agreement.py)."""
    _flipper: BitFlipper | None = field(repr=False, default=None)
    """``unbroken chaos corrupt``'s watch on this rank (rank/bit_flip.py)."""
    _restored_step: int | None = field(repr=False, default=None)
    """The step this attempt restored (told by the checkpointer): the replicas' first agreed step."""
    _finished: bool = field(repr=False, default=False)

    def run(self, train: Callable[[Context], T]) -> T:
        """Train with in-process restarts: ``return ctx.run(train)``, where ``train(ctx)`` builds the model
        on ``ctx``'s process group, restores ``ctx.checkpoint`` and trains.

        When a peer fails (its collective raises here), this rank does not exit: it leaves the process
        group, tells its agent, waits for the next attempt, joins its new process group (with the
        replacement ranks, maybe as another rank) and calls ``train`` again, which restores the newest
        checkpoint as a fresh process would -- without the imports, the CUDA context or the process.
        A job without ``resilience.in_process_restart``, an error that is not a collective's, or no
        next attempt within ``REJOIN_WAIT_SECONDS``: the error propagates and the rank exits as always.
        """
        while True:
            try:
                result = train(self)
            except Exception as exc:  # noqa: BLE001 - only collective failures are kept; the rest re-raise below
                self._stop_leave_watch()
                if self._env.group is None or not (self._leave_asked is not None or process_group.is_collective_failure(exc)):
                    raise
                live, self._live, self._live_state = self._live_state, None, None  # the next entry offers its own
                notice = self._leave_process_group(exc)
                if notice is None:
                    raise
                self._join(notice, live)
            else:
                self.finished()
                return result

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def keep_live(self, state: Callable[[], dict[str, Any]]) -> None:
        """Offer this rank's *replicated* state (DDP: model, optimizer, a shared sampler position; never
        per-rank parts) to the ranks that replace a failed peer in an in-process restart: they restore it
        from this rank's memory, as of the last ``progress(step)``, instead of reading a checkpoint.
        Call it in ``train`` once the objects exist. ``state()`` runs at every ``progress``: it must be
        cheap and must not copy (a ``state_dict()`` holds references, which stay that step's until the
        next optimizer step, itself followed by the next ``progress``)."""
        self._live = state

    def watch_replicas(self, state: Callable[[], dict[str, Any]], *, every_steps: int = 50, group: Any = None) -> None:
        """Compare this rank's *replicated* state with its replicas' every ``every_steps`` steps, at ``progress``, to
        catch silent data corruption: a GPU or its memory that computes a wrong number without an error.

        ``state()`` returns what every replica holds bit for bit after an optimizer step (DDP: the model's and the
        optimizer's ``state_dict()``; never per-rank parts such as RNG state or a sampler's position). ``group``: the
        replicas' process group (default: every rank; HSDP/FSDP2 with a 2-D mesh: ``mesh["replicate"].get_group()``).
        Each check reads the declared bytes once and all-reduces 64 bytes, whatever the group's size, in the
        background: its verdict is read at the next ``progress`` (the last step's at ``finished``, which ``ctx.run``
        calls; a script without it calls ``ctx.finished()`` before it destroys the process group). When they
        differ, the rank(s) the majority outvotes (with two replicas: both) are named to the agent, what was saved
        after the last agreed step is never restored, and every rank raises ``ReplicasDiverged``: the job restarts
        from that step, and its controller takes the suspect's node out. ``every_steps``: a multiple of your save interval keeps every
        agreed step a saved one (a restart then loses nothing it need not)."""
        from unbroken.checkpoint.rank.agreement import ReplicaWatch

        if every_steps < 1:
            raise ValueError(f"ctx.watch_replicas(every_steps={every_steps}): a check every 1 or more steps")
        start = self._restored_step if self._restored_step is not None else -1
        self._replicas = ReplicaWatch(state, every_steps, group, agreed_step=start)
        if self._restored_step is not None:
            self.checkpoint.agreed(self._restored_step)

    @property
    def agreed_step(self) -> int | None:
        """The last step this rank's replicas agreed on (``watch_replicas``), or None when nothing is watched."""
        return self._replicas.agreed_step if self._replicas is not None else None

    def _check_replicas(self, step: int) -> None:
        """Judge the check started at the last ``progress`` (its all-reduce finished meanwhile), then start this
        step's if it is due."""
        watch = self._replicas
        assert watch is not None
        if self.world_size <= 1 or not _group_is_up():
            return
        self._judge_replicas()
        if watch.due(step):
            watch.start(step)

    def _judge_replicas(self) -> None:
        watch = self._replicas
        if watch is None or watch.in_flight is None:
            return
        agreed_before = watch.agreed_step
        verdict = watch.collect()
        if verdict is None:
            return
        if verdict.agreed:
            self.checkpoint.agreed(verdict.step)  # retention keeps it: the step a later disagreement rolls back to
        else:
            self._diverged(verdict, agreed_before)

    def _watch_for_flips(self) -> None:
        """``unbroken chaos corrupt``'s request for this rank, if one can be made: under an agent the node's file, else
        ``$UNBROKEN_CHAOS_CORRUPT``. Every rank that reports progress has it (one ``stat`` per step), so a job that
        does not watch its replicas can be corrupted too: what it looks like without ``watch_replicas``."""
        from unbroken.plumbing.layout import ClusterLayout
        from unbroken.rank.bit_flip import REQUEST_ENV, REQUEST_FILE, BitFlipper

        request = os.environ.get(REQUEST_ENV)
        path = Path(request) if request else (ClusterLayout.at(self._env.cluster_dir).node_dir(self.node) / REQUEST_FILE
                                               if self._env.cluster_dir is not None else None)
        self._flipper = BitFlipper(path, job=self.job, rank=self.rank, attempt=self.attempt) if path is not None else None

    def _diverged(self, verdict: Verdict, agreed_step: int) -> None:
        """Tell the agent, keep what was saved since the last agreed step from any restore, and stop this attempt."""
        from unbroken.errors import ReplicasDiverged
        from unbroken.rank.channel import SUSPECT_PREFIX

        why = f"{verdict.describe()}; last agreed step {agreed_step}"
        self.checkpoint.distrust_after(agreed_step, why)
        metrics = {"agreed_step": float(agreed_step), "majority": 1.0 if verdict.majority else 0.0,
                   **{f"{SUSPECT_PREFIX}{r}": 1.0 for r in verdict.suspects}}
        self._send(MessageKind.DIVERGED, verdict.step, metrics, (verdict.tensor or "")[:200])
        print(f"unbroken: rank {self.rank}: silent data corruption: {why}", flush=True)
        raise ReplicasDiverged(why)

    @contextmanager
    def section(self, name: str, *, waits_on_peers: bool = False) -> Iterator[None]:
        """Time a part of the step: ``with ctx.section("data"): batch = next(loader)``.

        The seconds go to the agent with the next ``progress``, which scores each rank against its
        peers to find a straggler node and names the section that is slow. Cheap: two clock reads, and on a rank
        whose CUDA is in use two CUDA events, since there the scored time is the section's time on the GPU (the
        host only queues kernels; gpu_sections.py) and the host's goes along as ``host:<name>``.
        Mark a section that waits for other ranks (a collective, a barrier, DDP's backward, whose
        gradient all-reduce runs inside it) with ``waits_on_peers=True``: there the *fast* ranks wait
        for the slow one, so its time is reported but not scored. ``name``: a short word
        (``[a-z][a-z0-9_-]{0,31}``), the same on every rank.
        """
        key = _SECTION_KEYS.get((name, waits_on_peers))
        if key is None:
            if not SECTION_NAME.fullmatch(name):
                raise ValueError(f"ctx.section({name!r}): a section name is a short word matching {SECTION_NAME.pattern}, "
                                 f"e.g. 'data', 'forward', 'allreduce'")
            key = _SECTION_KEYS[(name, waits_on_peers)] = (WAIT_PREFIX if waits_on_peers else SECTION_PREFIX) + name
        gpu = self._gpu if self._gpu is not None else self._gpu_in_use()
        started = time.perf_counter()
        gpu_started = gpu.start() if gpu is not None else None
        try:
            yield
        finally:
            if gpu is None or gpu_started is None:
                self._sections[key] = self._sections.get(key, 0.0) + time.perf_counter() - started
            else:
                gpu.stop(key, gpu_started)
                host = HOST_PREFIX + name
                self._sections[host] = self._sections.get(host, 0.0) + time.perf_counter() - started

    def _gpu_in_use(self) -> GpuSections | None:
        """Time sections on the GPU from the first one after this rank's CUDA is initialised (a cheap check until then)."""
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            self._gpu = GpuSections.for_cuda()
        return self._gpu

    def progress(self, step: int, **metrics: float) -> None:
        """Report that ``step`` finished. Cheap (one datagram) and never blocks.

        The agent uses it as this rank's heartbeat: no call for
        ``resilience.hang_timeout`` seconds means the job is hung. With ``keep_live``, it also takes the
        live state of this step (references) and the RNG state (a few KB) for the ranks that restore it.
        """
        if self._replicas is not None:
            self._check_replicas(step)
        if self._flipper is not None:
            self._flipper.after_progress(step)
        if self._live is not None:
            from unbroken.checkpoint.rank import rng
            from unbroken.checkpoint.rank.live import LiveState

            self._live_state = LiveState(step, self._live(), rng.capture())
        values = {k: float(v) for k, v in metrics.items()}
        if self._sections:
            values.update(self._sections)
            self._sections.clear()
        if self._gpu is not None:
            values.update(self._gpu.interval())
        self._send(MessageKind.PROGRESS, step, values)

    def finished(self) -> None:
        """Say that this rank is done training and exits now (``ctx.run`` says it when ``train`` returns). Its launcher and
        agent stop timing its silence for a hang; an agent ends a rank that said so and has not exited a while later
        (a teardown stuck in a library) and judges the job on what its ranks reported. With ``watch_replicas`` it
        first judges the last step's check, so call it before destroying the process group. Said once: later calls
        do nothing."""
        if self._finished:
            return  # a script said it before ctx.run did
        if self._replicas is not None and self._replicas.in_flight is not None:
            if _group_is_up():
                self._judge_replicas()  # the last step's check: a finished job's final state is judged too
            else:
                print(f"unbroken: rank {self.rank}: the replica check of step {self._replicas.in_flight.step} was never judged: the "
                      "process group was destroyed first (call ctx.finished() before destroy_process_group)", flush=True)
        self._finished = True
        self._stop_leave_watch()  # done: nothing may keep this rank from exiting now
        self._send(MessageKind.FINISHED, None)

    def _start_leave_watch(self) -> None:
        """Under ``unbroken run`` (a group with rounds): watch this round for the launcher's request to leave it."""
        group = self._env.group
        if group is not None and group.round is not None:
            self._leave_watch = LeaveWatch(group.rejoin_dir, group.round, self._break_group).start()

    def _stop_leave_watch(self) -> None:
        if self._leave_watch is not None:
            self._leave_watch.stop()
            self._leave_watch = None

    def _break_group(self, why: str) -> None:
        """Asked by the launcher to leave this round (from the leave watch's thread): end this rank's side of the
        process group, so that the collective it is blocked in, or its next, fails and ``run`` holds it as after a
        peer's failure, with the live state of its last ``progress``."""
        self._leave_asked = why
        print(f"unbroken: rank {self.rank} asked to leave its process group ({why})", flush=True)
        process_group.end_group_connections(self._group_sockets)

    def _send(self, kind: MessageKind, step: int | None, metrics: dict[str, float] | None = None, detail: str = "") -> None:
        self._sender.send(
            RankMessage(
                kind=kind, job=self.job, attempt=self.attempt, rank=self.rank, local_rank=self.local_rank,
                pid=os.getpid(), ts=time.time(), step=step, metrics=metrics or {}, detail=detail,
            ),
            must_arrive=kind in (MessageKind.HELLO, MessageKind.RESTORED, MessageKind.DIVERGED),
        )


    def _leave_process_group(self, cause: Exception) -> RejoinNotice | None:
        """Abort this attempt's process group, say so to the agent, wait for the next attempt's notice."""
        import torch.distributed as dist

        group = self._env.group
        assert group is not None
        left = time.monotonic()
        print(f"unbroken: rank {self.rank} leaves attempt {self.attempt}'s process group ({type(cause).__name__}: "
              f"{process_group.one_line(cause)}); waiting for the next attempt", flush=True)
        # first: a peer blocked on this rank sees it leave now, not at its collective timeout
        process_group.end_group_connections(self._group_sockets)
        self._group_sockets = None
        if dist.is_initialized():
            # Abort, not only destroy, gloo's too: the failed round's objects (DDP in the traceback's frames) can
            # keep the group alive.
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception:  # noqa: BLE001 - a group broken by a dead peer may fail to tear down; it is dropped either way
                pass
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001 - as above
                    pass
        self.checkpoint.close()
        round_number = self.attempt if group.round is None else group.round
        rejoin.acknowledge_abort(group.rejoin_dir, self.local_rank, round_number,
                                 f"rank {self.rank}: {type(cause).__name__}: {process_group.one_line(cause, 160)}")
        notice = rejoin.await_notice(group.rejoin_dir, round_number, REJOIN_WAIT_SECONDS)
        if notice is None:
            print(f"unbroken: no next attempt within {REJOIN_WAIT_SECONDS:g} s; exiting for a full restart", flush=True)
        else:
            print(f"unbroken: rank {self.rank} rejoins as attempt {notice.attempt} (round {notice.round_number}) after "
                  f"{time.monotonic() - left:.2f} s", flush=True)
        return notice

    def _join(self, notice: RejoinNotice, live: LiveState | None = None) -> None:
        """Become a rank of ``notice``'s attempt: new identity, new checkpointer, new process group."""
        assert self._env.group is not None and self._make_checkpointer is not None
        group = replace(self._env.group, group_rank=notice.group_rank, nnodes=notice.nnodes, rendezvous=notice.rendezvous,
                        round=notice.round)
        self._env = replace(self._env, attempt=notice.attempt, group=group)
        os.environ.update(self._env.to_environ())
        self.rank, self.world_size = process_group.enter_group(group, self.local_rank)
        process_group.register(group, self.rank, self.local_rank)
        self.attempt = notice.attempt
        self._leave_asked = None
        self._replicas = self._restored_step = None  # train(ctx) watches its new objects again
        self._finished = False  # a rank that said it and then lost a peer in its last collective trains again
        self._watch_for_flips()
        if self._structured_logs:
            _setup_logs(self._env, self.rank, self.local_rank)
        self.checkpoint = self._make_checkpointer(self._env, self.rank, self.world_size, live)
        self._send(MessageKind.HELLO, None)
        self._group_sockets = process_group.init_process_group(self._backend, self.local_rank, group)
        self._start_leave_watch()


def _group_is_up() -> bool:
    """The process group exists (a script's last ``progress`` may come after it destroyed it)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


REJOIN_WAIT_SECONDS = 300.0
"""How long a rank that left its process group waits for the next attempt. The agent decides sooner:
it adopts the worker into the next attempt, or stops it (then this wait ends with the process)."""


def _setup_logs(env: LaunchEnv, rank: int, local_rank: int) -> None:
    known = {"job": env.job, "node": env.node, "attempt": env.attempt if env.managed else None}
    logs.setup(component="rank", **{k: v for k, v in known.items() if v is not None}, rank=rank, local_rank=local_rank)


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
            self.ctx._restored_step = report.step
            if self.ctx._replicas is not None:
                self.ctx._replicas.agreed_step = report.step
                self.ctx.checkpoint.agreed(report.step)
            self.ctx._send(MessageKind.RESTORED, report.step, {"seconds": report.seconds}, report.source)


def init(
    *,
    checkpoint_dir: str | Path | None = None,
    backend: str | None = None,
    init_process_group: bool = True,
    structured_logs: bool = True,
) -> Context:
    """Join the job: read rank and world size, start ``torch.distributed``, say hello to the agent.

    ``backend`` defaults to ``cpu:gloo,cuda:nccl`` when CUDA is available (NCCL for device tensors, gloo for
    host tensors: ``dcp.async_save`` needs both), else gloo. With
    ``structured_logs``, the root logger writes JSON lines to stdout carrying
    ``job``, ``node``, ``attempt``, ``rank`` and ``local_rank`` (what is known), so
    log shippers (Loki, CloudWatch, Fluent Bit) read rank logs without a pattern;
    ``print`` output stays as printed.
    """
    launcher = os.getppid()  # first: _die_with_parent judges the parent against it
    env = LaunchEnv.from_environ()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if env.group is not None:
        rank, world_size = process_group.enter_group(env.group, local_rank)
        process_group.register(env.group, rank, local_rank)
    else:
        rank = int(os.environ.get("RANK", "0"))
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if structured_logs:
        _setup_logs(env, rank, local_rank)
    if env.managed:
        _die_with_parent(launcher)
    _record_uncaught_errors()
    sender = RankSender(env.agent_socket)
    directory = Path(checkpoint_dir) if checkpoint_dir else env.checkpoint_dir or Path("checkpoints")

    observer = _AgentObserver()  # bound to the context below: the checkpointer is part of it

    def make_checkpointer(env: LaunchEnv, rank: int, world_size: int, live: LiveState | None = None) -> Checkpointer:
        inner: Checkpointer
        if env.checkpoint_tiers and env.managed:
            from unbroken.config.checkpoint import TierPolicy
            from unbroken.checkpoint.rank.tiered import from_environment

            policy = TierPolicy.model_validate_json(env.checkpoint_tiers)
            inner = from_environment(env, rank, world_size, policy, observer)
        else:
            from unbroken.checkpoint.rank.file import FileCheckpointer

            inner = FileCheckpointer(directory, rank=rank, world_size=world_size, keep=env.checkpoint_keep, observer=observer)
        if env.group is None:
            return inner
        # in-process restarts: every rank's first restore of an attempt asks the live peers first
        from unbroken.checkpoint.rank.live import LiveFirst

        return LiveFirst(inner, live, rank=rank, observer=observer)

    ctx = Context(
        rank=rank, world_size=world_size, local_rank=local_rank, job=env.job, node=env.node,
        attempt=env.attempt, checkpoint=make_checkpointer(env, rank, world_size), _sender=sender, _env=env,
        _make_checkpointer=make_checkpointer, _backend=backend, _structured_logs=structured_logs,
    )
    observer.ctx = ctx
    ctx._watch_for_flips()
    # Hello before joining the process group: from here on the agent expects progress,
    # so a rank stuck in rendezvous counts against startup_timeout.
    ctx._send(MessageKind.HELLO, None)
    if init_process_group and world_size > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            ctx._group_sockets = process_group.init_process_group(backend, local_rank, env.group)
    ctx._start_leave_watch()
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


def _die_with_parent(launcher: int) -> None:
    """Ask the kernel to SIGKILL this rank when its torchrun dies.

    torchrun starts ranks in their own sessions, so a torchrun killed with
    SIGKILL (a node "losing power" under chaos, or an agent stopping a hung
    group) would otherwise leave orphaned ranks holding GPU memory and ports.
    ``launcher``: the parent as ``init()`` began.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        return
    if launcher_gone(launcher):  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


_LAUNCHERS = (b"torch.distributed.run", b"torchrun", b"unbroken")


def launcher_gone(launcher: int) -> bool:
    """The rank's launcher died: its parent is not ``launcher`` any more (reparented), or is PID 1 running no launcher
    (reparented before ``init()`` began). PID 1 may be the launcher itself: torchrun as a container's command is; the
    old test, "the parent is PID 1", killed every rank of a PyTorchJob on a real node in ``init()``. A host's init
    never launches ranks."""
    parent = os.getppid()
    if parent != launcher:
        return True
    if parent != 1:
        return False
    try:
        command = Path("/proc/1/cmdline").read_bytes()
    except OSError:
        return False  # cannot tell: a rank that may well be fine is not killed for it
    return not any(word in command for word in _LAUNCHERS)
