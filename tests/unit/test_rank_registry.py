"""The rank registry: how a rank forked from a warm spare says who it is (real files)."""

from __future__ import annotations

from pathlib import Path

from unbroken.rank.registry import RankIdentity, exit_code, identify, record_exit, register


def test_the_environment_wins_and_the_registry_answers_when_it_is_silent(tmp_path: Path) -> None:
    registry = tmp_path / "ranks"
    register(registry, 4242, RankIdentity(rank=3, local_rank=1))
    assert identify(4242, {}, registry) == RankIdentity(3, 1)
    assert identify(4242, {"RANK": "2", "LOCAL_RANK": "0"}, registry) == RankIdentity(2, 0), "a cold rank's own word"
    assert identify(4243, {}, registry) is None, "not registered: the forkserver, a data loader worker"
    assert identify(4242, {}, None) is None, "a cold worker has no registry"
    assert identify(1, {"RANK": "x", "LOCAL_RANK": "0"}, None) is None
    assert [p.name for p in registry.iterdir()] == ["4242.json"], "no temporary file is left"


def test_a_rank_that_ends_on_its_own_leaves_its_code_and_a_killed_one_leaves_none(tmp_path: Path) -> None:
    registry = tmp_path / "ranks"
    register(registry, 10, RankIdentity(0, 0))
    register(registry, 11, RankIdentity(1, 1))
    record_exit(registry, 10, 3)
    assert exit_code(registry, 10) == 3
    assert exit_code(registry, 11) is None


def test_a_damaged_entry_is_no_identity_not_an_error(tmp_path: Path) -> None:
    registry = tmp_path / "ranks"
    registry.mkdir()
    (registry / "7.json").write_text("{not json")
    (registry / "8.json").write_text('{"rank": 1}')
    (registry / "9.exit").write_text("")
    assert identify(7, {}, registry) is None
    assert identify(8, {}, registry) is None
    assert exit_code(registry, 9) is None


def test_a_rank_of_an_in_process_job_is_known_by_its_registration_not_its_node_local_environment(tmp_path):
    from unbroken.rank import env as launch_env, registry as rank_registry

    assert rank_registry.IN_PROCESS_REGISTRY == launch_env.REJOIN_DIR, "the rank registers where its environment points"
    environ = {"RANK": "0", "LOCAL_RANK": "0", launch_env.REJOIN_DIR: str(tmp_path)}
    assert rank_registry.identify(4242, environ, None) == rank_registry.RankIdentity(0, 0), "not registered yet: torchrun's"
    rank_registry.register(tmp_path, 4242, rank_registry.RankIdentity(3, 0))
    assert rank_registry.identify(4242, environ, None) == rank_registry.RankIdentity(3, 0)
