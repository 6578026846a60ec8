"""A rank's process group: joining it (the backend ``unbroken.init`` picks, the job-wide group of
in-process restarts, the gloo connections a rank shuts down when it leaves), ending it from another
thread, telling a failure of the group from one of the rank's own code, and saying which global rank
this process is now."""

from __future__ import annotations

import os
from pathlib import Path

from unbroken.rank import registry as rank_registry
from unbroken.rank import symptoms
from unbroken.rank.env import GroupPlacement
from unbroken.rank.group_sockets import GroupSockets


def end_group_connections(sockets: GroupSockets | None) -> None:
    """End this rank's side of its process group so that the collective it is in, or its next, fails now; safe from
    another thread: gloo's connections shut down (``sockets``; twice is harmless), NCCL's communicator aborted (its
    abort is made for another thread to call). A group of both (``cpu:gloo,cuda:nccl``) gets both."""
    import torch.distributed as dist

    if sockets is not None:
        sockets.shut_down()
    if dist.is_initialized() and (sockets is None or has_nccl()):
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # noqa: BLE001 - a group broken by a dead peer may fail to tear down; it is left either way
            pass


def has_nccl() -> bool:
    import torch.distributed as dist

    try:
        return "nccl" in str(dist.get_backend_config())
    except (RuntimeError, ValueError):  # destroyed meanwhile
        return False


def is_collective_failure(exc: BaseException) -> bool:
    """A failure of the process group (a peer died, hung past the timeout, or the group was aborted),
    not of this rank's own code: only those are worth staying alive for."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    # gloo reports a vanished peer as a plain RuntimeError from its transport
    return isinstance(exc, RuntimeError) and symptoms.from_the_process_group(str(exc))


def one_line(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def enter_group(group: GroupPlacement, local_rank: int) -> tuple[int, int]:
    """Set the torch.distributed variables for the job-wide group (torchrun's are node-local under
    in-process restarts) and return (rank, world size). Global rank 0 hosts the store."""
    environ = group.rank_environ(local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    os.environ.update(environ)
    return int(environ["RANK"]), int(environ["WORLD_SIZE"])


def register(group: GroupPlacement, rank: int, local_rank: int) -> None:
    """Say which global rank this process is now, where the agent, chaos and the CLI look (rank/registry.py)."""
    identity = rank_registry.RankIdentity(rank, local_rank)
    rank_registry.register(group.rejoin_dir, os.getpid(), identity)
    warm = os.environ.get(rank_registry.REGISTRY_DIR)
    if warm:  # a warm spare's rank registered its node-local RANK there before the script ran
        rank_registry.register(Path(warm), os.getpid(), identity)


def init_process_group(backend: str | None, local_rank: int, group: GroupPlacement | None) -> GroupSockets | None:
    """Join the process group; under in-process restarts with gloo, return the connections it opened
    (the rank shuts them down when it leaves: group_sockets.py says why)."""
    import datetime

    import torch
    import torch.distributed as dist

    chosen = backend or default_backend(torch.cuda.is_available())
    if "nccl" in chosen:
        torch.cuda.set_device(local_rank)
    if group is None:
        dist.init_process_group(backend=chosen)
        return None
    # every wait has a timeout: a survivor blocked on a hung peer gives up and can rejoin
    timeout = datetime.timedelta(seconds=group.collective_timeout)
    if "gloo" not in chosen:  # NCCL alone: its communicator abort ends its own connections
        dist.init_process_group(backend=chosen, timeout=timeout)
        return None
    return GroupSockets.opened_by(lambda: dist.init_process_group(backend=chosen, timeout=timeout))


def default_backend(cuda: bool) -> str:
    """The process group ``unbroken.init`` makes: with CUDA, NCCL for device tensors *and* gloo for host tensors
    (``dcp.async_save`` refuses a group without a CPU backend, and small control collectives on host tensors need
    one); without, gloo."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"
