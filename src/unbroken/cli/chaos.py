"""``unbroken chaos kill-worker|hang-worker|kill-node|kill-controller|xid|slow-link|slow-node|corrupt``."""

from __future__ import annotations

import signal
from typing import Annotated

import typer

from unbroken.rank.bit_flip import FlipTarget
from unbroken.runtime import fault_injection
from unbroken.cli.common import DirOption, console, open_runtime

app = typer.Typer(help="Inject real faults: signals to real processes, kernel-log lines, slow links, slow nodes, flipped bits.",
                  no_args_is_help=True)

JobArg = Annotated[str, typer.Argument(help="Job name")]
NodeOpt = Annotated[str | None, typer.Option("--node", help="Pick a rank on this node")]
RankOpt = Annotated[int | None, typer.Option("--rank", help="Global rank to hit (default: the highest)")]


def _signal_rank(directory, job: str, node: str | None, rank: int | None, sig: signal.Signals, reason: str) -> None:
    runtime = open_runtime(directory)
    target = fault_injection.pick_rank(runtime, job, node=node, rank=rank)
    fault_injection.signal_rank(runtime, target, sig, reason)
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
    count = fault_injection.kill_node(open_runtime(directory), node)
    console.print(f"node {node}: {count} processes killed")


@app.command("kill-controller")
def kill_controller(directory: DirOption = None) -> None:
    """SIGKILL the controller; 'unbroken cluster up' in the same --dir starts it again."""
    pid = fault_injection.kill_controller(open_runtime(directory))
    console.print(f"controller pid {pid} killed")


@app.command("xid")
def xid(node: Annotated[str, typer.Argument(help="Node name")], code: Annotated[int, typer.Argument(help="Xid code, e.g. 79 or 13")],
        directory: DirOption = None, pci: Annotated[str, typer.Option(help="GPU bus id in the line")] = "PCI:0000:b9:00") -> None:
    """Append an 'NVRM: Xid (PCI:...): CODE, ...' line to the node's kernel log; the Xid table decides what follows."""
    console.print(f"{node}: {fault_injection.inject_xid(open_runtime(directory), node, code, pci)}", highlight=False)


@app.command("slow-link")
def slow_link(node: Annotated[str, typer.Argument(help="Node name")],
              rate: Annotated[str | None, typer.Argument(help="tc rate, e.g. 100mbit")] = None,
              clear: Annotated[bool, typer.Option("--clear", help="Remove the limit")] = False,
              directory: DirOption = None) -> None:
    """Rate-limit a node's link with tc tbf (clusters with Local.NetworkNamespaces; root)."""
    from unbroken.errors import UsageError

    if clear == (rate is not None):
        raise UsageError("give a RATE (e.g. 100mbit) or --clear")
    console.print(fault_injection.slow_link(open_runtime(directory), node, None if clear else rate))


@app.command("slow-node")
def slow_node(node: Annotated[str, typer.Argument(help="Node name")],
              factor: Annotated[float, typer.Option("--factor", help="How much slower: 2 doubles every step's compute")] = 2.0,
              period: Annotated[float, typer.Option("--period", help="Seconds per stop/continue cycle")] = fault_injection.SLOW_PERIOD_S,
              clear: Annotated[bool, typer.Option("--clear", help="Stop slowing the node")] = False,
              directory: DirOption = None) -> None:
    """Make a node a straggler: its jobs' processes are stopped for 1 - 1/FACTOR of every cycle (SIGSTOP/SIGCONT),
    until --clear. Straggler detection should name it (job describe: StragglerDetected)."""
    runtime = open_runtime(directory)
    if clear:
        console.print(f"node {node}: " + ("full speed again" if fault_injection.stop_slowing(runtime, node) else "was not slowed"))
        return
    pid = fault_injection.slow_node(runtime, node, factor, period=period)
    console.print(f"node {node}: slowed x{factor:g} (slower pid {pid}); 'unbroken chaos slow-node {node} --clear' ends it")


@app.command("corrupt")
def corrupt(job: JobArg, directory: DirOption = None, node: NodeOpt = None, rank: RankOpt = None,
            step: Annotated[int, typer.Option("--step", help="Flip in the optimizer step after the rank reports this step "
                                              "(default: its next one)")] = 0,
            target: Annotated[FlipTarget, typer.Option("--target", help="What to flip: a parameter, its optimizer state, "
                                                       "or its gradient (after the all-reduce)")] = FlipTarget.PARAMS,
            transient: Annotated[bool, typer.Option("--transient", help="Only this one bit: the node's known-answer check "
                                                    "still passes (default: its devices compute wrong from now on)")] = False,
            bit: Annotated[int | None, typer.Option("--bit", help="Which bit of the element's word, 0 = lowest (default: 3 of a "
                                                    "parameter or optimizer state, 22 of a gradient)")] = None,
            wait: Annotated[float, typer.Option("--wait", help="Seconds to wait for the rank to flip it")] = 60.0) -> None:
    """Silent data corruption: flip one bit of one rank's training state, through the rank (its script reports
    ctx.progress), and unless --transient make its node's devices compute wrong (the known-answer check fails).
    With ctx.watch_replicas the replicas disagree at their next check: job describe shows SilentDataCorruption, the job resumes from
    the last agreed step, and the node is replaced. 'chaos corrupt-clear NODE' makes a node compute right again."""
    runtime = open_runtime(directory)
    chosen = fault_injection.pick_rank(runtime, job, node=node, rank=rank)
    flipped = fault_injection.corrupt(runtime, chosen, step=step, what=target, lasting=not transient, wait_seconds=wait, bit=bit)
    console.print(f"job {job} rank {flipped.rank} on {chosen.node}: flipped bit {flipped.bit} of byte {flipped.byte} of "
                  f"{flipped.tensor} after step {flipped.step}" + ("" if transient else f"; {chosen.node} computes wrong from now on"),
                  highlight=False)


@app.command("corrupt-clear")
def corrupt_clear(node: Annotated[str, typer.Argument(help="Node name")], directory: DirOption = None) -> None:
    """Make a node's devices compute right again (its known-answer check passes)."""
    cleared = fault_injection.clear_corrupt(open_runtime(directory), node)
    console.print(f"node {node}: " + ("computes right again" if cleared else "was not made to compute wrong"))
