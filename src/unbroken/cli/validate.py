"""``unbroken validate``: the whole catalogue on the whole cluster, plus a short real training job."""

from __future__ import annotations

from pathlib import Path

import typer

from unbroken.cli.check import run_checks
from unbroken.cli.common import Output, console, open_store, print_json, table
from unbroken.config.cluster import ClusterConfig
from unbroken.errors import UsageError
from unbroken.health import validate
from unbroken.health.result import Status, Suite
from unbroken.state.phases import NodeState

_STYLE = {Status.PASS: "green", Status.WARN: "yellow", Status.FAIL: "red", Status.SKIP: "dim"}


def run_validate(directory: Path | None, output: Output, steps: int, timeout: float) -> None:
    layout, store = open_store(directory)
    cluster = ClusterConfig.model_validate_json(store.cluster_json())
    nodes = [n for n in store.list_nodes() if n.state is NodeState.SCHEDULABLE]
    if not nodes:
        raise UsageError("no Schedulable node to validate (is the cluster up? see 'unbroken node list')")
    busy = {w.node for w in store.list_workers(active=True)}
    if busy:
        raise UsageError(f"nodes {', '.join(sorted(busy))} are running jobs; validate an idle cluster (the stress "
                         "checks and the training job would disturb them)")
    names = [n.name for n in nodes]
    if output is Output.table:
        console.print(f"validating {len(nodes)} nodes: device, stress, storage and network checks, "
                      f"the collective sweep, and a {steps}-step training job across all of them")
    results = run_checks(layout, store, cluster, nodes, [Suite.INSTANCE_STRESS, Suite.INSTANCE_CONNECTIVITY],
                         params={"ops": ["all_reduce", "all_gather", "reduce_scatter"]})
    training = validate.training_job(store, names, steps=steps, timeout=timeout, base_dir=str(layout.root))
    verdicts = validate.tabulate(names, results, training)
    if output is Output.json:
        print_json(validate.to_json(verdicts))
    else:
        rows = [[v.node, *(v.cells.get(f, Status.SKIP).value for f in validate.FAMILIES), v.verdict.value,
                 "; ".join(v.notes)[:300]] for v in verdicts]
        console.print(table(None, ["NODE", *(f.upper() for f in validate.FAMILIES), "VERDICT", "WHY"], rows))
        failed = [v.node for v in verdicts if v.verdict is Status.FAIL]
        style = "red" if failed else "green"
        console.print(f"[{style}]{'FAIL: ' + ', '.join(failed) if failed else 'PASS: every node is ready'}[/]")
    if any(v.verdict is Status.FAIL for v in verdicts):
        raise typer.Exit(1)
