"""The uninterrupted reference run that every fault test compares its parameters with."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import STEPS, Cluster, run_cli

from unbroken.plumbing import procs


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> Path:
    """Final parameters of an uninterrupted 2-node x 2-process run (the fault tests' yardstick)."""
    tmp = tmp_path_factory.mktemp("reference")
    cluster = Cluster(tmp / "cluster")
    run_cli("cluster", "up", "--nodes", "2", cluster_dir=cluster.dir)
    try:
        output = cluster.submit(tmp, "ref", steps=STEPS)
        job = cluster.wait_job_phase("ref", {"Succeeded", "Failed"}, 180)
        assert job.phase.value == "Succeeded", job.reason
        assert job.attempt == 0
    finally:
        run_cli("cluster", "down", cluster_dir=cluster.dir, check=False)
    assert not procs.cluster_processes(cluster.dir)
    return output




@pytest.fixture(scope="session")
def kjv_tokens(kjv: Path, tmp_path_factory) -> Path:
    """The King James Bible as token shards (a 2048-token BPE), for the LLM workload."""
    out = tmp_path_factory.mktemp("kjv-tokens")
    run_cli("data", "prepare-text", str(kjv), "--out", str(out), "--vocab-size", "2048", "--shard-tokens", "262144", "-o", "json")
    return out
