"""The pod template lines that connect a training pod's ranks to their node's agent (kubernetes/backend/rank_env.py)."""

from __future__ import annotations

import kubernetes_validate

from test_deploy_manifests import schema_version
from unbroken.rank import env as launch_env
from unbroken.kubernetes.backend.rank_env import AGENT_DIR, VOLUME, with_rank_env

LABEL = "training.kubeflow.org/job-name"


def template() -> dict:
    return {"spec": {"containers": [{"name": "pytorch", "image": "img", "command": ["torchrun", "train.py"],
                                     "env": [{"name": "UNBROKEN_JOB", "value": "stale"}, {"name": "HF_HOME", "value": "/cache"}]}]}}


def test_the_template_gains_the_socket_and_the_downward_api_identity_and_stays_valid() -> None:
    out = with_rank_env(template(), LABEL)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": out["spec"]}
    assert kubernetes_validate.validate(pod, schema_version(), strict=True)
    container = out["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_HOME"]["value"] == "/cache", "the user's env is kept"
    assert env[launch_env.JOB]["value"] == "$(UNBROKEN_POD_NAMESPACE)/$(UNBROKEN_WORKLOAD_NAME)", "ours replaces a stale one"
    names = [e["name"] for e in container["env"]]
    assert names.index("UNBROKEN_POD_NAMESPACE") < names.index(launch_env.JOB), "$(VAR) needs VAR defined first"
    assert env[launch_env.ATTEMPT]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.annotations['unbroken.dev/attempt']"
    assert container["volumeMounts"] == [{"name": VOLUME, "mountPath": AGENT_DIR}]
    assert out["spec"]["volumes"] == [{"name": VOLUME, "hostPath": {"path": AGENT_DIR, "type": "DirectoryOrCreate"}}]
    assert template()["spec"]["containers"][0]["env"][0]["value"] == "stale", "the input is not modified"


def test_applying_it_twice_changes_nothing() -> None:
    once = with_rank_env(template(), LABEL)
    assert with_rank_env(once, LABEL) == once


def test_a_pod_before_its_first_restart_is_attempt_0() -> None:
    """The attempt annotation is absent until the operator's first restart: the downward API gives ''."""
    assert launch_env.LaunchEnv.from_environ({launch_env.ATTEMPT: "", launch_env.JOB: "ns/j"}).attempt == 0
