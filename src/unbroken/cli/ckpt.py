"""``unbroken ckpt ...``: a job's tiered checkpoints: list, verify, prune."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from unbroken.checkpoint import inventory as inv
from unbroken.checkpoint.node import credentials
from unbroken.checkpoint.node.persistent import PersistentStore
from unbroken.checkpoint.node.credentials import Credentials
from unbroken.cli.common import DirOption, Output, OutputOption, ago, console, kube_api, kubernetes_target, on_kubernetes, open_runtime, print_json, table
from unbroken.config.checkpoint import TierPolicy
from unbroken.errors import UsageError
from unbroken.runtime import Runtime
from unbroken.state.records import CheckpointTier, StepStatus

app = typer.Typer(
    help="A job's checkpoints in every tier: shared memory, peer replicas, persistent (file:// or s3://).\n\n"
    "Example:  unbroken ckpt list mlp;  unbroken ckpt verify mlp --step 200;  unbroken ckpt prune mlp --keep 1",
    no_args_is_help=True,
)
JobArg = Annotated[str, typer.Argument(help="Job name", show_default=False)]


def _policy(runtime: Runtime, job: str) -> TierPolicy:
    tiers = runtime.cluster.get_job(job).spec().checkpoint.tiers
    if tiers is None:
        raise UsageError(f"job {job} uses the file checkpointer (no 'memory' tier in its job file); its checkpoints are files under checkpoint.dir")
    return tiers


@contextlib.contextmanager
def _peer_credentials(runtime: Runtime) -> Iterator[Credentials]:
    """What a peer presents to a node's shard server: the cluster directory's files locally; on
    Kubernetes the Secret ``unbroken-cluster-tls``, copied for this command into a private folder
    that is removed after it (the CLI's user needs ``get`` on that Secret)."""
    if not on_kubernetes():
        yield credentials.load(runtime.layout.root)
        return
    from unbroken.kubernetes.backend import cluster_tls  # here: local commands need not import the kubernetes client

    with tempfile.TemporaryDirectory(prefix="unbroken-verify-") as scratch:
        yield cluster_tls.fetch(kube_api(), kubernetes_target().namespace, Path(scratch))


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


@app.command("list")
def list_steps(job: JobArg, directory: DirOption = None, output: OutputOption = Output.table) -> None:
    """Steps per tier: committed in memory (with own copies and replicas per rank), persistent state, size."""
    runtime = open_runtime(directory)
    policy = _policy(runtime, job)
    found = inv.inventory(runtime.catalog, runtime.cluster, job)
    if output is Output.json:
        print_json({"job": job, "steps": found.steps, "tier_warnings": [w.message for w in found.tier_warnings],
                    "persistent_uri": policy.persistent.uri if policy.persistent else None})
        return
    rows = [
        [s.step, s.memory, f"{s.memory_copies}/{s.world_size}", f"{s.replicated}/{s.world_size}",
         s.persistent + (f": {s.persistent_message}" if s.persistent_message else ""), _size(s.size), s.attempt, ago(s.committed_at)]
        for s in found.steps
    ]
    title = f"checkpoints of {job}" + (f" (persistent: {policy.persistent.uri})" if policy.persistent else " (no persistent tier)")
    console.print(table(title, ["STEP", "MEMORY", "OWN COPIES", "REPLICATED", "PERSISTENT", "SIZE", "ATTEMPT", "AGE"], rows))
    for warning in found.tier_warnings:
        console.print(f"[yellow]warning:[/] {warning.message}", highlight=False)
    if not rows:
        console.print("no committed step yet")


@app.command("verify")
def verify(
    job: JobArg,
    step: Annotated[int | None, typer.Option("--step", help="Only this step (default: every step in every tier)")] = None,
    directory: DirOption = None,
    output: OutputOption = Output.table,
) -> None:
    """Re-read every copy and check its checksum: each node's shared memory (own and replicas), then the persistent tier.

    Exits 1 if any copy is damaged; restore would skip it and fall back. On Kubernetes
    (--kubeconfig) it dials each node's shard server at its pod IP with the cluster's
    certificate from the Secret unbroken-cluster-tls: run it where pod IPs are reachable
    (inside the cluster, e.g. kubectl exec into the operator); elsewhere nodes show as unreachable.
    """
    runtime = open_runtime(directory)
    policy = _policy(runtime, job)
    store = runtime.catalog
    with _peer_credentials(runtime) as peer_credentials:
        checks = [c for c in inv.verify_memory(store, job, peer_credentials) if step is None or c.step in (step, -1)]
    if policy.persistent is not None:
        steps = None if step is None else [step]
        total = sum(r.size for r in store.list_checkpoint_steps(job, tier=CheckpointTier.PERSISTENT)
                    if r.status is StepStatus.COMMITTED and (step is None or r.step == step))
        with Progress(TextColumn("reading persistent tier"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                      console=console, transient=True, disable=output is Output.json) as bar:
            task = bar.add_task("read", total=total or None)
            checks += list(inv.verify_persistent(policy.persistent.uri, job, steps, on_bytes=lambda n: bar.advance(task, n)))
    bad = [c for c in checks if c.ok is False]
    unchecked = [c for c in checks if c.ok is None]
    if output is Output.json:
        print_json({"job": job, "ok": not bad, "checks": checks})
    else:
        rows = [[c.step if c.step >= 0 else "-", c.rank if c.rank >= 0 else "-", c.tier, c.where, {True: "ok", False: "DAMAGED", None: "unreachable"}[c.ok], c.detail]
                for c in sorted(checks, key=lambda c: (-c.step, c.tier, c.rank))]
        console.print(table(f"verify {job}", ["STEP", "RANK", "TIER", "WHERE", "RESULT", "DETAIL"], rows))
        verified = len(checks) - len(bad) - len(unchecked)
        console.print(f"{verified} copies verified" + (f", {len(bad)} damaged" if bad else "") + (f", {len(unchecked)} nodes unreachable" if unchecked else ""))
    if bad:
        raise typer.Exit(1)


@app.command("prune")
def prune(
    job: JobArg,
    keep: Annotated[int, typer.Option("--keep", min=1, help="Committed persistent steps to keep (newest first)")] = 1,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would be deleted")] = False,
    directory: DirOption = None,
) -> None:
    """Delete old steps from the persistent tier: committed ones beyond --keep, and torn
    leftovers (no COMMITTED marker) older than the newest committed step.

    Never deletes the newest committed step or a step being drained. Shared memory
    needs no pruning: agents keep it at the policy's 'keep'.
    """
    runtime = open_runtime(directory)
    store = runtime.catalog
    policy = _policy(runtime, job)
    if policy.persistent is None:
        raise UsageError(f"job {job} has no persistent tier; nothing to prune")
    tier = PersistentStore(policy.persistent.uri)
    committed = tier.committed_steps(job)
    if not committed:
        console.print(f"{policy.persistent.uri}/{job}: no committed step; nothing pruned")
        return
    draining = {r.step for r in store.list_checkpoint_steps(job, tier=CheckpointTier.PERSISTENT) if r.status is StepStatus.DRAINING}
    victims = committed[keep:] + [s for s in tier.steps(job) if s not in committed and s < committed[0] and s not in draining]
    for step in sorted(set(victims), reverse=True):
        console.print(f"{'would delete' if dry_run else 'deleting'} {tier.display(job, step)}")
        if not dry_run:
            tier.delete_step(job, step)
            store.delete_checkpoint_step(job, step, CheckpointTier.PERSISTENT)
            store.delete_shard_copies(job, step, tier=CheckpointTier.PERSISTENT)
    console.print(f"kept {min(keep, len(committed))} committed step(s), newest {committed[0]}")
