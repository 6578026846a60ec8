"""``unbroken chaos kill-worker|hang-worker|kill-node|kill-controller``."""

from __future__ import annotations

import signal
from typing import Annotated

import typer

from unbroken import chaos
from unbroken.cli.common import DirOption, console, open_store

app = typer.Typer(help="Inject real faults: signals to real processes.", no_args_is_help=True)

JobArg = Annotated[str, typer.Argument(help="Job name")]
NodeOpt = Annotated[str | None, typer.Option("--node", help="Pick a rank on this node")]
RankOpt = Annotated[int | None, typer.Option("--rank", help="Global rank to hit (default: the highest)")]


def _signal_rank(directory, job: str, node: str | None, rank: int | None, sig: signal.Signals, reason: str) -> None:
    _, store = open_store(directory)
    target = chaos.pick_rank(store, job, node=node, rank=rank)
    chaos.signal_rank(store, target, sig, reason)
    console.print(f"{sig.name} -> job {job} rank {target.rank} (pid {target.pid}) on {target.node}")


@app.command("kill-worker")
def kill_worker(job: JobArg, directory: DirOption = None, node: NodeOpt = None, rank: RankOpt = None) -> None:
    """SIGKILL one rank of a running job (a process crash)."""
    _signal_rank(directory, job, node, rank, signal.SIGKILL, "ChaosKillWorker")


@app.command("hang-worker")
def hang_worker(job: JobArg, directory: DirOption = None, node: NodeOpt = None, rank: RankOpt = None) -> None:
    """SIGSTOP one rank: it stops making progress; hang_timeout should catch it."""
    _signal_rank(directory, job, node, rank, signal.SIGSTOP, "ChaosHangWorker")


@app.command("kill-node")
def kill_node(node: Annotated[str, typer.Argument(help="Node name")], directory: DirOption = None) -> None:
    """SIGKILL the node's agent and all its processes at once, as when a machine loses power."""
    layout, store = open_store(directory)
    count = chaos.kill_node(store, layout, node)
    console.print(f"node {node}: {count} processes killed")


@app.command("kill-controller")
def kill_controller(directory: DirOption = None) -> None:
    """SIGKILL the controller; 'unbroken cluster up' in the same --dir starts it again."""
    layout, _ = open_store(directory)
    pid = chaos.kill_controller(layout)
    console.print(f"controller pid {pid} killed")
