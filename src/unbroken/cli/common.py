"""Options, output and store access shared by every command group."""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass, is_dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from unbroken.plumbing.layout import ClusterLayout, default_cluster_dir
from unbroken.errors import UsageError
from unbroken.runtime import Runtime, open_kubernetes, open_local

if TYPE_CHECKING:
    import kubernetes

# Outside a terminal (pipes, CI logs) rich would wrap tables at 80 columns; $COLUMNS
# or a width that fits a node table on one line reads better there.
_WIDTH = None if sys.stdout.isatty() else shutil.get_terminal_size((180, 24)).columns
console = Console(width=_WIDTH)
err_console = Console(stderr=True, width=_WIDTH)


class Output(str, Enum):
    table = "table"
    json = "json"


DirOption = Annotated[
    Path | None,
    typer.Option("--dir", help="Cluster directory. Default: $UNBROKEN_DIR, else ./.unbroken", show_default=False),
]
OutputOption = Annotated[Output, typer.Option("--output", "-o", help="table for people, json for scripts")]


def layout_for(directory: Path | None) -> ClusterLayout:
    return ClusterLayout.at(directory or default_cluster_dir())


@dataclass(frozen=True)
class KubernetesTarget:
    """The cluster the root options name: ``unbroken --kubeconfig F --context C node list``."""

    kubeconfig: Path | None = None
    context: str | None = None
    namespace: str = "unbroken-system"
    """Where unbroken is installed (its ConfigMap and Leases)."""


BACKEND_ENV = "UNBROKEN_BACKEND"
_kubernetes: KubernetesTarget | None = None


def use_kubernetes(target: KubernetesTarget | None) -> None:
    """Set by the root callback when ``--kubeconfig``/``--context`` or ``UNBROKEN_BACKEND=kubernetes`` is given."""
    global _kubernetes
    _kubernetes = target


def on_kubernetes() -> bool:
    """Whether the root options name a Kubernetes cluster (else commands act on a local one)."""
    return _kubernetes is not None


def kubernetes_target() -> KubernetesTarget:
    """The named cluster, or the kubeconfig's current context (kubectl's default) for commands that are Kubernetes-only."""
    return _kubernetes or KubernetesTarget()


def kube_api() -> "kubernetes.client.ApiClient":
    from unbroken.kubernetes.backend.client import api_client

    target = kubernetes_target()
    return api_client(target.kubeconfig, target.context)


def refuse_dir_on_kubernetes(directory: Path | None) -> None:
    if directory is not None:
        raise UsageError("--dir names a local cluster; it cannot be used with --kubeconfig/--context/UNBROKEN_BACKEND=kubernetes")


def open_runtime(directory: Path | None) -> Runtime:
    """The cluster the root options name on Kubernetes; else the local one of ``--dir`` (or $UNBROKEN_DIR, or ./.unbroken)."""
    if _kubernetes is not None:
        refuse_dir_on_kubernetes(directory)
        return open_kubernetes(kube_api(), _kubernetes.namespace)
    return open_local(layout_for(directory))


def print_json(data: Any) -> None:
    print(json.dumps(_plain(data), indent=2, default=str))


def _plain(data: Any) -> Any:
    if is_dataclass(data) and not isinstance(data, type):
        return _plain(asdict(data))
    if isinstance(data, dict):
        return {k: _plain(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_plain(v) for v in data]
    if isinstance(data, Enum):
        return data.value
    return data


def table(title: str | None, columns: list[str], rows: list[list[Any]]) -> Table:
    """A rich table; all-empty column names make a headerless key/value table."""
    t = Table(title=title, header_style="bold", title_justify="left", show_header=any(columns))
    for column in columns:
        t.add_column(column, overflow="fold")
    for row in rows:
        # Cells hold user text (commands, reasons, paths): never let rich read it as markup.
        t.add_row(*("-" if v is None or v == "" else escape(str(v)) for v in row))
    return t


def ago(ts: float | None, now: float | None = None) -> str:
    if ts is None:
        return "-"
    seconds = (now or time.time()) - ts
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def clock(ts: float | None) -> str:
    if ts is None:
        return "-"
    return time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int(ts % 1 * 1000):03d}"


def field_line(key: str, value: Any) -> None:
    """``      key: value`` for describe views; the value is printed verbatim."""
    console.print(f"[bold]{key:>14}[/]: {escape(str(value)) if value is not None else '-'}")

