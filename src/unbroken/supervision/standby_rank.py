"""Standby ranks: a warm spare's rank processes that have started CUDA before the fault.

A warm spare's ranks fork from a forkserver that imported torch (warm_spare.py), but a
fork cannot inherit a started CUDA: every forked rank starts the driver, makes its
context and loads its first kernels after the fault. On an H100 that was most of a
warm restart: the rank joined 0.7-1.0 s after it forked and its first step took
0.5-1.2 s more, of 2.4-3.9 s from the kill to the first step. So a spare on a machine
with CUDA also starts one *standby* per local rank: a process that imports what the
forkserver imports, starts CUDA on its device, runs a few of the kernels every
training step needs, and waits.

When torchrun starts local rank k, the process it forks (the *proxy*, warm_spare.run_rank)
hands itself to standby k: its environment, working folder and command, and its stdin,
stdout and stderr (SCM_RIGHTS). The standby becomes the rank; the proxy stays as
torchrun's view of it:

- a SIGTERM or SIGINT torchrun sends the proxy is passed on to the rank;
- the rank's end (its exit code, or the signal that ended it, which the spare reads as
  the standby's parent) becomes the proxy's own, so torchrun, the agent and the rank
  registry see what they see of a forked rank;
- if the proxy dies first, the rank follows at once (its connection closes): torchrun
  never leaves a rank behind that it cannot see.

A standby serves at most one rank (its listening socket goes with the first
connection), only one whose ``CUDA_VISIBLE_DEVICES`` is the one it started CUDA under,
and only within CLAIM_WINDOW_S of the spare's identity; a rank that finds none forks
as before. While it waits a standby holds a CUDA context on its device (about 0.5 GiB
of that GPU's memory): ``UNBROKEN_STANDBY_RANKS=never`` in a job's ``env`` turns them off.
Without CUDA there is nothing to prepare and no standby is started, unless ``always``
(the tests: the hand-over itself is the same on a CPU).
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unbroken.plumbing import trampoline as plumbing_trampoline
from unbroken.supervision import rank_entry

log = logging.getLogger("unbroken.supervision.standby_rank")

POLICY = "UNBROKEN_STANDBY_RANKS"
"""``cuda`` (the default: standbys where CUDA is), ``always`` or ``never``."""
LOCAL_RANKS = "UNBROKEN_SPARE_LOCAL_RANKS"
"""How many standbys a spare starts: the job's ranks per node (set by whoever starts the spare)."""
DIRECTORY = "UNBROKEN_STANDBY_DIR"
"""Given to the proxies: where the spare's standbys listen and say how they are."""
CLAIM_WINDOW_S = 30.0
"""A standby no rank took this long after the spare's identity ends: the ranks of this torchrun have started by then
(a rendezvous of late nodes takes longer, and those ranks fork as before)."""
PREPARE_WAIT_S = 30.0
"""How long a rank waits for its standby still starting CUDA: the same work it would do itself, so it loses little."""
STATUS_WAIT_S = 10.0
"""How long a proxy waits, after its rank is gone, for the spare to write how the rank ended."""
MESSAGE_LIMIT = 1 << 20
"""A hand-over's JSON (mostly the environment) is far smaller; one SOCK_SEQPACKET message carries it whole."""


class Policy(enum.Enum):
    CUDA = "cuda"
    ALWAYS = "always"
    NEVER = "never"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "Policy":
        value = environ.get(POLICY, cls.CUDA.value)
        try:
            return cls(value)
        except ValueError:
            valid = ", ".join(p.value for p in cls)
            log.warning(f"{POLICY}={value!r} is not one of {valid}: using {cls.CUDA.value}")
            return cls.CUDA


class Paths:
    """What a standby of local rank ``k`` and the spare leave in the standby folder."""

    def __init__(self, directory: Path, local_rank: int) -> None:
        self.socket = directory / f"{local_rank}.sock"
        self.ready = directory / f"{local_rank}.ready"
        """Listening: a rank may connect."""
        self.claimed = directory / f"{local_rank}.claimed"
        """A rank took it: the spare must not end it for being unused."""
        self.status = directory / f"{local_rank}.status"
        """Written by the spare once the standby ended: its return code (negative: the signal)."""
        self.expected = directory / f"{local_rank}.expected"
        """Written by the spare before it starts the standby: a rank with none never waits for one."""


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# -- the spare's side ---------------------------------------------------------------------------------------------


@dataclass
class Standbys:
    """A spare's standbys, one per local rank, and a thread per standby that records how it ended."""

    directory: Path
    processes: dict[int, subprocess.Popen[bytes]]

    @classmethod
    def start(cls, directory: Path, count: int, trampoline: str, imports: list[str]) -> "Standbys":
        directory.mkdir(parents=True, exist_ok=True)
        for k in range(count):
            _write(Paths(directory, k).expected, "")
        code = "import sys; from unbroken.supervision.standby_rank import main; sys.exit(main(sys.argv[1:]))"
        processes = {
            k: subprocess.Popen(plumbing_trampoline.command("-c", code, str(directory), str(k), ",".join(imports), code=trampoline),
                                stdin=subprocess.DEVNULL)
            for k in range(count)
        }
        standbys = cls(directory, processes)
        for k, process in processes.items():
            threading.Thread(target=standbys._record_end, args=(k, process), name=f"standby-{k}-end", daemon=True).start()
        return standbys

    def _record_end(self, local_rank: int, process: subprocess.Popen[bytes]) -> None:
        _write(Paths(self.directory, local_rank).status, str(process.wait()))

    def end_unclaimed_after(self, seconds: float) -> None:
        """Once ``seconds`` have passed, end the standbys no rank took (they hold a CUDA context each)."""
        timer = threading.Timer(seconds, self.end_unclaimed)
        timer.daemon = True
        timer.start()

    def end_unclaimed(self) -> None:
        for k, process in self.processes.items():
            if process.poll() is None and not Paths(self.directory, k).claimed.exists():
                process.kill()

    def close(self) -> None:
        """Called as the spare ends: every rank of its torchrun is gone, and so must the standbys be."""
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
            process.wait()


def wanted(environ: Mapping[str, str]) -> int:
    """How many standbys a spare in ``environ`` starts: its local ranks where CUDA is (or ``always``), else none."""
    policy = Policy.from_environ(environ)
    count = int(environ.get(LOCAL_RANKS, "0") or 0)
    if policy is Policy.NEVER or count <= 0:
        return 0
    if policy is Policy.ALWAYS:
        return count
    import torch

    return count if torch.cuda.is_available() else 0  # the driver's device count: no context is made here


# -- a standby ----------------------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    """A standby: ``DIRECTORY LOCAL_RANK MODULES``. Prepares, waits for one rank, and becomes it."""
    import importlib

    directory, local_rank, modules = Path(argv[0]), int(argv[1]), [m for m in argv[2].split(",") if m]
    paths = Paths(directory, local_rank)
    started = time.monotonic()
    for module in modules:
        importlib.import_module(module)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    device = prepare_device(local_rank)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
        listener.bind(str(paths.socket))
        listener.listen(1)
        _write(paths.ready, str(os.getpid()))
        print(f"unbroken: standby rank {local_rank} ready (pid {os.getpid()}, {device}, {time.monotonic() - started:.1f} s)",
              flush=True)
        connection, _ = listener.accept()
    paths.socket.unlink(missing_ok=True)  # the first rank to connect has it; any other forks
    message, fds, _, _ = socket.recv_fds(connection, MESSAGE_LIMIT, 3)
    request = json.loads(message)
    env: dict[str, str] = request["env"]
    if env.get("CUDA_VISIBLE_DEVICES") != visible or len(fds) != 3:
        connection.send(json.dumps({"accepted": False, "why": "CUDA_VISIBLE_DEVICES differs"}).encode())
        return 0
    _write(paths.claimed, str(os.getpid()))
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    connection.send(json.dumps({"accepted": True, "pid": os.getpid()}).encode())
    threading.Thread(target=_follow, args=(connection,), name="standby-lifeline", daemon=True).start()
    os.environ.clear()
    os.environ.update(env)
    print(f"unbroken: rank {env.get('RANK')} runs in a standby rank (pid {os.getpid()}, {device}), "
          f"prepared {time.monotonic() - started:.1f} s ago", file=sys.stderr, flush=True)
    code = 0
    try:
        rank_entry.run_as_rank(request["working_dir"], list(request["command"]))
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as workloads/script.exit_rank: no static destructors after a run that ended


def _follow(connection: socket.socket) -> None:
    """The rank's lifeline: its proxy closing the connection (dead, or done waiting) ends the rank at once."""
    with contextlib.suppress(OSError):
        while connection.recv(1):
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def prepare_device(local_rank: int) -> str:
    """Start CUDA on the rank's device and run what a training step's first kernels load (cuBLAS's handle and
    workspace, elementwise, reductions, the optimizer's): the work a forked rank did after the fault. Returns
    what was prepared, for the log."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA"
    device = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    x = torch.randn(128, 128, device="cuda")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        with contextlib.suppress(RuntimeError):  # a dtype this GPU lacks
            y = x.to(dtype)
            z = torch.nn.functional.layer_norm(y @ y, (128,)).softmax(-1)
            torch.nn.functional.gelu(z).sum().item()
    loss = torch.nn.functional.cross_entropy(x, torch.zeros(128, dtype=torch.long, device="cuda"))
    weight = torch.nn.Parameter(x.clone())
    weight.grad = torch.ones_like(weight)
    torch.optim.AdamW([weight], lr=1e-3).step()
    loss.item()
    torch.cuda.synchronize()
    del x, weight, loss
    torch.cuda.empty_cache()
    return f"cuda:{device}"


# -- the proxy's side ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Handed:
    """A rank now running in a standby: its pid and the connection that keeps it alive."""

    pid: int
    connection: socket.socket
    paths: Paths


def hand_over(working_dir: str, command: list[str]) -> Handed | None:
    """Hand this process's rank to its standby, if its spare has one ready for it; None: run it here."""
    directory = os.environ.get(DIRECTORY)
    if not directory:
        return None
    paths = Paths(Path(directory), int(os.environ.get("LOCAL_RANK", "0")))
    deadline = time.monotonic() + PREPARE_WAIT_S
    while not paths.ready.exists():  # still starting CUDA, unless it ended or there is none for this rank
        if paths.status.exists() or not paths.expected.exists() or time.monotonic() > deadline:
            return None
        time.sleep(0.01)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        connection.connect(str(paths.socket))
        request = json.dumps({"env": dict(os.environ), "working_dir": working_dir, "command": command}).encode()
        socket.send_fds(connection, [request], [0, 1, 2])
        reply = json.loads(connection.recv(MESSAGE_LIMIT) or b"{}")
    except (OSError, ValueError):
        connection.close()
        return None  # taken by another rank, or gone: fork as before
    if not reply.get("accepted"):
        connection.close()
        return None
    return Handed(int(reply["pid"]), connection, paths)


def wait_for(handed: Handed) -> int:
    """Stand in for the rank until it ends, passing on torchrun's signals; its return code (negative: a signal)."""
    def forward(signum: int, _frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(handed.pid, signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    with _pidfd(handed.pid) as pidfd:
        if pidfd is not None:
            select.select([pidfd], [], [])  # readable once the rank has exited
    deadline = time.monotonic() + STATUS_WAIT_S
    while not handed.paths.status.exists():
        if time.monotonic() > deadline:
            print(f"unbroken: the standby rank (pid {handed.pid}) ended and its spare did not say how", file=sys.stderr, flush=True)
            return 1
        time.sleep(0.01)
    handed.connection.close()
    return int(handed.paths.status.read_text())


@contextlib.contextmanager
def _pidfd(pid: int) -> Iterator[int | None]:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        yield None  # gone already
        return
    try:
        yield fd
    finally:
        os.close(fd)


def end_as(code: int) -> None:
    """End this proxy as its rank ended: return (0), exit with the code, or die of the same signal."""
    if code == 0:
        return
    if code > 0:
        raise SystemExit(code)
    with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP take no handler, and need none
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
    raise SystemExit(128 - code)  # a signal this process does not die of (never for those that end a rank)
