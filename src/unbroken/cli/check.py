"""``unbroken check list|run|collective``: the health catalogue on demand."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from unbroken.cli.common import DirOption, Output, OutputOption, console, open_runtime, print_json, table
from unbroken.config.cluster import ClusterConfig
from unbroken.errors import UsageError
from unbroken.health import catalogue, events, runner, targets
from unbroken.health.collective import check as collective_check
from unbroken.health.collective.sweep import OPS, Row, format_table
from unbroken.health.result import CheckResult, Status, Suite
from unbroken.plumbing.layout import ClusterLayout
from unbroken.state.records import Node
from unbroken.state.store import ClusterStore

app = typer.Typer(help="Run health checks on demand: the same catalogue the agents run on join and while working.",
                  no_args_is_help=True)


@app.command("list")
def list_checks(output: OutputOption = Output.table) -> None:
    """Every check: id, suites, timeout, what it verifies."""
    specs = catalogue.all_checks()
    if output is Output.json:
        print_json([{"id": s.id, "suites": sorted(s.suites), "timeout_s": s.timeout_s, "description": s.description} for s in specs])
        return
    console.print(table(None, ["CHECK", "SUITES", "TIMEOUT", "WHAT"],
                        [[s.id, ",".join(sorted(s.suites)), f"{s.timeout_s:g}s", s.description] for s in specs]))


def _nodes(store: ClusterStore, names: list[str] | None) -> list[Node]:
    active = [n for n in store.list_nodes() if n.state.is_active]
    if not names:
        if not active:
            raise UsageError("no active node to check (is the cluster up?)")
        return active
    chosen = [store.get_node(name) for name in names]
    down = [n.name for n in chosen if not n.state.is_active]
    if down:
        raise UsageError(f"cannot check {', '.join(down)}: not active (state {store.get_node(down[0]).state.value})")
    return chosen


def run_checks(layout: ClusterLayout, store: ClusterStore, cluster: ClusterConfig, nodes: list[Node], suites: list[Suite],
               params: dict[str, Any] | None = None) -> list[CheckResult]:
    """Node-local checks per node; multi-node (collective) checks once across all ``nodes``."""
    results: list[CheckResult] = []
    peers = tuple(targets.peer(layout, cluster, n) for n in nodes)
    for suite in suites:
        for spec in catalogue.for_suite(suite, cluster.Health):
            if spec.id.startswith("collective."):
                ctx = targets.context(layout, cluster, nodes[0], peers=peers, params=params)
                results.append(runner.run_check(spec, ctx, suite))
                continue
            for node in nodes:
                results.append(runner.run_check(spec, targets.context(layout, cluster, node, params=params), suite))
    for result in results:
        events.record(store, result, log_line=False)
    return results


def result_record(r: CheckResult) -> dict[str, Any]:
    return {"node": r.node, "check": r.check, "suite": r.suite.value, "status": r.status.value, "reason": r.reason,
            "message": events.message(r), "faulty_nodes": list(r.faulty_nodes), "action": r.action.value,
            "duration_s": r.duration_s, "metrics": {k: v for k, v in r.metrics.items() if k != "report"}}


_STYLE = {Status.PASS: "green", Status.WARN: "yellow", Status.FAIL: "red", Status.SKIP: "dim"}


@app.command("run")
def run(
    directory: DirOption = None,
    output: OutputOption = Output.table,
    node: Annotated[list[str] | None, typer.Option("--node", "-n", help="Node to check (repeatable); default: every active node")] = None,
    suite: Annotated[list[str] | None, typer.Option("--suite", "-s", help="InstanceStress, InstanceConnectivity or Continuous "
                                                    "(repeatable); default: InstanceStress and InstanceConnectivity")] = None,
) -> None:
    """Run check suites now and print one row per check; exit 1 if any failed.

    Results are stored as node events (node describe shows them); nodes are not
    moved: that is the agents' job on join and while they work.

    Examples:  unbroken check run   |   unbroken check run --node node-2 --suite InstanceStress
    """
    runtime = open_runtime(directory)
    store = runtime.cluster
    suites = [catalogue.parse_suite(s) for s in suite] if suite else [Suite.INSTANCE_STRESS, Suite.INSTANCE_CONNECTIVITY]
    results = run_checks(runtime.layout, store, runtime.config, _nodes(store, node), suites)
    if output is Output.json:
        print_json([result_record(r) for r in results])
    else:
        console.print(table(None, ["NODE", "CHECK", "SUITE", "STATUS", "TIME", "MESSAGE"],
                            [[r.node, r.check, r.suite.value, r.status.value, f"{r.duration_s:.1f}s", events.message(r)]
                             for r in results]))
    if any(r.failed for r in results):
        raise typer.Exit(1)


@app.command("collective")
def collective(
    nodes: Annotated[str, typer.Option("--nodes", help="Comma-separated nodes, e.g. node-1,node-2 (one rank per node on CPU, "
                                       "one per GPU on GPU profiles)")],
    directory: DirOption = None,
    output: OutputOption = Output.table,
    begin: Annotated[str, typer.Option("-b", "--minbytes", help="Smallest size (nccl-tests -b): bytes, K, M or G")] = "8",
    end: Annotated[str, typer.Option("-e", "--maxbytes", help="Largest size (nccl-tests -e)")] = "32M",
    factor: Annotated[int, typer.Option("-f", "--stepfactor", help="Multiply the size by this each step (nccl-tests -f)")] = 2,
    iters: Annotated[int, typer.Option("-n", "--iters", help="Timed iterations per size", min=1)] = 5,
    warmup: Annotated[int, typer.Option("-w", "--warmup_iters", help="Untimed iterations per size", min=0)] = 1,
    ops: Annotated[str, typer.Option("--ops", help=f"Collectives, comma-separated: {', '.join(OPS)}")] = "all_reduce",
    repeat: Annotated[int, typer.Option("--repeat", help="Run the whole sweep this many times; each run is judged", min=1)] = 1,
) -> None:
    """All-reduce (all-gather, reduce-scatter) bandwidth across nodes, printed as nccl-tests prints it.

    busbw = algbw x 2(n-1)/n for all-reduce, x (n-1)/n for all-gather and reduce-scatter; GB = 1e9 bytes.
    The verdict compares the busbw of the largest size with the profile's floor (BusBwFloorGBps), retries
    once, and names the slow node when some pairs of nodes are fast and others slow.

    Example:  unbroken check collective --nodes node-1,node-2,node-3 -b 8 -e 256M -f 2
    """
    runtime = open_runtime(directory)
    layout, cluster = runtime.layout, runtime.config
    chosen = _nodes(runtime.cluster, [n.strip() for n in nodes.split(",") if n.strip()])
    wanted = [o.strip() for o in ops.split(",") if o.strip()]
    unknown = [o for o in wanted if o not in OPS]
    if unknown or not wanted:
        raise UsageError(f"--ops {ops!r}: unknown collective {unknown[0] if unknown else '(none)'}; valid: {', '.join(OPS)}")
    if "all_reduce" not in wanted:
        wanted.insert(0, "all_reduce")  # the verdict is judged on all-reduce
    params = {"begin": begin, "end": end, "factor": factor, "iters": iters, "warmup": warmup, "ops": wanted,
              "repeat": repeat, "include_report": True}
    peers = tuple(targets.peer(layout, cluster, n) for n in chosen)
    ctx = targets.context(layout, cluster, chosen[0], peers=peers, params=params)
    outcome = collective_check.allreduce(ctx)
    report = outcome.metrics.pop("report")
    rows = report["runs"][-1]["attempts"][-1]["rows"]
    if output is Output.json:
        print_json({"status": outcome.status.value, "message": outcome.message, "faulty_nodes": list(outcome.faulty_nodes),
                    "metrics": outcome.metrics, "rows": rows, "runs": [[a["busbw"] for a in r["attempts"]] for r in report["runs"]]})
    else:
        for op in wanted:
            typed = [Row(**r) for r in rows if r["op"] == op]
            print(format_table(typed, f"{op} across {', '.join(n.name for n in chosen)}: {typed[0].ranks} ranks"))
        style = _STYLE[outcome.status]
        console.print(f"[{style}]{outcome.status.value}[/]: {outcome.message}", highlight=False)
    if outcome.status is Status.FAIL:
        raise typer.Exit(1)
