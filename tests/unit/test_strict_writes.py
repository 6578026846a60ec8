"""Every create and patch unbroken sends to the API server asks for strict field validation (kubernetes/backend/api.py
``STRICT``), and the real API server then refuses a misspelt field instead of dropping it."""

from __future__ import annotations

import ast
from pathlib import Path

import kubernetes
import pytest

from unbroken.kubernetes.backend.api import STRICT
from unbroken.kubernetes.backend.client import api_client

SRC = Path(__file__).resolve().parents[2] / "src" / "unbroken"
WRITES = ("create_", "patch_", "replace_")
CLIENTS = (kubernetes.client.CoreV1Api, kubernetes.client.CustomObjectsApi, kubernetes.client.CoordinationV1Api,
           kubernetes.client.BatchV1Api, kubernetes.client.EventsV1Api)


RECEIVERS = {"core", "custom", "coordination", "batch", "leases"}
"""What unbroken calls its API clients (``self.core``, ``store.custom``, ``leases``...)."""


def is_client_write(call: ast.Attribute) -> bool:
    receiver = call.value.attr if isinstance(call.value, ast.Attribute) else getattr(call.value, "id", "")
    return receiver in RECEIVERS and call.attr.startswith(WRITES) and any(hasattr(api, call.attr) for api in CLIENTS)


def writes_without_strict() -> list[str]:
    """``file:line method`` of every call of a ``kubernetes`` client write method (``create_*``, ``patch_*``,
    ``replace_*`` of the API classes unbroken uses) that does not pass ``field_validation``."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_client_write(node.func) \
                    and not any(k.arg == "field_validation" for k in node.keywords):
                found.append(f"{path.relative_to(SRC)}:{node.lineno} {node.func.attr}")
    return found


def test_every_write_to_the_api_server_asks_for_strict_field_validation() -> None:
    assert writes_without_strict() == []


def test_the_api_server_refuses_a_misspelt_field_in_a_strict_patch(kubeconfig: Path, namespace: str) -> None:
    core = kubernetes.client.CoreV1Api(api_client(kubeconfig))
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "c"}, "data": {}}, field_validation=STRICT)
    with pytest.raises(kubernetes.client.ApiException) as refused:
        core.patch_namespaced_config_map("c", namespace, {"metadata": {"labelz": {"a": "b"}}}, field_validation=STRICT)
    assert refused.value.status in (400, 422) and "labelz" in str(refused.value.body)
