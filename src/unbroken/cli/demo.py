"""``unbroken demo``: the whole story in one command.

A 3-node local cluster; the MLP job on 2 nodes with auto-resume; one of its
nodes loses power mid-run (every process SIGKILLed at once); the job resumes
on the spare node from its last checkpoint, on warm spare processes (torch
already imported), while a replacement node joins; then a
summary of what the fault cost, and the cluster is torn down.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from unbroken.controller import jobs, report
from unbroken.runtime import fault_injection
from unbroken.checkpoint.inventory import inventory
from unbroken.cli.common import console, layout_for, table
from unbroken.config.cluster import ClusterConfig
from unbroken.config.job import JobSpec
from unbroken.errors import UnbrokenError
from unbroken.runtime import Runtime, local_cluster
from unbroken.state.phases import JobPhase
from unbroken.state.records import Job

CHECKPOINT_EVERY = 10


def run_demo(directory: Path | None, *, steps: int, keep: bool) -> None:
    layout = layout_for(directory or Path(".unbroken-demo"))
    config = ClusterConfig.with_nodes(3, name="demo")
    console.print(f"[bold]unbroken demo[/]: 3-node cluster in {layout.root}")
    runtime, _ = local_cluster.up(layout, config)
    try:
        with _spinner() as bar:
            task = bar.add_task("nodes joining")
            local_cluster.wait_ready(runtime, 120, lambda c: bar.update(task, description=f"nodes: {c}"))
        persistent = layout.root / "persistent"
        # The demo's own checkpoints: a previous demo's would make this job resume at its last step.
        shutil.rmtree(persistent, ignore_errors=True)
        job = _submit(runtime, steps, persistent)
        console.print(f"job [bold]{job.name}[/]: 2 nodes x 2 ranks, {steps} steps, checkpoint every {CHECKPOINT_EVERY}, auto-resume")
        final = _run_with_fault(runtime, job.name, steps)
        _print_summary(runtime, final)
        if final.phase is not JobPhase.SUCCEEDED:
            raise UnbrokenError(f"demo job ended {final.phase.value}: {final.reason}")
    finally:
        if keep:
            console.print(f"cluster left up: unbroken --dir {layout.root} ... ; stop it with: unbroken cluster down --dir {layout.root}")
        else:
            left = local_cluster.down(layout)
            console.print(f"cluster torn down ({'no process left' if not left else f'still alive: {left}'})")


def _submit(runtime: Runtime, steps: int, persistent_dir: Path) -> Job:
    spec = JobSpec.model_validate(
        {
            "name": "demo-mlp", "nodes": 2, "procs_per_node": 2,
            "command": ["-m", "unbroken.workloads.mlp", "--steps", str(steps),
                        "--checkpoint-every", str(CHECKPOINT_EVERY), "--step-time", "0.05"],
            # warm spares: once the job trains, every node keeps a torchrun that has imported
            # torch, so the restart after the fault skips most of its startup
            "resilience": {"auto_resume": True, "max_retry": 2, "hang_timeout": 30, "warm_spares": 1},
            # The tiered checkpoint: shared memory every checkpoint, one replica on the next
            # node (the killed node's ranks resume from it), a file:// tier every 50 steps.
            "checkpoint": {
                "memory": {"keep": 2, "replicas": 1},
                "persistent": {"uri": f"file://{persistent_dir}", "every_steps": 50},
            },
        }
    )
    return jobs.submit(runtime.cluster, spec, note="submitted by unbroken demo")


def _run_with_fault(runtime: Runtime, name: str, steps: int) -> Job:
    kill_at = max(CHECKPOINT_EVERY * 2 + 5, int(steps * 0.4))
    killed: str | None = None
    with Progress(SpinnerColumn(), TextColumn("[bold]{task.fields[phase]:<11}"), BarColumn(),
                  TextColumn("step {task.completed:>4.0f}/{task.total:.0f}"), TextColumn("{task.fields[note]}"),
                  TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("job", total=steps, phase="Pending", note="")
        while True:
            job = runtime.cluster.get_job(name)
            workers = runtime.backend.observe_attempt(name, job.attempt)
            step = jobs.current_step(workers)
            note = f"restarts {job.attempt}" + (f"; {killed} lost power at step {kill_at}" if killed else "")
            bar.update(task, completed=step, phase=job.phase.value, note=note)
            if killed is None and job.attempt == 0 and step >= kill_at:
                victim = next(w.node for w in workers if w.node_rank == 1)
                fault_injection.kill_node(runtime, victim)
                killed = victim
                bar.console.print(f"[red]chaos[/]: node {victim} lost power at step {step} (agent and ranks SIGKILLed)")
            if job.phase.is_terminal:
                return job
            time.sleep(0.2)


def _print_summary(runtime: Runtime, job: Job) -> None:
    events = runtime.cluster.list_events(object_kind="Job", object_name=job.name)
    summary = report.summarize(job, runtime.backend.worker_history(job.name), events)
    node_events = [e for e in runtime.cluster.list_events(object_kind="Node")
                   if e.reason in ("NodeLost", "NodeReplaced", "NodeSchedulable")]
    rows: list[list[object]] = [
        ["outcome", job.phase.value],
        ["restarts", summary.restarts],
        ["steps lost", summary.steps_lost],
        ["fault -> failure detected", ", ".join(f"{s:.1f} s" for s in summary.detection_seconds) or "-"],
        ["fault -> first step after resume", "; ".join(r.describe() for r in summary.recoveries) or "-"],
        ["goodput", f"{summary.goodput:.1%}" if summary.goodput is not None else "-"],
        ["wall time", f"{summary.wall_seconds:.1f} s"],
        ["attempts", "; ".join(f"#{a.attempt} on {','.join(a.nodes)} from step {a.restored_step or 0}" for a in summary.attempts)],
        ["restored from", _restore_sources(runtime, job)],
        ["checkpoints now", _tiers_now(runtime, job)],
    ]
    console.print(table("demo summary", ["", ""], rows))
    console.print(table("node events", ["NODE", "REASON", "MESSAGE"], [[e.object_name, e.reason, e.message] for e in node_events]))


def _restore_sources(runtime: Runtime, job: Job) -> str:
    """Where each rank of the last attempt resumed from, as its log says ("restored step N from ...")."""
    sources: dict[str, int] = {}
    for worker in runtime.backend.observe_attempt(job.name, job.attempt):
        for log_file in Path(worker.log_dir or "/nonexistent").rglob("stdout.log"):
            for line in log_file.read_text(errors="replace").splitlines():
                if line.startswith("unbroken: restored step"):
                    where = line.split(" from ", 1)[1]
                    sources[where] = sources.get(where, 0) + 1
    return "; ".join(f"{n} rank(s) from {where}" for where, n in sorted(sources.items())) or "-"


def _tiers_now(runtime: Runtime, job: Job) -> str:
    found = inventory(runtime.catalog, runtime.cluster, job.name)
    persistent = [s.step for s in found.steps if s.persistent == "Committed"]
    return f"persistent tier: steps {', '.join(map(str, persistent)) or '-'} (memory tier freed when the job ended)"


def _spinner() -> Progress:
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console, transient=True)
