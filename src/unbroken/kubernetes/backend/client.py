"""An API client: from a kubeconfig (and context), or the pod's service account inside a cluster."""

from __future__ import annotations

import os
from pathlib import Path

import kubernetes
from kubernetes.config.config_exception import ConfigException

from unbroken.errors import UsageError


def api_client(kubeconfig: Path | None = None, context: str | None = None) -> kubernetes.client.ApiClient:
    """``kubeconfig``/``context`` as kubectl reads them (``$KUBECONFIG``, ``~/.kube/config``);
    inside a pod with neither given, the service account. A bad file or an unknown context
    is a UsageError naming it, not a traceback."""
    if kubeconfig is None and context is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config = kubernetes.client.Configuration()
        kubernetes.config.load_incluster_config(client_configuration=config)
        return kubernetes.client.ApiClient(configuration=config)
    path = kubeconfig or Path(os.environ.get("KUBECONFIG", "~/.kube/config")).expanduser()
    if not Path(path).is_file():
        raise UsageError(f"kubeconfig {path} does not exist (pass --kubeconfig, or set KUBECONFIG)")
    try:
        return kubernetes.config.new_client_from_config(config_file=str(path), context=context)
    except ConfigException as exc:
        raise UsageError(f"kubeconfig {path}: {exc}" + (f" (context {context!r})" if context else "")) from None
