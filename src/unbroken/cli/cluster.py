"""``unbroken cluster up|down|status``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from unbroken.cli.common import DirOption, Output, OutputOption, console, layout_for, open_runtime, print_json, table
from unbroken.config.cluster import ClusterConfig
from unbroken.config.loading import load_model
from unbroken.errors import UsageError
from unbroken.runtime import Runtime, local_cluster
from unbroken.state.phases import NodeState
from unbroken.state.records import ClusterStatus

app = typer.Typer(help="Start, inspect and stop a local cluster.", no_args_is_help=True)


@app.command("up")
def up(
    file: Annotated[Path | None, typer.Option("--file", "-f", help="Cluster file (YAML/JSON, HyperPod create-cluster fields)")] = None,
    nodes: Annotated[int | None, typer.Option("--nodes", "-n", min=1, max=64, help="Quick start: N cpu-dev nodes, automatic recovery")] = None,
    directory: DirOption = None,
    wait: Annotated[bool, typer.Option(help="Wait until every node has finished its join checks")] = True,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for nodes to join")] = 120.0,
    metrics_port: Annotated[int | None, typer.Option("--metrics-port", min=1, max=65000, help=(
        "Serve /metrics on fixed ports: the controller on PORT, node-N's agent on PORT+N (default: free ports, "
        "listed by 'cluster status'). Overrides the cluster file's Metrics ports."))] = None,
    gpu_metrics: Annotated[bool | None, typer.Option("--gpu-metrics/--no-gpu-metrics", help=(
        "Export NVML readings under dcgm-exporter's names; --no-gpu-metrics where dcgm-exporter already runs"))] = None,
) -> None:
    """Start the controller and one agent per node as background processes.

    Examples:  unbroken cluster up --nodes 3    |    unbroken cluster up -f cluster.yaml --dir /tmp/c1 --metrics-port 9400
    """
    if (file is None) == (nodes is None):
        raise UsageError("give exactly one of --file/-f CLUSTER_FILE or --nodes N")
    config = load_model(file, ClusterConfig) if file else ClusterConfig.with_nodes(nodes or 1)
    metrics_changes: dict[str, Any] = {}
    if metrics_port is not None:
        metrics_changes.update(ControllerPort=metrics_port, AgentBasePort=metrics_port)
    if gpu_metrics is not None:
        metrics_changes["GpuMetrics"] = gpu_metrics
    if metrics_changes:
        config = config.model_copy(update={"Metrics": config.Metrics.model_copy(update=metrics_changes)})
    layout = layout_for(directory)
    runtime, resumed = local_cluster.up(layout, config)
    if resumed:
        console.print(f"cluster in {layout.root} was up without a controller: controller restarted")
        return
    console.print(f"cluster [bold]{config.ClusterName}[/] starting in {layout.root}")
    if wait:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console, transient=True) as bar:
            task = bar.add_task("nodes joining")
            local_cluster.wait_ready(
                runtime, timeout, lambda counts: bar.update(task, description="nodes: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
            )
        _print_nodes(runtime)


@app.command("down")
def down(directory: DirOption = None) -> None:
    """Stop the controller, every agent and every worker; nothing of the cluster keeps running.

    The directory (state.db, logs, checkpoints) stays for a post-mortem; the next
    'cluster up' in it starts afresh.
    """
    layout = layout_for(directory)
    if not layout.state_db.exists():
        raise UsageError(f"no cluster in {layout.root}")
    left = local_cluster.down(layout)
    if left:
        raise UsageError(f"processes still alive after SIGKILL: {left}")
    console.print(f"cluster in {layout.root} is down; no process left")


@app.command("status")
def status(
    directory: DirOption = None, output: OutputOption = Output.table,
    targets_file: Annotated[Path | None, typer.Option(
        "--targets-file", help="Also write the /metrics endpoints to this file, in Prometheus' file_sd format "
                               "(atomically: Prometheus re-reads it when it changes). Re-run it from a timer to "
                               "follow node replacements.")] = None,
) -> None:
    """Controller, nodes by state, jobs by phase, and the /metrics endpoints to scrape."""
    runtime = open_runtime(directory)
    targets = metrics_targets(runtime)
    if targets_file is not None:
        write_targets(targets, targets_file)
    config, layout = runtime.config, runtime.layout
    pid = runtime.local_backend("cluster status").controller_pid()
    nodes = runtime.cluster.list_nodes()
    jobs = runtime.cluster.list_jobs()
    data: dict[str, Any] = {
        "cluster": config.ClusterName,
        "dir": str(layout.root),
        "up": runtime.cluster.cluster().status is ClusterStatus.UP,
        "controller_pid": pid,
        "node_recovery": config.NodeRecovery.value,
        "nodes": _count(n.state.value for n in nodes if n.state is not NodeState.RETIRED),
        "retired_nodes": sum(n.state is NodeState.RETIRED for n in nodes),
        "jobs": _count(j.phase.value for j in jobs),
        "metrics": targets,
        "time": time.time(),
    }
    if output is Output.json:
        print_json(data)
        return
    console.print(f"cluster [bold]{config.ClusterName}[/] in {layout.root}: "
                  f"{'up' if data['up'] else 'down'}, controller {'pid ' + str(pid) if pid else '[red]not running[/]'}, "
                  f"NodeRecovery {config.NodeRecovery.value}")
    _print_nodes(runtime)
    if jobs:
        console.print("jobs: " + ", ".join(f"{v} {k}" for k, v in sorted(data["jobs"].items())))
    if data["metrics"]:
        console.print("metrics (Prometheus file_sd: 'cluster status -o json' .metrics): " + ", ".join(
            f"{t['labels'].get('node', t['labels']['component'])} {t['targets'][0]}" for t in data["metrics"]), highlight=False)


def write_targets(targets: list[dict[str, Any]], path: Path) -> None:
    """Whole or not at all: file_sd ignores a file it cannot parse, a torn write would drop every target."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(targets, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UsageError(f"--targets-file {path}: cannot write it: {exc.strerror}") from None


def metrics_targets(runtime: Runtime) -> list[dict[str, Any]]:
    """Every /metrics endpoint of the cluster, in Prometheus' file_sd format (one target group each)."""
    targets = []
    controller = runtime.cluster.cluster().controller_metrics
    if controller:
        targets.append({"targets": [controller], "labels": {"component": "controller", "cluster": runtime.config.ClusterName}})
    for node in runtime.cluster.list_nodes():
        if node.metrics_address and node.state is not NodeState.RETIRED:
            targets.append({"targets": [node.metrics_address],
                            "labels": {"component": "agent", "node": node.name, "cluster": runtime.config.ClusterName}})
    return targets


def _count(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def _print_nodes(runtime: Runtime) -> None:
    from unbroken.cli.node import node_rows

    columns, rows = node_rows(runtime, include_retired=False)
    console.print(table(None, columns, rows))
