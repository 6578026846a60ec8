"""``unbroken node list|describe|cordon|uncordon|reboot|replace``."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from unbroken.cli.common import DirOption, Output, OutputOption, ago, clock, console, field_line, open_runtime, print_json, table
from unbroken.controller.node_decisions import MANUAL
from unbroken.errors import UsageError
from unbroken.state.phases import NodeState
from unbroken.runtime import Runtime
from unbroken.state.records import EventType, Node
from unbroken.state.updates import NodeUpdate

app = typer.Typer(help="Inspect nodes and take them in or out of service.", no_args_is_help=True)

NodeArg = Annotated[str, typer.Argument(help="Node name, e.g. node-2")]


def running_jobs(runtime: Runtime) -> dict[str, str]:
    return {w.node: w.job for w in runtime.backend.active_workers()}


def node_record(node: Node, job: str | None) -> dict:
    return {
        "name": node.name, "group": node.group, "instance_type": node.instance_type,
        "state": node.state.value,
        "labels": {
            "unbroken.dev/node-health-status": node.state.health_status_label,
            "unbroken.dev/deep-health-check-status": node.deep_health.value,
            "unbroken.dev/fault-type": node.fault_type,
            "unbroken.dev/fault-reason": node.fault_reason,
        },
        "health_status": node.state.health_status_label,
        "deep_health_check_status": node.deep_health.value,
        "fault_type": node.fault_type, "fault_reason": node.fault_reason,
        "job": job, "address": node.address, "agent_pid": node.agent_pid,
        "heartbeat_at": node.heartbeat_at, "reboots": node.reboots, "replaced_by": node.replaced_by,
    }


def node_rows(runtime: Runtime, include_retired: bool) -> tuple[list[str], list[list]]:
    jobs = running_jobs(runtime)
    now = time.time()
    rows = [
        [n.name, n.group, n.instance_type, n.state.value, n.deep_health.value, n.fault_type,
         n.fault_reason, jobs.get(n.name), ago(n.heartbeat_at, now)]
        for n in runtime.cluster.list_nodes() if include_retired or n.state is not NodeState.RETIRED
    ]
    return ["NODE", "GROUP", "TYPE", "HEALTH", "DEEP-CHECK", "FAULT", "REASON", "JOB", "HEARTBEAT"], rows


@app.command("list")
def list_nodes(
    directory: DirOption = None,
    output: OutputOption = Output.table,
    all_: Annotated[bool, typer.Option("--all", "-a", help="Include retired (replaced) nodes")] = False,
) -> None:
    """Nodes with health status, deep-check status, fault reason and running job."""
    runtime = open_runtime(directory)
    if output is Output.json:
        jobs = running_jobs(runtime)
        print_json([node_record(n, jobs.get(n.name)) for n in runtime.cluster.list_nodes() if all_ or n.state is not NodeState.RETIRED])
        return
    columns, rows = node_rows(runtime, include_retired=all_)
    console.print(table(None, columns, rows))


@app.command("describe")
def describe(name: NodeArg, directory: DirOption = None, output: OutputOption = Output.table) -> None:
    """Labels, agent, fault history and the node's events in order."""
    runtime = open_runtime(directory)
    node = runtime.cluster.get_node(name)
    record = node_record(node, running_jobs(runtime).get(name))
    events = runtime.cluster.list_events(object_kind="Node", object_name=name)
    if output is Output.json:
        print_json({**record, "events": events})
        return
    for key in ("name", "group", "instance_type", "state", "address", "agent_pid", "job", "reboots", "replaced_by"):
        field_line(key, record[key])
    field_line("heartbeat", f"{ago(node.heartbeat_at)} ago")
    for label, value in record["labels"].items():
        field_line("label", f"{label}={value if value is not None else ''}")
    console.print(table("events", ["TIME", "TYPE", "REASON", "MESSAGE"],
                        [[clock(e.ts), e.type.value, e.reason, e.message] for e in events]))


def _move(directory, name: str, target: NodeState, allowed: set[NodeState], reason: str, event: str, recovery: bool) -> None:
    """Move ``name`` to ``target``; ``recovery`` marks an operator's reboot/replace request.

    A node already waiting in ``target`` (e.g. lost while NodeRecovery is None)
    keeps its fault type and reason and only gets the operator's go-ahead.
    """
    store = open_runtime(directory).cluster
    node = store.get_node(name)
    if node.state not in allowed | ({target} if recovery else set()):
        valid = ", ".join(sorted(s.value for s in allowed | ({target} if recovery else set())))
        raise UsageError(f"node {name} is {node.state.value}; {event} needs one of: {valid}")
    if not recovery:
        update = NodeUpdate(state=target)
    elif node.state is target:
        update = NodeUpdate(state=target, recovery_requested=True)
    else:
        update = NodeUpdate(state=target, recovery_requested=True, fault_type=MANUAL, fault_reason=reason)
    store.update_node(name, update, expect_version=node.version)
    store.add_event("Node", name, event, reason, type=EventType.WARNING if recovery else EventType.NORMAL)
    console.print(f"node {name}: {node.state.value} -> {target.value}")


@app.command("cordon")
def cordon(name: NodeArg, directory: DirOption = None) -> None:
    """Take a node out of scheduling; its running job keeps running (like kubectl cordon)."""
    _move(directory, name, NodeState.UNSCHEDULABLE, {NodeState.SCHEDULABLE, NodeState.JOINING},
          "cordoned by operator", "NodeCordoned", recovery=False)


@app.command("uncordon")
def uncordon(name: NodeArg, directory: DirOption = None) -> None:
    """Put a cordoned node back into scheduling."""
    _move(directory, name, NodeState.SCHEDULABLE, {NodeState.UNSCHEDULABLE}, "uncordoned by operator", "NodeUncordoned", recovery=False)


@app.command("reboot")
def reboot(name: NodeArg, directory: DirOption = None) -> None:
    """Reboot a node: its workers stop (jobs resume elsewhere), its agent restarts and re-runs join checks."""
    _move(directory, name, NodeState.PENDING_REBOOT,
          {NodeState.SCHEDULABLE, NodeState.UNSCHEDULABLE, NodeState.JOINING},
          "reboot requested by operator", "NodeRebootRequested", recovery=True)


@app.command("replace")
def replace(name: NodeArg, directory: DirOption = None) -> None:
    """Retire a node and bring up a new one (new name) in its instance group."""
    _move(directory, name, NodeState.PENDING_REPLACEMENT,
          {NodeState.SCHEDULABLE, NodeState.UNSCHEDULABLE, NodeState.JOINING, NodeState.PENDING_REBOOT},
          "replacement requested by operator", "NodeReplacementRequested", recovery=True)
