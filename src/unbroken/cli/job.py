"""``unbroken job start|list|describe|logs|cancel``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from unbroken.controller import jobs, report
from unbroken.cli import k8s, logs_view
from unbroken.cli.common import (DirOption, Output, OutputOption, ago, clock, console, field_line, on_kubernetes, open_runtime,
                                 print_json, refuse_dir_on_kubernetes, table)
from unbroken.config.job import load_job
from unbroken.controller import hang_timeout
from unbroken.errors import UsageError
from unbroken.state.phases import JobPhase
from unbroken.runtime import Runtime
from unbroken.state.records import Job
from unbroken.state.updates import JobUpdate

app = typer.Typer(help="Submit, follow and cancel training jobs.", no_args_is_help=True)

JobArg = Annotated[str, typer.Argument(help="Job name (the job file's 'name')")]


@app.command("start")
def start(
    file: Annotated[Path, typer.Option("--file", "-f", help="Job file (YAML/JSON)")],
    directory: DirOption = None,
    auto_resume: Annotated[bool | None, typer.Option("--auto-resume/--no-auto-resume", help="Override resilience.auto_resume")] = None,
    max_retry: Annotated[int | None, typer.Option("--max-retry", min=0, help="Override resilience.max_retry")] = None,
    name: Annotated[str | None, typer.Option("--name", help="Override the job's name (names are unique per cluster)")] = None,
    nodes: Annotated[str | None, typer.Option("--nodes", "--node-count", help="Override nodes: N, or MIN:MAX for an elastic job "
                                              "that shrinks to MIN when nodes are lost and grows back to MAX (local only)",
                                              show_default=False)] = None,
    tasks_per_node: k8s.TasksOption = None,
    entry_script: k8s.EntryScriptOption = None,
    deep_only: k8s.DeepOption = None,
    wait: Annotated[bool, typer.Option("--wait", help="Follow the job with a progress bar until it ends; exit 1 unless it Succeeded")] = False,
    total_steps: Annotated[int | None, typer.Option("--steps", help="With --wait: steps in the whole run, for the progress bar")] = None,
    image: Annotated[str | None, typer.Option("--image", help="Container image with PyTorch, unbroken and the training code "
                                              "(required on Kubernetes)", show_default=False, rich_help_panel=k8s.PANEL)] = None,
    namespace: k8s.NamespaceOption = "default",
    gpus_per_node: k8s.GpusOption = 0,
    label_selector: k8s.SelectorOption = None,
    checkpoint_claim: k8s.ClaimOption = None,
    kind: k8s.KindOption = k8s.DEFAULT_KIND,
    runtime_name: k8s.RuntimeOption = k8s.DEFAULT_RUNTIME,
) -> None:
    """Submit a job; the controller places it on schedulable nodes (all or nothing; an elastic job, --nodes 2:4,
    on as many as are free between its min and max).

    On a Kubernetes cluster (--kubeconfig/--context) it is `k8s start`: the job file as an annotated PyTorchJob
    (or --kind TrainJob) running --image, which the operator keeps alive.

    Example:  unbroken job start -f examples/job.yaml --auto-resume --max-retry 2
    Example:  unbroken --context prod job start -f examples/k8s-job.yaml --image ghcr.io/me/train:1 --node-count 4 --gpus-per-node 8
    """
    if on_kubernetes():
        refuse_dir_on_kubernetes(directory)
        if image is None:
            raise UsageError("--image is required on Kubernetes: the container image with PyTorch, unbroken and the training code")
        if nodes is not None and not nodes.isdigit():
            raise UsageError(f"--node-count {nodes!r}: on Kubernetes a job has a fixed size, a whole number of nodes (e.g. 4)")
        created = k8s.Submission(file=file, image=image, namespace=namespace, name=name, nodes=int(nodes) if nodes else None,
                                 tasks_per_node=tasks_per_node, entry_script=entry_script, gpus_per_node=gpus_per_node,
                                 label_selector=label_selector or [], auto_resume=auto_resume, max_retry=max_retry,
                                 deep_only=deep_only, checkpoint_claim=checkpoint_claim, kind=kind, runtime=runtime_name).create()
        if wait:
            _wait(open_runtime(None), created, total_steps)
        return
    cluster_only = {"--image": image is not None, "--namespace": namespace != "default", "--gpus-per-node": gpus_per_node != 0,
                    "--label-selector": bool(label_selector), "--checkpoint-claim": checkpoint_claim is not None,
                    "--kind": kind != k8s.DEFAULT_KIND, "--runtime": runtime_name != k8s.DEFAULT_RUNTIME}
    if given := [flag for flag, set_ in cluster_only.items() if set_]:
        raise UsageError(f"{', '.join(given)}: for a Kubernetes cluster (add --kubeconfig or --context before `job`); "
                         "a local cluster runs the job file's command on its own nodes")
    overrides: dict[str, Any] = {}
    for key, value in (("resilience.auto_resume", auto_resume), ("resilience.max_retry", max_retry), ("name", name),
                       ("procs_per_node", tasks_per_node), ("resilience.require_deep_health_passed", deep_only)):
        if value is not None:
            overrides[key] = value
    if nodes is not None:
        overrides["nodes"] = nodes
        overrides["min_nodes"] = None  # the flag replaces the file's range, whichever form it had
    spec = load_job(file, overrides=overrides, entry_script=entry_script)
    runtime = open_runtime(directory)
    jobs.submit(runtime.cluster, spec)
    console.print(f"job [bold]{spec.name}[/] submitted ({spec.size}); "
                  f"follow it with: unbroken job describe {spec.name}")
    if wait:
        _wait(runtime, spec.name, total_steps)


def _wait(runtime: Runtime, name: str, total_steps: int | None) -> None:
    """``--wait``: follow the job until it ends; exit 1 unless it Succeeded."""
    job = follow(runtime, name, total_steps)
    if job.phase is not JobPhase.SUCCEEDED:
        raise typer.Exit(1)


def follow(runtime: Runtime, name: str, total_steps: int | None = None, on_tick=None) -> Job:
    """Show a progress bar (step, phase, restarts) until the job is terminal."""
    with Progress(TextColumn("[bold]{task.fields[job]}"), BarColumn(), TextColumn("step {task.completed:.0f}"),
                  TextColumn("{task.fields[phase]}"), TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("job", total=total_steps, job=name, phase="Pending")
        while True:
            job = runtime.cluster.get_job(name)
            step = jobs.current_step(runtime.backend.observe_attempt(name, job.attempt))
            phase = job.phase.value + (f" (restarts {job.attempt})" if job.attempt else "")
            bar.update(task, completed=step, phase=phase)
            if on_tick:
                on_tick(job, step)
            if job.phase.is_terminal:
                return job
            time.sleep(0.2)


@app.command("list")
def list_jobs(directory: DirOption = None, output: OutputOption = Output.table) -> None:
    """Jobs with phase, restarts, step and nodes."""
    runtime = open_runtime(directory)
    rows, records = [], []
    for job in runtime.cluster.list_jobs():
        summary = report.summarize(job, runtime.backend.worker_history(job.name), [])
        spec = job.spec()
        nodes = summary.attempts[-1].nodes if summary.attempts else []
        records.append({"name": job.name, "phase": job.phase.value, "restarts": job.attempt,
                        "max_retry": spec.resilience.max_retry, "step": summary.step, "nodes": nodes,
                        "created_at": job.created_at, "reason": job.reason})
        rows.append([job.name, job.phase.value, f"{job.attempt}/{spec.resilience.max_retry}", summary.step,
                     ",".join(nodes), ago(job.created_at), job.reason])
    if output is Output.json:
        print_json(records)
        return
    console.print(table(None, ["JOB", "PHASE", "RESTARTS", "STEP", "NODES", "AGE", "REASON"], rows))


@app.command("describe")
def describe(name: JobArg, directory: DirOption = None, output: OutputOption = Output.table) -> None:
    """Phase, restarts, every attempt, steps lost, recovery times, goodput and events in order."""
    runtime = open_runtime(directory)
    job = runtime.cluster.get_job(name)
    spec = job.spec()
    events = runtime.cluster.list_events(object_kind="Job", object_name=name)
    summary = report.summarize(job, runtime.backend.worker_history(name), events)
    if output is Output.json:
        print_json({"spec": spec.model_dump(mode="json"), "report": summary.to_dict(), "reason": job.reason, "events": events})
        return
    res = spec.resilience
    lines = [
        ("name", job.name),
        ("phase", f"{job.phase.value}" + (f" ({job.reason})" if job.reason else "")),
        ("restarts", f"{job.attempt - job.resizes} of max {res.max_retry}" + (f", {job.resizes} resizes" if job.resizes else "")
                     + f" (auto_resume {'on' if res.auto_resume else 'off'}, "
                     f"restart_policy {res.restart_policy.value})"),
        ("hang timeout", _hang_timeout(runtime, job)),
        ("stragglers", f"policy {res.straggler_policy.value}, threshold {res.straggler_threshold:g}"),
        ("size", spec.size + (f", now {len(job.nodes)}" if spec.elastic and job.nodes else "")),
        ("command", " ".join(spec.command)),
        ("step", summary.step),
        ("steps lost", summary.steps_lost),
        ("recovery", "; ".join(r.describe() for r in summary.recoveries) or "-"),
        ("goodput", f"{summary.goodput:.1%}" if summary.goodput is not None else "-"),
    ]
    for key, value in lines:
        field_line(key, value)
    console.print(table("attempts", ["ATTEMPT", "NODES", "SCHEDULED", "RESUMED FROM", "FIRST STEP AT", "LAST STEP", "OUTCOME"],
                        [[a.attempt, ",".join(a.nodes), clock(a.scheduled_at),
                          a.restored_step if a.restored_step is not None else "scratch", clock(a.first_step_at),
                          a.last_step, a.outcome] for a in summary.attempts]))
    console.print(table("events", ["TIME", "TYPE", "REASON", "MESSAGE"],
                        [[clock(e.ts), e.type.value, e.reason, e.message] for e in events]))


def _hang_timeout(runtime: Runtime, job: Job) -> str:
    """The timeout in force now and where it comes from (the job's, or its step times')."""
    workers = [] if job.phase.is_terminal else runtime.backend.observe_attempt(job.name, job.attempt)
    timeout = hang_timeout.in_force(job.spec(), workers)
    return f"{timeout.seconds:g} s ({timeout.why})"


@app.command("logs")
def logs(
    name: JobArg,
    directory: DirOption = None,
    node: Annotated[str | None, typer.Option("--node", help="Only this node (its torchrun log and its ranks)")] = None,
    rank: Annotated[int | None, typer.Option("--rank", help="Only this global rank")] = None,
    attempt: Annotated[int | None, typer.Option("--attempt", help="Attempt to show (default: the latest)")] = None,
    follow_: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines until the job ends")] = False,
) -> None:
    """Print the job's logs: torchrun's per node and each rank's, prefixed with where they came from.

    On Kubernetes (--kubeconfig) they are the current pods' container output, read from the
    kubelet through the API and prefixed [pod]; --follow and --rank are local only (the
    error names the kubectl command that follows them)."""
    runtime = open_runtime(directory)
    job = runtime.cluster.get_job(name)
    if runtime.worker_table is None:  # Kubernetes: the kubelet keeps the logs
        _pod_logs(runtime, job, node=node, rank=rank, attempt=attempt, follow=follow_)
        return
    chosen = job.attempt if attempt is None else attempt
    if not 0 <= chosen <= job.attempt:
        raise UsageError(f"job {name} has attempts 0..{job.attempt}, not {chosen}")
    logs_view.show(runtime, job, chosen, node=node, rank=rank, follow=follow_)


def _pod_logs(runtime: Runtime, job: Job, *, node: str | None, rank: int | None, attempt: int | None, follow: bool) -> None:
    from unbroken.kubernetes.backend import pod_logs  # here: local commands need not import the kubernetes client

    store = runtime.on_kubernetes("a pod's logs").cluster
    namespace, _, short = job.name.partition("/")
    kubectl = f"kubectl logs -n {namespace} -l {store.kind_of(job.name).pod_selector(short)} --prefix --tail=-1"
    if follow:
        raise UsageError(f"--follow is not built for Kubernetes jobs; follow the pods with: {kubectl} --follow")
    if rank is not None:
        raise UsageError("--rank: on Kubernetes a pod's ranks share its container's log (torchrun prefixes each line "
                         "with its local rank); pick the pod with --node, or read them all")
    if attempt is not None and attempt != job.attempt:
        raise UsageError(f"on Kubernetes only the pods of the latest attempt ({job.attempt}) exist, and with them their logs; "
                         f"attempt {attempt}'s went with its pods (keep them with a log collector)")
    found = pod_logs.job_pod_logs(store, job.name, node=node)
    if not found:
        where = f" on node {node}" if node else ""
        raise UsageError(f"job {job.name} has no pods{where} now (phase {job.phase.value}); its Events say why: "
                         f"unbroken job describe {job.name}")
    for entry in found:
        prefix = f"[{entry.pod}]"
        if entry.text is None:
            console.print(f"{prefix} (no log: {entry.unavailable})", highlight=False, markup=False)
            continue
        for line in entry.text.splitlines():
            print(f"{prefix} {line}")


@app.command("cancel")
def cancel(name: JobArg, directory: DirOption = None) -> None:
    """Stop the job's workers and mark it Cancelled."""
    store = open_runtime(directory).cluster
    job = store.get_job(name)
    if job.phase.is_terminal:
        raise UsageError(f"job {name} already ended ({job.phase.value})")
    store.update_job(name, JobUpdate(cancel_requested=True))
    store.add_event("Job", name, "JobCancelRequested", "cancel requested by user")
    console.print(f"job {name}: cancel requested")
