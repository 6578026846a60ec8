"""``unbroken validate``: the whole catalogue on the whole cluster, plus a short real training job."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import typer

from unbroken.controller import jobs
from unbroken.cli.check import run_checks
from unbroken.cli.common import Output, console, open_runtime, print_json, table
from unbroken.config.job import JobSpec
from unbroken.errors import UsageError
from unbroken.health import validate
from unbroken.health.result import Status, Suite
from unbroken.runtime import Runtime
from unbroken.state.phases import JobPhase, NodeState
from unbroken.state.updates import JobUpdate

_STYLE = {Status.PASS: "green", Status.WARN: "yellow", Status.FAIL: "red", Status.SKIP: "dim"}
_WORKLOADS = ("mlp", "llm")


@dataclass(frozen=True)
class BurnIn:
    """The training job validate runs across every node (one rank each)."""

    workload: str = "mlp"
    data: Path | None = None
    config: str = "tiny"

    @classmethod
    def parse(cls, workload: str, data: Path | None, config: str) -> BurnIn:
        if workload not in _WORKLOADS:
            raise UsageError(f"--workload {workload!r}: one of {', '.join(_WORKLOADS)}")
        if workload == "llm":
            from unbroken.data.token_shards import read_index
            from unbroken.workloads.llama import CONFIGS as LLM_CONFIGS  # torch: only for --workload llm

            if data is None:
                raise UsageError("--workload llm needs --data DIR: token shards from unbroken data prepare-text")
            read_index(data)  # a clear error now rather than a failed job on every node
            if config not in LLM_CONFIGS:
                raise UsageError(f"--config {config!r}: one of {', '.join(LLM_CONFIGS)}")
            data = data.resolve()
        return cls(workload, data, config)

    def command(self, steps: int, ranks: int) -> list[str]:
        if self.workload == "mlp":
            return ["-m", "unbroken.workloads.mlp", "--steps", str(steps)]
        return ["-m", "unbroken.workloads.llm", "--data", str(self.data), "--config", self.config, "--steps", str(steps),
                "--global-batch", str(2 * ranks), "--micro-batch", "2", "--checkpoint-every", str(steps), "--warmup", "1"]


def run_validate(directory: Path | None, output: Output, steps: int, timeout: float, burn_in: BurnIn | None = None) -> None:
    burn_in = burn_in or BurnIn()
    runtime = open_runtime(directory)
    layout, store = runtime.layout, runtime.cluster
    nodes = [n for n in store.list_nodes() if n.state is NodeState.SCHEDULABLE]
    if not nodes:
        raise UsageError("no Schedulable node to validate (is the cluster up? see 'unbroken node list')")
    busy = {w.node for w in runtime.backend.active_workers()}
    if busy:
        raise UsageError(f"nodes {', '.join(sorted(busy))} are running jobs; validate an idle cluster (the stress "
                         "checks and the training job would disturb them)")
    names = [n.name for n in nodes]
    if output is Output.table:
        console.print(f"validating {len(nodes)} nodes: device, stress, storage and network checks, "
                      f"the collective sweep, and a {steps}-step {burn_in.workload} training job across all of them")
    results = run_checks(layout, store, runtime.config, nodes, [Suite.INSTANCE_STRESS, Suite.INSTANCE_CONNECTIVITY],
                         params={"ops": ["all_reduce", "all_gather", "reduce_scatter"]})
    training = training_job(runtime, names, steps=steps, timeout=timeout, base_dir=str(layout.root), burn_in=burn_in)
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


def training_job(runtime: Runtime, nodes: list[str], *, steps: int, timeout: float, base_dir: str,
                 burn_in: BurnIn | None = None) -> dict[str, tuple[Status, str]]:
    """Run a shipped workload across ``nodes`` (one rank each) and report per node."""
    store = runtime.cluster
    name = f"validate-{int(time.time())}"
    command = (burn_in or BurnIn()).command(steps, len(nodes))
    spec = JobSpec.model_validate({"name": name, "nodes": len(nodes), "procs_per_node": 1, "command": command,
                                   "resilience": {"auto_resume": False}}, context={"base_dir": base_dir})
    jobs.submit(store, spec, note="unbroken validate")
    deadline = time.monotonic() + timeout
    job = store.get_job(name)
    while not job.phase.is_terminal and time.monotonic() < deadline:
        time.sleep(0.5)
        job = store.get_job(name)
    if not job.phase.is_terminal:
        store.update_job(name, JobUpdate(cancel_requested=True))
        return {n: (Status.FAIL, f"job {name} did not finish within {timeout:g} s ({job.phase.value})") for n in nodes}
    ran = {w.node: w for w in runtime.backend.observe_attempt(name, job.attempt)}
    out: dict[str, tuple[Status, str]] = {}
    for node in nodes:
        worker = ran.get(node)
        if job.phase is JobPhase.SUCCEEDED and worker is not None:
            out[node] = (Status.PASS, f"{steps} steps")
        elif worker is None:
            out[node] = (Status.SKIP, f"not placed ({job.reason})")
        else:
            out[node] = (Status.FAIL, worker.message or job.reason or job.phase.value)
    return out
