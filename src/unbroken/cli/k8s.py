"""``unbroken k8s render|start``: a job file as an annotated Kubeflow PyTorchJob (``kube/render.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from unbroken.cli.common import Output, OutputOption, console, kube_api, print_json
from unbroken.config.job import JobSpec, load_job
from unbroken.errors import ConflictError
from unbroken.kube.api import ApiConflict, call
from unbroken.kube.render import Placement, parse_label_selector, render_pytorchjob
from unbroken.kube.workloads import PYTORCHJOB

app = typer.Typer(help="Run jobs on a Kubernetes cluster as Kubeflow PyTorchJobs that unbroken keeps alive.",
                  no_args_is_help=True)

FileOption = Annotated[Path, typer.Option("--file", "-f", help="Job file: the same format as `unbroken job start -f` "
                                          "(name, nodes, procs_per_node, command, env, resilience, checkpoint.dir)")]
ImageOption = Annotated[str, typer.Option("--image", help="Container image with PyTorch, unbroken and the training code")]
NamespaceOption = Annotated[str, typer.Option("--namespace", "-n", help="Namespace of the PyTorchJob")]
NameOption = Annotated[str | None, typer.Option("--name", help="Override the job file's name", show_default=False)]
NodesOption = Annotated[int | None, typer.Option("--node-count", min=1, help="Override nodes (one pod per node)", show_default=False)]
TasksOption = Annotated[int | None, typer.Option("--tasks-per-node", min=1, help="Override procs_per_node (ranks per pod)",
                                                 show_default=False)]
GpusOption = Annotated[int, typer.Option("--gpus-per-node", min=0, help="nvidia.com/gpu each pod requests")]
SelectorOption = Annotated[list[str] | None, typer.Option("--label-selector", help="key=value the nodes must carry "
                                                          "(repeatable; a nodeSelector)", show_default=False)]
ResumeOption = Annotated[bool | None, typer.Option("--auto-resume/--no-auto-resume", help="Override resilience.auto_resume",
                                                   show_default=False)]
RetryOption = Annotated[int | None, typer.Option("--max-retry", min=0, help="Override resilience.max_retry", show_default=False)]
DeepOption = Annotated[bool | None, typer.Option("--deep-health-check-passed-nodes-only/--any-schedulable-node",
                                                 help="Only nodes whose deep check Passed (default: what the job file "
                                                 "writes, else any Schedulable node)", show_default=False)]
ClaimOption = Annotated[str | None, typer.Option("--checkpoint-claim", help="PersistentVolumeClaim every pod mounts at "
                                                 "checkpoint.dir (default /checkpoints)", show_default=False)]


def _build(file: Path, image: str, namespace: str, name: str | None, nodes: int | None, tasks: int | None, gpus: int,
           selector: list[str] | None, auto_resume: bool | None, max_retry: int | None, deep: bool | None,
           claim: str | None) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for key, value in (("name", name), ("nodes", nodes), ("procs_per_node", tasks),
                       ("resilience.auto_resume", auto_resume), ("resilience.max_retry", max_retry)):
        if value is not None:
            overrides[key] = value
    spec: JobSpec = load_job(file, overrides=overrides, in_image=True)
    placement = Placement(image=image, namespace=namespace, gpus_per_node=gpus, node_selector=parse_label_selector(selector or []),
                          deep_health_only=deep, checkpoint_claim=claim)
    return render_pytorchjob(spec, placement)


@app.command("render")
def render(file: FileOption, image: ImageOption, namespace: NamespaceOption = "default", name: NameOption = None,
           node_count: NodesOption = None, tasks_per_node: TasksOption = None, gpus_per_node: GpusOption = 0,
           label_selector: SelectorOption = None, auto_resume: ResumeOption = None, max_retry: RetryOption = None,
           deep_only: DeepOption = None, checkpoint_claim: ClaimOption = None, output: OutputOption = Output.table) -> None:
    """Print the PyTorchJob `k8s start` would create, as YAML (or JSON with -o json). Nothing is sent.

    Example:  unbroken k8s render -f examples/job.yaml --image ghcr.io/me/train:1 --gpus-per-node 8 | kubectl apply -f -
    """
    body = _build(file, image, namespace, name, node_count, tasks_per_node, gpus_per_node, label_selector, auto_resume,
                  max_retry, deep_only, checkpoint_claim)
    if output is Output.json:
        print_json(body)
    else:
        print(yaml.safe_dump(body, sort_keys=False), end="")


@app.command("start")
def start(file: FileOption, image: ImageOption, namespace: NamespaceOption = "default", name: NameOption = None,
          node_count: NodesOption = None, tasks_per_node: TasksOption = None, gpus_per_node: GpusOption = 0,
          label_selector: SelectorOption = None, auto_resume: ResumeOption = None, max_retry: RetryOption = None,
          deep_only: DeepOption = None, checkpoint_claim: ClaimOption = None) -> None:
    """Create the PyTorchJob on the cluster of --kubeconfig/--context (default: the kubeconfig's current context).

    The operator adopts it (auto-resume annotations) and restarts it through faults; follow it with
    `unbroken --kubeconfig ... job describe <namespace>/<name>`.

    Example:  unbroken --context prod k8s start -f job.yaml --image ghcr.io/me/train:1 --node-count 4 --tasks-per-node 8 \\
              --gpus-per-node 8 --auto-resume --max-retry 5 --checkpoint-claim ckpt
    """
    import kubernetes

    body = _build(file, image, namespace, name, node_count, tasks_per_node, gpus_per_node, label_selector, auto_resume,
                  max_retry, deep_only, checkpoint_claim)
    custom = kubernetes.client.CustomObjectsApi(kube_api())
    job = f"{namespace}/{body['metadata']['name']}"
    try:
        call(lambda: custom.create_namespaced_custom_object(PYTORCHJOB.group, PYTORCHJOB.version, namespace, PYTORCHJOB.plural, body))
    except ApiConflict:
        raise ConflictError(f"PyTorchJob {job} already exists (pick another --name, or delete it first)") from None
    replicas = body["spec"]["pytorchReplicaSpecs"]
    pods = sum(r["replicas"] for r in replicas.values())
    console.print(f"PyTorchJob [bold]{job}[/] created ({pods} x {body['spec']['nprocPerNode']}); "
                  f"follow it with: unbroken job describe {job}")
