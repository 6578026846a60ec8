"""The real CLI as a subprocess: user errors end as one ``error:`` line, change nothing,
and the command surface stays what the docs promise.

No cluster processes are started here: commands that need a store get one made
directly with ``runtime.create_local`` (the state, no processes). Every call names its cluster directory
explicitly so nothing ever lands in the current directory.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from helpers import run_cli

from unbroken.config.cluster import ClusterConfig
from unbroken.errors import ConfigError, ConflictError, NotFoundError, StoreError, UsageError
from unbroken.plumbing.layout import ClusterLayout
from unbroken.runtime import create_local
from unbroken.state.store import ClusterStore

NAME_PATTERN_TEXT = "'^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$'"


def one_line_error(result: subprocess.CompletedProcess[str], exit_code: int) -> str:
    """Assert the command failed with ``exit_code`` and exactly one ``error:`` line; return that line."""
    everything = result.stdout + result.stderr
    assert "Traceback" not in everything, everything
    assert result.returncode == exit_code, f"exit {result.returncode}, wanted {exit_code}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    lines = result.stderr.splitlines()
    assert len(lines) == 1, f"stderr is not one line:\n{result.stderr}"
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


def make_store(root: Path) -> ClusterStore:
    """A cluster directory with a store and a 1-node cluster config, but no processes."""
    return create_local(ClusterLayout.at(root), ClusterConfig.with_nodes(1)).cluster


def snapshot(store: ClusterStore) -> tuple[list, list]:
    return store.list_jobs(), store.list_events()


def unwritable_dir(tmp_path: Path) -> Path:
    """A --dir below a regular file: if a command wrongly went on to start a cluster, it could not."""
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    return blocker / "cluster"


# -- cluster up ----------------------------------------------------------------------


def test_cluster_up_with_a_bad_file_is_one_line_and_creates_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "cluster.yaml"
    bad.write_text("ClusterName: dev\nInstanceGroups:\n  - InstanceGroupName: workers\n    InstanceCount: -1\n"
                   "NodeRecovery: Sometimes\n")
    target = tmp_path / "D"

    line = one_line_error(run_cli("cluster", "up", "-f", str(bad), "--dir", str(target), check=False), ConfigError.exit_code)

    assert line.startswith(f"error: {bad}: ")
    assert "InstanceGroups.0.InstanceCount: -1 is invalid" in line
    assert "NodeRecovery: 'Sometimes' is invalid" in line
    assert not (target / "state.db").exists()
    assert not target.exists()


def test_cluster_up_error_text_keeps_square_brackets(tmp_path: Path) -> None:
    """Values and pydantic's patterns contain '[...]': printed as text, not eaten (or crashed on) as rich markup."""
    bad = tmp_path / "cluster.yaml"
    bad.write_text('ClusterName: "[/bold]Dev"\nInstanceGroups: [{InstanceGroupName: workers, InstanceCount: 1}]\n')

    line = one_line_error(run_cli("cluster", "up", "-f", str(bad), "--dir", str(tmp_path / "D"), check=False), ConfigError.exit_code)

    assert f"ClusterName: '[/bold]Dev' is invalid: String should match pattern {NAME_PATTERN_TEXT}" in line


@pytest.mark.parametrize("args", [(), ("--nodes", "2", "-f", "FILE")], ids=["neither", "both"])
def test_cluster_up_needs_exactly_one_of_file_and_nodes(tmp_path: Path, args: tuple[str, ...]) -> None:
    good = tmp_path / "cluster.yaml"
    good.write_text("ClusterName: dev\nInstanceGroups: [{InstanceGroupName: workers, InstanceCount: 1}]\n")
    target = unwritable_dir(tmp_path)
    args = tuple(str(good) if a == "FILE" else a for a in args)

    line = one_line_error(run_cli("cluster", "up", *args, "--dir", str(target), check=False), UsageError.exit_code)

    assert "exactly one of --file/-f" in line and "--nodes" in line


# -- job start -----------------------------------------------------------------------


def test_job_start_with_a_bad_file_changes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "cluster"
    store = make_store(root)
    store.add_event("Cluster", "local", "Marker", "present before the bad submit")
    before = snapshot(store)
    bad = tmp_path / "job.yaml"
    bad.write_text("name: My_Job\ncommand: -m unbroken.workloads.mlp\nresilience:\n  max_retyr: 2\n")

    result = run_cli("job", "start", "-f", str(bad), cluster_dir=root, check=False)
    line = one_line_error(result, ConfigError.exit_code)

    assert line.startswith(f"error: {bad}: ")
    assert f"name: 'My_Job' is invalid: String should match pattern {NAME_PATTERN_TEXT}" in line
    assert "resilience.max_retyr: unknown field; did you mean 'max_retry'?" in line
    assert result.stdout == ""
    assert snapshot(store) == before


def test_job_start_with_a_missing_entry_script_changes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "cluster"
    store = make_store(root)
    before = snapshot(store)
    job_file = tmp_path / "jobs" / "job.yaml"
    job_file.parent.mkdir()
    job_file.write_text("name: j\ncommand: train.py --steps 3\n")

    line = one_line_error(run_cli("job", "start", "-f", str(job_file), "--dir", str(root), check=False), ConfigError.exit_code)

    assert "entry script 'train.py' not found" in line
    assert str(tmp_path / "jobs" / "train.py") in line
    assert snapshot(store) == before


def test_job_submitted_twice_keeps_the_first(tmp_path: Path) -> None:
    root = tmp_path / "cluster"
    store = make_store(root)
    job_file = tmp_path / "job.yaml"
    job_file.write_text("name: mlp\nnodes: 1\ncommand: -m unbroken.workloads.mlp --steps 5\n")

    first = run_cli("job", "start", "-f", str(job_file), cluster_dir=root)
    assert "job mlp submitted" in first.stdout
    after_first = snapshot(store)
    assert [j.name for j in after_first[0]] == ["mlp"]
    assert [e.reason for e in after_first[1]] == ["JobCreated"]

    # same name, different settings: refused, the first job and its events untouched
    second = run_cli("job", "start", "-f", str(job_file), "--max-retry", "9", "--auto-resume", cluster_dir=root, check=False)
    line = one_line_error(second, ConflictError.exit_code)

    assert "job mlp already exists" in line
    assert snapshot(store) == after_first
    assert store.get_job("mlp").spec().resilience.max_retry == 3


def test_job_start_against_no_cluster_points_to_cluster_up(tmp_path: Path) -> None:
    job_file = tmp_path / "job.yaml"
    job_file.write_text("name: mlp\ncommand: -m m\n")
    missing = tmp_path / "nonexistent"

    line = one_line_error(run_cli("job", "start", "-f", str(job_file), "--dir", str(missing), check=False), StoreError.exit_code)

    assert "'unbroken cluster up'" in line
    assert not missing.exists()


# -- reading commands ----------------------------------------------------------------


@pytest.mark.parametrize("group", ["job", "node"])
def test_list_without_a_cluster_points_to_cluster_up(tmp_path: Path, group: str) -> None:
    missing = tmp_path / "nonexistent"

    line = one_line_error(run_cli(group, "list", "--dir", str(missing), check=False), StoreError.exit_code)

    assert StoreError.exit_code != 0
    assert f"no cluster at {missing}" in line
    assert "'unbroken cluster up'" in line
    assert not missing.exists()


@pytest.mark.parametrize(
    ("args", "expected"),
    [(("job", "describe", "nosuchjob"), "error: job nosuchjob not found"),
     (("node", "describe", "node-99"), "error: node node-99 not found"),
     (("job", "cancel", "nosuchjob"), "error: job nosuchjob not found")],
)
def test_unknown_names_are_not_found(tmp_path: Path, args: tuple[str, ...], expected: str) -> None:
    root = tmp_path / "cluster"
    store = make_store(root)
    before = snapshot(store)

    line = one_line_error(run_cli(*args, cluster_dir=root, check=False), NotFoundError.exit_code)

    assert line == expected
    assert snapshot(store) == before


def test_json_listings_are_valid_json(tmp_path: Path) -> None:
    root = tmp_path / "cluster"
    make_store(root)
    job_file = tmp_path / "job.yaml"
    job_file.write_text("name: from-file\nnodes: 2\ncommand: -m unbroken.workloads.mlp\n")
    run_cli("job", "start", "-f", str(job_file), "--name", "renamed", "--max-retry", "1", cluster_dir=root)

    jobs = json.loads(run_cli("job", "list", "-o", "json", cluster_dir=root).stdout)
    nodes = json.loads(run_cli("node", "list", "-o", "json", cluster_dir=root).stdout)

    assert [(j["name"], j["phase"], j["restarts"], j["max_retry"], j["nodes"]) for j in jobs] == [("renamed", "Pending", 0, 1, [])]
    assert nodes == []


# -- the frozen command surface ------------------------------------------------------


def commands_in_help(text: str) -> list[str]:
    """Command names of a --help page's Commands section (rich boxes or plain click layout)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(r"^\s*(╭─+\s*)?Commands\b", line)), None)
    assert start is not None, f"no Commands section in:\n{text}"
    body = []
    for line in lines[start + 1:]:
        stripped = line.strip()
        if stripped.startswith(("╰", "╭")) or (not stripped and body):
            break
        inner = re.sub(r"^\s*│", "", line.rstrip().removesuffix("│").rstrip())
        if inner.strip():
            body.append(inner)
    indent = min(len(b) - len(b.lstrip()) for b in body)
    return [b.split()[0] for b in body if len(b) - len(b.lstrip()) == indent]


def test_top_level_help_lists_the_groups(tmp_path: Path) -> None:
    result = run_cli("--help", cluster_dir=tmp_path / "unused")

    assert result.returncode == 0
    names = commands_in_help(result.stdout)
    assert sorted(names) == ["agent", "chaos", "check", "ckpt", "cluster", "dashboard", "data", "demo", "job", "k8s", "node", "operator", "run", "validate"]


@pytest.mark.parametrize(
    ("group", "commands"),
    [
        ("cluster", ["up", "down", "status"]),
        ("job", ["start", "list", "describe", "logs", "cancel"]),
        ("node", ["list", "describe", "cordon", "uncordon", "reboot", "replace"]),
        ("chaos", ["kill-worker", "hang-worker", "kill-node", "kill-controller", "xid", "slow-link", "slow-node", "corrupt",
                   "corrupt-clear"]),
        ("check", ["list", "run", "collective"]),
        ("k8s", ["render", "start"]),
        ("data", ["prepare-text", "imagenet-val"]),
    ],
)
def test_group_help_lists_exactly_its_commands(tmp_path: Path, group: str, commands: list[str]) -> None:
    result = run_cli(group, "--help", cluster_dir=tmp_path / "unused")

    assert result.returncode == 0
    names = commands_in_help(result.stdout)
    assert len(names) == len(set(names)), names
    assert sorted(names) == sorted(commands)


def test_help_parser_handles_wrapped_descriptions() -> None:
    """The parser above must not take a wrapped description line for a command."""
    page = (
        "╭─ Options ─────────╮\n│ --help  Show this. │\n╰───────────────────╯\n"
        "╭─ Commands ────────────────────────────╮\n"
        "│ demo     3 nodes, a 2-node job with    │\n"
        "│          prints what recovery cost.    │\n"
        "│ cluster  Start, inspect and stop.      │\n"
        "╰───────────────────────────────────────╯\n"
    )
    plain = "Usage: x\n\nCommands:\n  up    Start it and\n        wrap.\n  down  Stop it.\n"

    assert commands_in_help(page) == ["demo", "cluster"]
    assert commands_in_help(plain) == ["up", "down"]


def test_cluster_up_with_no_nodes_at_all_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "cluster.yaml"
    empty.write_text("ClusterName: dev\nInstanceGroups:\n  - InstanceGroupName: workers\n    InstanceCount: 0\n")
    target = tmp_path / "D"
    line = one_line_error(run_cli("cluster", "up", "-f", str(empty), "--dir", str(target), check=False), ConfigError.exit_code)
    assert "a local cluster needs at least one node" in line
    assert not (target / "state.db").exists()


def test_operator_help_and_a_missing_kubeconfig(tmp_path: Path) -> None:
    helped = run_cli("operator", "--help", cluster_dir=tmp_path / "unused")
    assert helped.returncode == 0 and "--kubeconfig" in helped.stdout and "--namespace" in helped.stdout
    missing = run_cli("operator", "--kubeconfig", str(tmp_path / "nope"), cluster_dir=tmp_path / "unused", check=False)
    assert missing.returncode == 2
    assert f"kubeconfig {tmp_path / 'nope'} does not exist" in missing.stdout + missing.stderr
    assert "Traceback" not in missing.stdout + missing.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--workload", "llm"], "error: --workload llm needs --data DIR: token shards from unbroken data prepare-text"),
    (["--workload", "gpt"], "error: --workload 'gpt': one of mlp, llm"),
])
def test_validate_refuses_a_burn_in_it_cannot_run_before_touching_the_cluster(tmp_path: Path, args: list[str], message: str) -> None:
    result = run_cli("validate", *args, cluster_dir=tmp_path / "none", check=False)
    assert result.returncode == 2 and result.stderr.strip() == message
