"""A job's ``unbroken.dev/*`` annotations both ways (kubernetes/backend/annotations.py): what ``write`` puts on a
workload, ``parse`` and ``job_spec`` read back as the same resilience, so the CLI that renders a job and the
operator that runs it cannot drift apart."""

from __future__ import annotations

from typing import Any

import pytest

from unbroken.config.job import STARTUP_TIMEOUT_FALLBACK_S, JobSpec, StragglerPolicy
from unbroken.kubernetes.backend import annotations, names


def spec(**resilience: Any) -> JobSpec:
    return JobSpec.model_validate({"name": "llama", "nodes": 3, "procs_per_node": 8, "command": ["train.py"],
                                   "resilience": {"auto_resume": True, **resilience},
                                   "checkpoint": {"memory": {"every_steps": 10, "replicas": 1},
                                                  "persistent": {"uri": "s3://bucket/llama", "every_steps": 100}}},
                                  context={"in_image": True})


def read_back(written: JobSpec, text: dict[str, str], *, fewest_pods: int | None = None) -> JobSpec:
    settings = annotations.parse(text)
    assert settings is not None
    return annotations.job_spec(settings, name=written.name, command="PyTorchJob default/llama", pods=written.nodes,
                                procs_per_node=written.procs_per_node, fewest_pods=fewest_pods)


@pytest.mark.parametrize("spare_pods", [0, 1])
def test_every_setting_a_job_writes_is_read_back_as_written(spare_pods: int) -> None:
    written = spec(max_retry=7, hang_timeout=120, startup_timeout=900, require_deep_health_passed=True,
                   straggler_policy="replace", straggler_restart_cost=45)
    text = annotations.write(written, deep_health=True, spare_pods=spare_pods)
    back = read_back(written, text)
    ours, theirs = written.resilience, back.resilience
    assert (theirs.max_retry, theirs.hang_timeout, theirs.startup_timeout) == (ours.max_retry, 120, 900)
    assert theirs.require_deep_health_passed and theirs.straggler_policy is StragglerPolicy.REPLACE
    assert theirs.straggler_restart_cost == 45
    assert back.checkpoint.tiers == written.checkpoint.tiers
    assert theirs.node_losses_in_place == spare_pods  # a spare pod is a node the job may lose in place
    assert (back.nodes, back.procs_per_node) == (written.nodes, written.procs_per_node)


def test_what_a_job_leaves_unset_stays_unset_or_takes_the_documented_default() -> None:
    written = spec()
    text = annotations.write(written, deep_health=False, spare_pods=0)
    assert names.HANG_TIMEOUT not in text and names.STRAGGLER_POLICY not in text and names.SPARE_PODS not in text
    back = read_back(written, text).resilience
    assert back.hang_timeout is None  # the operator sets it from the job's step times
    assert back.startup_timeout == STARTUP_TIMEOUT_FALLBACK_S
    assert back.straggler_policy is StragglerPolicy.REPORT and not back.require_deep_health_passed


def test_an_elastic_jobs_losable_pods_come_from_its_minimum_not_its_spares() -> None:
    written = spec()
    back = read_back(written, annotations.write(written, deep_health=False, spare_pods=0), fewest_pods=1)
    assert back.resilience.node_losses_in_place == 2  # 3 pods, 1 needed
