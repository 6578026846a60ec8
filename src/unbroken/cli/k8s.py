"""``unbroken k8s render|start``: a job file as an annotated Kubeflow PyTorchJob or TrainJob (``kubernetes/backend/render.py``).

``unbroken --kubeconfig ... job start`` takes the same flags and does what ``k8s start`` does, so a
job moves from a laptop to a cluster by adding ``--kubeconfig`` and ``--image``. The flags follow
HyperPod's ``start-job``: ``--auto-resume --max-retry --node-count --tasks-per-node --image
--entry-script --label-selector --deep-health-check-passed-nodes-only``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from unbroken.cli.common import Output, OutputOption, console, kube_api, print_json
from unbroken.config.job import JobSpec, load_job
from unbroken.errors import ConflictError, UsageError
from unbroken.kubernetes.backend import names

app = typer.Typer(help="Run jobs on a Kubernetes cluster as Kubeflow PyTorchJobs or TrainJobs that unbroken keeps alive.",
                  no_args_is_help=True)

PANEL = "On Kubernetes (--kubeconfig/--context)"
DEFAULT_KIND = "PyTorchJob"
DEFAULT_RUNTIME = names.TRAINJOB_DEFAULT_RUNTIME

FileOption = Annotated[Path, typer.Option("--file", "-f", help="Job file: the same format as `unbroken job start -f` "
                                          "(name, nodes, procs_per_node, command, env, resilience, checkpoint)")]
ImageOption = Annotated[str, typer.Option("--image", help="Container image with PyTorch, unbroken and the training code")]
NamespaceOption = Annotated[str, typer.Option("--namespace", "-n", help="Namespace of the job", rich_help_panel=PANEL)]
NameOption = Annotated[str | None, typer.Option("--name", help="Override the job file's name", show_default=False)]
NodesOption = Annotated[int | None, typer.Option("--node-count", min=1, help="Override nodes (one pod per node)", show_default=False)]
TasksOption = Annotated[int | None, typer.Option("--tasks-per-node", min=1, help="Override procs_per_node (ranks per node)",
                                                 show_default=False)]
EntryScriptOption = Annotated[str | None, typer.Option("--entry-script", help="Run this script (a path in the image) instead of "
                                                       "the job file's command's script or -m module; its arguments are kept",
                                                       show_default=False)]
GpusOption = Annotated[int, typer.Option("--gpus-per-node", min=0, help="nvidia.com/gpu each pod requests", rich_help_panel=PANEL)]
SelectorOption = Annotated[list[str] | None, typer.Option("--label-selector", help="key=value the nodes must carry "
                                                          "(repeatable; a nodeSelector)", show_default=False,
                                                          rich_help_panel=PANEL)]
ResumeOption = Annotated[bool | None, typer.Option("--auto-resume/--no-auto-resume", help="Override resilience.auto_resume",
                                                   show_default=False)]
RetryOption = Annotated[int | None, typer.Option("--max-retry", min=0, help="Override resilience.max_retry", show_default=False)]
DeepOption = Annotated[bool | None, typer.Option("--deep-health-check-passed-nodes-only/--any-schedulable-node",
                                                 help="Only nodes whose deep check Passed (default: what the job file "
                                                 "writes; on Kubernetes else any Schedulable node)", show_default=False)]
ClaimOption = Annotated[str | None, typer.Option("--checkpoint-claim", help="PersistentVolumeClaim every pod mounts at "
                                                 "checkpoint.dir (default /checkpoints)", show_default=False,
                                                 rich_help_panel=PANEL)]
SparePodsOption = Annotated[int, typer.Option(
    "--spare-pods", min=0, help="Extra pods, scheduled and warm with no ranks, that take a lost node's pod's place without a "
    "scheduling pass (runs `unbroken run`; a PyTorchJob only)", rich_help_panel=PANEL)]
KindOption = Annotated[str, typer.Option("--kind", help="PyTorchJob (training-operator v1) or TrainJob (Kubeflow Trainer v2)",
                                         rich_help_panel=PANEL)]
RuntimeOption = Annotated[str, typer.Option("--runtime", help="A TrainJob's ClusterTrainingRuntime", rich_help_panel=PANEL)]


@dataclass(frozen=True)
class Submission:
    """A job file and the flags that shape it for a cluster: everything ``k8s render/start`` and
    ``job start`` on a cluster take. ``None``: what the job file says."""

    file: Path
    image: str
    namespace: str = "default"
    name: str | None = None
    nodes: int | None = None
    tasks_per_node: int | None = None
    entry_script: str | None = None
    gpus_per_node: int = 0
    label_selector: list[str] = field(default_factory=list)
    auto_resume: bool | None = None
    max_retry: int | None = None
    deep_only: bool | None = None
    checkpoint_claim: str | None = None
    kind: str = DEFAULT_KIND
    runtime: str = DEFAULT_RUNTIME
    spare_pods: int = 0

    def spec(self) -> JobSpec:
        overrides: dict[str, Any] = {}
        for key, value in (("name", self.name), ("nodes", self.nodes), ("procs_per_node", self.tasks_per_node),
                           ("resilience.auto_resume", self.auto_resume), ("resilience.max_retry", self.max_retry)):
            if value is not None:
                overrides[key] = value
        return load_job(self.file, overrides=overrides, entry_script=self.entry_script, in_image=True)

    def render(self) -> dict[str, Any]:
        from unbroken.kubernetes.backend.render import KINDS, Placement, parse_label_selector, render

        kind = next((k for name, k in KINDS.items() if name.lower() == self.kind.lower()), None)
        if kind is None:
            raise UsageError(f"--kind {self.kind!r} is not a workload unbroken runs: use one of {', '.join(KINDS)}")
        placement = Placement(image=self.image, namespace=self.namespace, gpus_per_node=self.gpus_per_node,
                              node_selector=parse_label_selector(self.label_selector), deep_health_only=self.deep_only,
                              checkpoint_claim=self.checkpoint_claim, runtime=self.runtime, spare_pods=self.spare_pods)
        return render(self.spec(), placement, kind)

    def create(self) -> str:
        """Create the rendered job on the cluster the root options name, say how to follow it, return
        its name there (``<namespace>/<name>``)."""
        import kubernetes

        from unbroken.kubernetes.backend.api import STRICT, ApiConflict, call
        from unbroken.kubernetes.backend.workloads import kind_of

        body = self.render()
        kind = kind_of(body)
        custom = kubernetes.client.CustomObjectsApi(kube_api())
        job = f"{self.namespace}/{body['metadata']['name']}"
        try:
            call(lambda: custom.create_namespaced_custom_object(kind.group, kind.version, self.namespace, kind.plural, body, field_validation=STRICT))
        except ApiConflict:
            raise ConflictError(f"{kind.kind} {job} already exists (pick another --name, or delete it first)") from None
        console.print(f"{kind.kind} [bold]{job}[/] created ({kind.node_count(body)} x {kind.procs_per_node(body)}); "
                      f"follow it with: unbroken job describe {job}")
        return job


@app.command("render")
def render(file: FileOption, image: ImageOption, namespace: NamespaceOption = "default", name: NameOption = None,
           node_count: NodesOption = None, tasks_per_node: TasksOption = None, entry_script: EntryScriptOption = None,
           gpus_per_node: GpusOption = 0, label_selector: SelectorOption = None, auto_resume: ResumeOption = None,
           max_retry: RetryOption = None, deep_only: DeepOption = None, checkpoint_claim: ClaimOption = None,
           kind: KindOption = DEFAULT_KIND, runtime: RuntimeOption = DEFAULT_RUNTIME, spare_pods: SparePodsOption = 0,
           output: OutputOption = Output.table) -> None:
    """Print the PyTorchJob (or TrainJob) `k8s start` would create, as YAML (or JSON with -o json). Nothing is sent.

    Example:  unbroken k8s render -f examples/k8s-job.yaml --image ghcr.io/me/train:1 --gpus-per-node 8 | kubectl apply -f -
    """
    body = Submission(file=file, image=image, namespace=namespace, name=name, nodes=node_count, tasks_per_node=tasks_per_node,
                      entry_script=entry_script, gpus_per_node=gpus_per_node, label_selector=label_selector or [],
                      auto_resume=auto_resume, max_retry=max_retry, deep_only=deep_only, checkpoint_claim=checkpoint_claim,
                      kind=kind, runtime=runtime, spare_pods=spare_pods).render()
    if output is Output.json:
        print_json(body)
    else:
        print(yaml.safe_dump(body, sort_keys=False), end="")


@app.command("start")
def start(file: FileOption, image: ImageOption, namespace: NamespaceOption = "default", name: NameOption = None,
          node_count: NodesOption = None, tasks_per_node: TasksOption = None, entry_script: EntryScriptOption = None,
          gpus_per_node: GpusOption = 0, label_selector: SelectorOption = None, auto_resume: ResumeOption = None,
          max_retry: RetryOption = None, deep_only: DeepOption = None, checkpoint_claim: ClaimOption = None,
          kind: KindOption = DEFAULT_KIND, runtime: RuntimeOption = DEFAULT_RUNTIME, spare_pods: SparePodsOption = 0) -> None:
    """Create the job on the cluster of --kubeconfig/--context (default: the kubeconfig's current context).

    The operator adopts it (auto-resume annotations) and restarts it through faults; follow it with
    `unbroken --kubeconfig ... job describe <namespace>/<name>`. `unbroken --kubeconfig ... job start` is the same.

    Example:  unbroken --context prod k8s start -f job.yaml --image ghcr.io/me/train:1 --node-count 4 --tasks-per-node 8 \\
              --gpus-per-node 8 --auto-resume --max-retry 5 --checkpoint-claim ckpt
    """
    Submission(file=file, image=image, namespace=namespace, name=name, nodes=node_count, tasks_per_node=tasks_per_node,
               entry_script=entry_script, gpus_per_node=gpus_per_node, label_selector=label_selector or [],
               auto_resume=auto_resume, max_retry=max_retry, deep_only=deep_only, checkpoint_claim=checkpoint_claim,
               kind=kind, runtime=runtime, spare_pods=spare_pods).create()
