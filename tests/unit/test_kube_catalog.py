"""The checkpoint catalog on Kubernetes (kubernetes/backend/catalog.py): the same contract as the SQLite catalog, on ConfigMaps.

Real: kube-apiserver and etcd (tests/controlplane), with their resourceVersion preconditions on patch and
delete; the catalog talks to it with the real ``kubernetes`` client. Racing writers are real threads with
their own clients.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import kubernetes
import pytest

from controlplane.cluster import ControlPlane
from helpers import race
from unbroken.kubernetes.backend import names
from unbroken.kubernetes.backend.catalog import KubernetesCatalog, configmap_name, copies_configmap_name
from unbroken.kubernetes.backend.client import api_client
from unbroken.state.catalog import CopyKey
from unbroken.state.records import CheckpointStep, CheckpointTier, ShardCopy, StepStatus

pytestmark = pytest.mark.timeout(60)
JOB = "team-a/llama"
CONFIGMAP_WRITES = {"POST", "PATCH", "PUT", "DELETE"}


@pytest.fixture
def catalog(kubeconfig: Path, namespace: str) -> KubernetesCatalog:
    return KubernetesCatalog(api_client(kubeconfig), namespace)


def a_step(step: int = 10, tier: CheckpointTier = CheckpointTier.MEMORY, **changes: object) -> CheckpointStep:
    record = CheckpointStep(job=JOB, step=step, tier=tier, attempt=0, world_size=2, status=StepStatus.DRAINING, size=8,
                            updated_at=1.0)
    return dataclasses.replace(record, **changes)  # type: ignore[arg-type]


def a_copy(rank: int, tier: CheckpointTier, node: str, step: int = 10) -> ShardCopy:
    return ShardCopy(job=JOB, step=step, rank=rank, tier=tier, node=node, attempt=0, world_size=2, size=4,
                     checksum="c", info_json='{"tensors": []}', created_at=1.5)


def configmaps(catalog: KubernetesCatalog) -> list[str]:
    """The catalog's ConfigMaps (every namespace also holds the controller-manager's ``kube-root-ca.crt``)."""
    return sorted(c.metadata.name for c in catalog.core.list_namespaced_config_map(catalog.namespace,
                                                                                  label_selector=names.CHECKPOINT_JOB).items)


def test_insert_if_absent_lets_exactly_one_writer_open_a_step(catalog: KubernetesCatalog) -> None:
    assert catalog.put_checkpoint_step(a_step(message="mine"), only_if_absent=True) is True
    assert catalog.put_checkpoint_step(a_step(message="theirs"), only_if_absent=True) is False
    assert [s.message for s in catalog.list_checkpoint_steps(JOB)] == ["mine"]


def test_compare_and_swap_writes_only_over_the_row_it_read_and_an_empty_step_leaves_no_configmap(catalog: KubernetesCatalog) -> None:
    catalog.put_checkpoint_step(a_step())
    read = catalog.list_checkpoint_steps(JOB)[0]
    assert read == a_step(), "a round trip keeps every field and type"
    claimed = dataclasses.replace(read, message="committing: gpu-a", updated_at=2.0)
    assert catalog.replace_checkpoint_step(read, claimed) is True
    failed = dataclasses.replace(read, status=StepStatus.FAILED, message="disk full")
    assert catalog.replace_checkpoint_step(read, failed) is False, "the row changed since it was read"
    assert catalog.list_checkpoint_steps(JOB) == [claimed]
    assert catalog.replace_checkpoint_step(claimed, None) is True, "None deletes"
    assert catalog.list_checkpoint_steps(JOB) == []
    assert catalog.replace_checkpoint_step(claimed, read) is False, "nothing to swap"
    assert configmaps(catalog) == [], "a step with no rows and no copies is no object"


def test_steps_and_copies_are_listed_newest_first_per_tier_and_job(catalog: KubernetesCatalog) -> None:
    for step in (10, 30, 20):
        catalog.put_checkpoint_step(a_step(step))
    catalog.put_checkpoint_step(a_step(30, CheckpointTier.PERSISTENT, status=StepStatus.COMMITTED, committed_at=3.0))
    other = dataclasses.replace(a_step(40), job="team-b/llama")
    catalog.put_checkpoint_step(other)
    assert [(s.step, s.tier) for s in catalog.list_checkpoint_steps(JOB)] == [
        (30, CheckpointTier.MEMORY), (30, CheckpointTier.PERSISTENT), (20, CheckpointTier.MEMORY), (10, CheckpointTier.MEMORY)]
    assert [s.step for s in catalog.list_checkpoint_steps(JOB, tier=CheckpointTier.PERSISTENT)] == [30]
    assert catalog.list_checkpoint_steps("team-b/llama") == [other]
    catalog.put_shard_copy(a_copy(1, CheckpointTier.PERSISTENT, "", step=30))
    catalog.put_shard_copy(a_copy(0, CheckpointTier.MEMORY, "gpu-a", step=20))
    assert [(c.step, c.rank, c.node) for c in catalog.list_shard_copies(JOB)] == [(30, 1, ""), (20, 0, "gpu-a")]
    assert catalog.list_shard_copies(JOB, step=30)[0] == a_copy(1, CheckpointTier.PERSISTENT, "", step=30)
    assert configmaps(catalog) == sorted([configmap_name(JOB, s) for s in (10, 20, 30)] + [configmap_name("team-b/llama", 40)]
                                         + [copies_configmap_name(JOB, node) for node in ("", "gpu-a")]), \
        "a ConfigMap per step for its rows, one per node for the copies it holds (the persistent tier's under no node)"


def test_shard_copies_are_forgotten_per_rank_tier_and_node(catalog: KubernetesCatalog) -> None:
    for c in (a_copy(0, CheckpointTier.MEMORY, "gpu-a"), a_copy(1, CheckpointTier.MEMORY, "gpu-a"),
              a_copy(0, CheckpointTier.REPLICA, "gpu-b")):
        catalog.put_shard_copy(c)
    catalog.delete_shard_copies(JOB, 10, tier=CheckpointTier.MEMORY, node="gpu-a", rank=0)
    assert [(c.rank, c.tier, c.node) for c in catalog.list_shard_copies(JOB)] == [
        (0, CheckpointTier.REPLICA, "gpu-b"), (1, CheckpointTier.MEMORY, "gpu-a")]
    catalog.delete_shard_copies(JOB, 10)
    catalog.delete_shard_copies(JOB, 99)  # no such step: nothing to do, no error
    assert catalog.list_shard_copies(JOB) == [] and configmaps(catalog) == []


def test_racing_agents_never_lose_a_copy_and_exactly_one_opens_the_step(kubeconfig: Path, namespace: str) -> None:
    """Eight writers, each with its own client, add their copies and all try to open the same step at once."""
    opened: list[int] = []
    clients = [KubernetesCatalog(api_client(kubeconfig), namespace) for _ in range(8)]  # made before the race starts

    def agent(rank: int) -> None:
        mine = clients[rank]
        mine.put_shard_copy(a_copy(rank, CheckpointTier.MEMORY, f"gpu-{rank}"))
        if mine.put_checkpoint_step(a_step(message=f"rank {rank}"), only_if_absent=True):
            opened.append(rank)

    errors = race(8, agent)
    assert not errors, errors
    catalog = KubernetesCatalog(api_client(kubeconfig), namespace)
    assert sorted(c.rank for c in catalog.list_shard_copies(JOB)) == list(range(8))
    assert len(opened) == 1, opened
    assert [s.message for s in catalog.list_checkpoint_steps(JOB)] == [f"rank {opened[0]}"]


def test_shard_servers_are_node_annotations(catalog: KubernetesCatalog) -> None:
    for node in ("cat-a", "cat-b"):
        catalog.core.create_node({"metadata": {"name": node}})
    catalog.set_shard_server("cat-a", "127.0.0.1:4000")
    catalog.set_shard_server("cat-a", "127.0.0.1:4001")
    catalog.set_shard_server("cat-b", "127.0.0.1:5000")
    servers = catalog.shard_servers()
    assert {n: servers[n] for n in ("cat-a", "cat-b")} == {"cat-a": "127.0.0.1:4001", "cat-b": "127.0.0.1:5000"}
    assert kubernetes.client.CoreV1Api(catalog.core.api_client).read_node("cat-a").metadata.annotations[names.SHARD_SERVER] == "127.0.0.1:4001"


def test_a_pass_reads_one_list_yet_sees_its_own_writes_at_once_and_other_agents_within_the_reuse_window(
        kubeconfig: Path, namespace: str) -> None:
    from unbroken.kubernetes.backend.catalog import LIST_REUSE_SECONDS
    from unbroken.plumbing.waiting import wait_until

    mine = KubernetesCatalog(api_client(kubeconfig), namespace)
    theirs = KubernetesCatalog(api_client(kubeconfig), namespace)
    assert mine.list_checkpoint_steps(JOB) == []
    mine.put_checkpoint_step(a_step(10))
    assert [s.step for s in mine.list_checkpoint_steps(JOB)] == [10], "its own write: no stale list"
    theirs.put_checkpoint_step(a_step(20))
    wait_until(lambda: [s.step for s in mine.list_checkpoint_steps(JOB)] == [20, 10], LIST_REUSE_SECONDS + 5,
               "another agent's write to show")


def test_a_nodes_copy_changes_of_a_pass_are_one_write_whatever_its_ranks(k8s: ControlPlane, catalog: KubernetesCatalog) -> None:
    """Eight ranks on one node: the copies of the new step recorded and the retired step's forgotten together."""
    catalog.update_shard_copies(JOB, put=[a_copy(rank, CheckpointTier.MEMORY, "gpu-a", step=10) for rank in range(8)])
    before = k8s.requests_answered(CONFIGMAP_WRITES, "configmaps")
    catalog.update_shard_copies(
        JOB, put=[a_copy(rank, CheckpointTier.MEMORY, "gpu-a", step=20) for rank in range(8)]
        + [a_copy(rank, CheckpointTier.REPLICA, "gpu-a", step=20) for rank in range(8, 16)],
        forget=[CopyKey(10, CheckpointTier.MEMORY, "gpu-a", rank) for rank in range(8)])
    assert k8s.requests_answered(CONFIGMAP_WRITES, "configmaps") - before == 1
    assert sorted((c.step, c.tier, c.rank) for c in catalog.list_shard_copies(JOB)) == sorted(
        [(20, CheckpointTier.MEMORY, rank) for rank in range(8)] + [(20, CheckpointTier.REPLICA, rank) for rank in range(8, 16)])


def test_a_step_configmap_of_the_layout_before_is_deleted_with_its_last_row(catalog: KubernetesCatalog) -> None:
    """Before, copies were keys of the step's ConfigMap: left there after an upgrade, they never keep it alive."""
    catalog.put_checkpoint_step(a_step(10))
    catalog.core.patch_namespaced_config_map(configmap_name(JOB, 10), catalog.namespace,
                                             {"data": {"copy.memory.0.gpu-a": '{"left": "over"}'}})
    assert catalog.list_shard_copies(JOB) == [], "keys of the old layout are not copies"
    catalog.delete_checkpoint_step(JOB, 10, CheckpointTier.MEMORY)
    assert configmaps(catalog) == []


def test_retiring_a_steps_last_row_is_one_write_and_a_row_beside_another_tiers_keeps_its_configmap(
        k8s: ControlPlane, catalog: KubernetesCatalog) -> None:
    """Every save retires a step: its memory row, the ConfigMap's only key, goes with the ConfigMap in one delete."""
    catalog.put_checkpoint_step(a_step(10, status=StepStatus.COMMITTED, committed_at=2.0))
    catalog.put_checkpoint_step(a_step(20, status=StepStatus.COMMITTED, committed_at=2.0))
    catalog.put_checkpoint_step(a_step(20, CheckpointTier.PERSISTENT))
    before = k8s.requests_answered(CONFIGMAP_WRITES, "configmaps")
    catalog.delete_checkpoint_step(JOB, 10, CheckpointTier.MEMORY)
    assert k8s.requests_answered(CONFIGMAP_WRITES, "configmaps") - before == 1
    assert configmaps(catalog) == [configmap_name(JOB, 20)]
    catalog.delete_checkpoint_step(JOB, 20, CheckpointTier.MEMORY)
    assert [(s.step, s.tier) for s in catalog.list_checkpoint_steps(JOB)] == [(20, CheckpointTier.PERSISTENT)], \
        "the persistent row stays"
    before = k8s.requests_answered(CONFIGMAP_WRITES, "configmaps")
    catalog.delete_checkpoint_step(JOB, 10, CheckpointTier.MEMORY)
    assert k8s.requests_answered(CONFIGMAP_WRITES, "configmaps") == before, "a step retired already: a read, no write"


def test_a_following_catalog_reads_from_its_watch_its_own_writes_at_once_and_others_as_they_land(
        k8s: ControlPlane, kubeconfig: Path, namespace: str) -> None:
    from unbroken.plumbing.waiting import wait_until

    mine = KubernetesCatalog(api_client(kubeconfig), namespace)
    theirs = KubernetesCatalog(api_client(kubeconfig), namespace)
    cache = mine.follow()
    try:
        wait_until(lambda: cache.synced, 20, "the catalog's watch to list")
        lists = k8s.requests_answered({"LIST"}, "configmaps")
        mine.put_checkpoint_step(a_step(10))
        assert [s.step for s in mine.list_checkpoint_steps(JOB)] == [10], "its own write: read back at once"
        theirs.update_shard_copies(JOB, put=[a_copy(0, CheckpointTier.MEMORY, "gpu-b")])
        wait_until(lambda: [(c.rank, c.node) for c in mine.list_shard_copies(JOB)] == [(0, "gpu-b")], 10,
                   "another agent's write to arrive by watch")
        mine.delete_checkpoint_step(JOB, 10, CheckpointTier.MEMORY)
        assert mine.list_checkpoint_steps(JOB) == [], "its own delete: gone at once"
        for _ in range(20):
            mine.list_checkpoint_steps(JOB)
            mine.list_shard_copies(JOB)
        assert k8s.requests_answered({"LIST"}, "configmaps") == lists, "a following catalog never lists"
    finally:
        mine.stop_following()
