"""Entry point: ``unbroken <group> <command>``. Errors are caught here, once."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from unbroken.cli import chaos, check, ckpt, cluster, data, job, k8s, node
from unbroken.cli.common import BACKEND_ENV, KubernetesTarget, err_console, use_kubernetes
from unbroken.errors import UnbrokenError

app = typer.Typer(
    name="unbroken",
    help="Keep distributed PyTorch training alive through failures.\n\n"
    "Start here:  unbroken cluster up --nodes 3;  unbroken job start -f examples/job.yaml;  unbroken job describe mlp\n\n"
    "On Kubernetes:  unbroken k8s start -f examples/k8s-job.yaml --image my/train:1;  "
    "unbroken --kubeconfig ~/.kube/config node list  (or UNBROKEN_BACKEND=kubernetes)",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(cluster.app, name="cluster")
app.add_typer(job.app, name="job")
app.add_typer(node.app, name="node")
app.add_typer(chaos.app, name="chaos")
app.add_typer(ckpt.app, name="ckpt")
app.add_typer(check.app, name="check")
app.add_typer(k8s.app, name="k8s")
app.add_typer(data.app, name="data")


@app.callback()
def root(
    kubeconfig: Annotated[Path | None, typer.Option("--kubeconfig", help="Work on the Kubernetes cluster of this kubeconfig "
                                                    "(node and job commands) instead of a local cluster",
                                                    show_default=False)] = None,
    context: Annotated[str | None, typer.Option("--context", help="The kubeconfig context to use (default: its current one)",
                                                show_default=False)] = None,
    namespace: Annotated[str, typer.Option("--unbroken-namespace", help="Where unbroken is installed on the cluster")] = "unbroken-system",
) -> None:
    """Which cluster: a local one (--dir on each command), or a Kubernetes one named here."""
    wanted = kubeconfig is not None or context is not None or os.environ.get(BACKEND_ENV, "").lower() == "kubernetes"
    use_kubernetes(KubernetesTarget(kubeconfig, context, namespace) if wanted else None)


@app.command("demo")
def demo_command(
    directory: cluster.DirOption = None,
    steps: int = typer.Option(300, help="Training steps of the demo job"),
    keep: bool = typer.Option(False, "--keep", help="Leave the cluster up afterwards for inspection"),
) -> None:
    """3 nodes, a 2-node job with auto-resume, a node killed mid-run; prints what recovery cost."""
    from unbroken.cli.demo import run_demo

    run_demo(directory, steps=steps, keep=keep)


@app.command("validate")
def validate_command(
    directory: cluster.DirOption = None,
    output: cluster.OutputOption = cluster.Output.table,
    steps: int = typer.Option(20, help="Steps of the end-to-end training job"),
    timeout: float = typer.Option(300.0, help="Seconds the training job may take"),
    workload: str = typer.Option("mlp", "--workload", help="The burn-in job: mlp (synthetic, no data) or llm (the "
                                 "Llama-style FSDP2 job on --data)"),
    data: Annotated[Path | None, typer.Option("--data", help="With --workload llm: token shards from unbroken data prepare-text",
                                              show_default=False)] = None,
    config: str = typer.Option("tiny", "--config", help="With --workload llm: the model size (tiny, small, llama3-1b, llama3-8b)"),
) -> None:
    """Validate an idle cluster before a big run: all checks on every node, the collective sweep, and a short
    training job across all nodes; one verdict row per node (exit 1 if any node fails).

    Example:  unbroken validate --workload llm --data data/kjv --config small --steps 50
    """
    from unbroken.cli.validate import BurnIn, run_validate

    run_validate(directory, output, steps, timeout, BurnIn.parse(workload, data, config))


@app.command("dashboard")
def dashboard_command(
    directory: cluster.DirOption = None,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on; anything but loopback needs a token"),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="Port; 0 picks a free one"),
    token: str | None = typer.Option(None, "--token", help="Token every request must carry (default on a network "
                                     "address: a random one, printed in the URL)", show_default=False),
) -> None:
    """A live web page of the cluster: nodes (health, faults), jobs (progress, restarts, goodput, the step-over-time plot
    with every fault and resume), checkpoints per tier, the event stream. Read-only.

    Example:  unbroken dashboard   (then open the printed URL)
    """
    from unbroken.cli.dashboard import run_dashboard

    run_dashboard(directory, host, port, token)


@app.command("operator", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, add_help_option=False)
def operator_command(ctx: typer.Context) -> None:
    """The Kubernetes operator (runs in the unbroken-operator Deployment): watches Nodes and annotated PyTorchJobs,
    labels and taints nodes, restarts jobs. `unbroken operator --help` lists its options."""
    from unbroken.kubernetes.operator.main import main as operator_main

    raise typer.Exit(operator_main(list(ctx.args)))


@app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, add_help_option=False)
def run_command(ctx: typer.Context) -> None:
    """In a Kubernetes pod, instead of torchrun (same arguments, same PET_* environment): restarts failed ranks in
    place, with warm spares, without recreating pods. `unbroken run --help` lists its options."""
    from unbroken.kubernetes.pod_launcher.main import main as run_main

    raise typer.Exit(run_main(list(ctx.args)))


@app.command("agent", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, add_help_option=False)
def agent_command(ctx: typer.Context) -> None:
    """The node agent on Kubernetes (runs in the unbroken-agent DaemonSet): heartbeats, kernel-log faults on its Node.
    `unbroken agent --kubernetes --help` lists its options."""
    from unbroken.kubernetes.node_agent import main as agent_main

    raise typer.Exit(agent_main(list(ctx.args)))


def run() -> None:
    """Typer handles usage errors (exit 2) and --help; our own errors end here as one line."""
    try:
        app()
    except UnbrokenError as exc:
        err_console.print(f"[red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    run()
