"""Cluster and job file loading: valid files, defaults, and one-line errors that say what to fix.

Pure tests: no processes, no store. Every error test checks that the message names
the file and the dotted field and is a single line, as the CLI prints it verbatim.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from unbroken.config.cluster import ClusterConfig, DeepHealthCheck, NodeRecovery
from unbroken.config.job import JobSpec, RestartPolicy, load_job
from unbroken.config.loading import load_model
from unbroken.errors import ConfigError, UnbrokenError
from unbroken.state.phases import JobPhase
from unbroken.state.records import Job

MINIMAL_CLUSTER = """\
ClusterName: dev
InstanceGroups:
  - InstanceGroupName: workers
    InstanceCount: 2
"""


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def job_dir(tmp_path: Path, script: str = "train.py") -> Path:
    """A folder holding an (empty) entry script, as a job's folder would."""
    folder = tmp_path / "jobs"
    write(folder / script, "print('hi')\n")
    return folder


def config_error(load: Callable[[], Any], path: Path) -> str:
    """Run ``load``, require a ConfigError whose one-line message starts with the file; return the message."""
    with pytest.raises(ConfigError) as info:
        load()
    message = str(info.value)
    assert "\n" not in message and "\r" not in message, f"message is not one line: {message!r}"
    assert message.startswith(f"{path}: "), f"message does not name the file first: {message!r}"
    return message


def cluster_error(path: Path) -> str:
    return config_error(lambda: load_model(path, ClusterConfig), path)


def job_error(path: Path, overrides: dict[str, Any] | None = None) -> str:
    return config_error(lambda: load_job(path, overrides=overrides), path)


# -- valid cluster files -------------------------------------------------------------


def test_cluster_yaml_loads_with_defaults(tmp_path: Path) -> None:
    config = load_model(write(tmp_path / "cluster.yaml", MINIMAL_CLUSTER), ClusterConfig)

    assert config.ClusterName == "dev"
    assert config.NodeRecovery is NodeRecovery.AUTOMATIC
    [group] = config.InstanceGroups
    assert (group.InstanceGroupName, group.InstanceType, group.InstanceCount) == ("workers", "cpu-dev", 2)
    assert group.OnStartDeepHealthChecks == []
    assert (config.Local.HeartbeatIntervalSeconds, config.Local.NodeLostAfterSeconds, config.Local.RebootTimeoutSeconds) == (1.0, 4.0, 60.0)
    assert config.group("workers") is group


def test_cluster_json_in_hyperpod_shape_loads(tmp_path: Path) -> None:
    data = {
        "ClusterName": "hp-cluster",
        "InstanceGroups": [
            {"InstanceGroupName": "gpu", "InstanceType": "ml.p5.48xlarge", "InstanceCount": 4,
             "OnStartDeepHealthChecks": ["InstanceStress", "InstanceConnectivity"]},
            {"InstanceGroupName": "cpu", "InstanceCount": 1},
        ],
        "NodeRecovery": "None",
        "Local": {"HeartbeatIntervalSeconds": 1, "NodeLostAfterSeconds": 2, "RebootTimeoutSeconds": 5},
    }
    config = load_model(write(tmp_path / "cluster.json", json.dumps(data)), ClusterConfig)

    assert config.NodeRecovery is NodeRecovery.NONE
    assert [g.InstanceGroupName for g in config.InstanceGroups] == ["gpu", "cpu"]
    assert config.group("gpu").OnStartDeepHealthChecks == [DeepHealthCheck.INSTANCE_STRESS, DeepHealthCheck.INSTANCE_CONNECTIVITY]
    assert config.group("gpu").InstanceType == "ml.p5.48xlarge"
    # exactly twice the heartbeat is allowed (the boundary of the rule)
    assert (config.Local.HeartbeatIntervalSeconds, config.Local.NodeLostAfterSeconds) == (1.0, 2.0)


def test_with_nodes_builds_one_cpu_group_with_automatic_recovery() -> None:
    config = ClusterConfig.with_nodes(3)

    assert config.ClusterName == "local"
    assert config.NodeRecovery is NodeRecovery.AUTOMATIC
    [group] = config.InstanceGroups
    assert (group.InstanceGroupName, group.InstanceType, group.InstanceCount) == ("workers", "cpu-dev", 3)
    # what 'cluster up --nodes' stores must load back unchanged
    assert ClusterConfig.model_validate_json(config.model_dump_json()) == config


# -- valid job files -----------------------------------------------------------------


def test_job_yaml_loads_with_defaults(tmp_path: Path) -> None:
    folder = job_dir(tmp_path)
    spec = load_job(write(folder / "job.yaml", "name: mlp\ncommand: [train.py]\n"))

    assert spec.name == "mlp"
    assert (spec.nodes, spec.procs_per_node, spec.world_size) == (1, 1, 1)
    assert spec.command == [str((folder / "train.py").resolve())]
    assert spec.env == {}
    assert spec.working_dir == folder.resolve()
    res = spec.resilience
    assert (res.auto_resume, res.max_retry, res.restart_policy) == (False, 3, RestartPolicy.ON_FAILURE)
    assert (res.hang_timeout, res.startup_timeout, res.require_deep_health_passed) == (None, None, True)  # None: from what the job shows
    assert (spec.checkpoint.dir, spec.checkpoint.keep) == (None, 2)


def test_job_json_loads_and_stringifies_args_and_env(tmp_path: Path) -> None:
    folder = job_dir(tmp_path)
    data = {
        "name": "big-run", "nodes": 2, "procs_per_node": 4,
        "command": ["train.py", "--steps", 100, "--lr", 0.5],
        "env": {"OMP_NUM_THREADS": 1, "DEBUG": True, "NAME": "x"},
        "resilience": {"auto_resume": True, "max_retry": 0, "restart_policy": "ExitCode", "hang_timeout": 30},
        "checkpoint": {"keep": 5},
    }
    spec = load_job(write(folder / "job.json", json.dumps(data)))

    assert spec.world_size == 8
    assert spec.command[1:] == ["--steps", "100", "--lr", "0.5"]
    assert spec.env == {"OMP_NUM_THREADS": "1", "DEBUG": "True", "NAME": "x"}
    assert spec.resilience.restart_policy is RestartPolicy.EXIT_CODE
    assert (spec.resilience.auto_resume, spec.resilience.max_retry, spec.resilience.hang_timeout) == (True, 0, 30.0)
    assert spec.checkpoint.keep == 5


def test_command_string_is_shlex_split(tmp_path: Path) -> None:
    folder = job_dir(tmp_path)
    spec = load_job(write(folder / "job.yaml", "name: j\ncommand: \"train.py --msg 'hello world' --lr=0.1\"\n"))

    assert spec.command == [str((folder / "train.py").resolve()), "--msg", "hello world", "--lr=0.1"]


def test_entry_script_resolves_against_the_job_file_folder_not_the_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "project"
    write(folder / "scripts" / "train.py", "")
    write(tmp_path / "elsewhere" / "scripts" / "train.py", "")  # a decoy next to the cwd
    monkeypatch.chdir(tmp_path / "elsewhere")

    spec = load_job(write(folder / "job.yaml", "name: j\ncommand: scripts/train.py --x 1\n"))

    assert Path(spec.command[0]).is_absolute()
    assert spec.command == [str((folder / "scripts" / "train.py").resolve()), "--x", "1"]
    assert spec.working_dir == folder.resolve()


def test_entry_script_resolves_against_a_relative_working_dir(tmp_path: Path) -> None:
    folder = tmp_path / "project"
    write(folder / "code" / "train.py", "")
    spec = load_job(write(folder / "job.yaml", "name: j\nworking_dir: code\ncommand: train.py\n"))

    assert spec.working_dir == (folder / "code").resolve()
    assert spec.command == [str((folder / "code" / "train.py").resolve())]


def test_absolute_entry_script_is_kept(tmp_path: Path) -> None:
    script = write(tmp_path / "abs" / "train.py", "")
    spec = load_job(write(tmp_path / "jobs" / "job.yaml", f"name: j\ncommand: [{json.dumps(str(script))}, --a]\n"))

    assert spec.command == [str(script.resolve()), "--a"]


def test_missing_entry_script_names_it(tmp_path: Path) -> None:
    path = write(tmp_path / "job.yaml", "name: j\ncommand: nope.py --x\n")
    message = job_error(path)

    assert "'nope.py' not found" in message
    assert str(tmp_path / "nope.py") in message


def test_module_form_needs_no_file(tmp_path: Path) -> None:
    spec = load_job(write(tmp_path / "job.yaml", "name: j\ncommand: -m some.module.that_does_not_exist --steps 3\n"))

    assert spec.command == ["-m", "some.module.that_does_not_exist", "--steps", "3"]


def test_an_entry_script_flag_replaces_the_script_or_module_and_keeps_the_arguments(tmp_path: Path) -> None:
    """HyperPod's --entry-script: the job file's settings, another script of the same code."""
    other = write(tmp_path / "eval.py", "")
    module_job = write(tmp_path / "job.yaml", "name: j\ncommand: -m pkg.train --steps 3\n")
    assert load_job(module_job, entry_script="eval.py").command == [str(other.resolve()), "--steps", "3"]
    script_job = write(tmp_path / "script.yaml", "name: j\ncommand: [train.py, --lr, 0.1]\n")
    assert load_job(script_job, entry_script="/opt/app/eval.py", in_image=True).command == ["/opt/app/eval.py", "--lr", "0.1"]
    assert "'missing.py' not found" in config_error(lambda: load_job(module_job, entry_script="missing.py"), module_job)


def test_module_form_without_a_module_is_an_error(tmp_path: Path) -> None:
    message = job_error(write(tmp_path / "job.yaml", "name: j\ncommand: [-m]\n"))

    assert "'-m' must be followed by a module name" in message


def test_relative_checkpoint_dir_resolves_against_the_job_file_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "jobs"
    monkeypatch.chdir(tmp_path)
    spec = load_job(write(folder / "job.yaml", "name: j\ncommand: -m m\ncheckpoint: {dir: ckpt/run1}\n"))
    assert spec.checkpoint.dir == (folder / "ckpt" / "run1").resolve()

    absolute = tmp_path / "abs-ckpt"
    spec = load_job(write(folder / "job2.yaml", f"name: j\ncommand: -m m\ncheckpoint: {{dir: {json.dumps(str(absolute))}}}\n"))
    assert spec.checkpoint.dir == absolute


# -- overrides -----------------------------------------------------------------------


def test_overrides_are_applied(tmp_path: Path) -> None:
    path = write(tmp_path / "job.yaml", "name: original\ncommand: -m m\nresilience: {max_retry: 7}\n")
    spec = load_job(path, overrides={"resilience.auto_resume": True, "name": "x"})

    assert spec.name == "x"
    assert spec.resilience.auto_resume is True
    assert spec.resilience.max_retry == 7  # untouched siblings survive
    assert load_job(path).name == "original"  # the file itself is not changed


def test_overrides_create_a_missing_section(tmp_path: Path) -> None:
    spec = load_job(write(tmp_path / "job.yaml", "name: j\ncommand: -m m\n"), overrides={"resilience.max_retry": 0})

    assert spec.resilience.max_retry == 0
    assert spec.resilience.auto_resume is False


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"resilience.max_retry": -1}, "resilience.max_retry: -1 is invalid"),
        ({"name": "Bad_Name"}, "name: 'Bad_Name' is invalid"),
    ],
)
def test_overrides_are_validated(tmp_path: Path, overrides: dict[str, Any], expected: str) -> None:
    message = job_error(write(tmp_path / "job.yaml", "name: j\ncommand: -m m\n"), overrides)

    assert expected in message


# -- unknown fields ------------------------------------------------------------------


def test_typo_in_nested_job_field_suggests_the_right_name(tmp_path: Path) -> None:
    path = write(tmp_path / "job.yaml", "name: j\ncommand: -m m\nresilience:\n  max_retyr: 2\n")
    message = job_error(path)

    assert "resilience.max_retyr: unknown field" in message
    assert "did you mean 'max_retry'?" in message


@pytest.mark.parametrize(
    ("extra", "field", "suggestion"),
    [
        ("  - InstanceGroupName: w\n    InstanceCont: 2\n", "InstanceGroups.0.InstanceCont", "InstanceCount"),
        ("  - InstanceGroupName: w\n    InstanceCount: 1\nLocal:\n  HeartbeatInterval: 1\n", "Local.HeartbeatInterval", "HeartbeatIntervalSeconds"),
        ("  - InstanceGroupName: w\n    InstanceCount: 1\nNodeRecover: None\n", "NodeRecover", "NodeRecovery"),
    ],
)
def test_typo_in_cluster_field_suggests_the_right_name(tmp_path: Path, extra: str, field: str, suggestion: str) -> None:
    message = cluster_error(write(tmp_path / "cluster.yaml", "ClusterName: c\nInstanceGroups:\n" + extra))

    assert f"{field}: unknown field; did you mean '{suggestion}'?" in message


def test_unknown_top_level_job_key_lists_valid_fields(tmp_path: Path) -> None:
    message = job_error(write(tmp_path / "job.yaml", "name: j\ncommand: -m m\nzzzz: 1\n"))

    assert "zzzz: unknown field" in message
    assert "did you mean" not in message
    assert "(valid: checkpoint, command, env, min_nodes, name, nodes, procs_per_node, resilience, working_dir)" in message


def test_unknown_top_level_cluster_key_lists_valid_fields(tmp_path: Path) -> None:
    message = cluster_error(write(tmp_path / "cluster.yaml", MINIMAL_CLUSTER + "Tags: [a]\n"))

    assert "Tags: unknown field (valid: ClusterName, Health, InstanceGroups, Kubernetes, Local, Metrics, NodeRecovery)" in message


# -- bad values ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "field", "value", "why"),
    [
        ("ClusterName: c\nInstanceGroups: [{InstanceGroupName: w, InstanceCount: -1}]\n",
         "InstanceGroups.0.InstanceCount", "-1", "greater than or equal to 0"),
        ("ClusterName: c\nInstanceGroups: [{InstanceGroupName: w, InstanceCount: 65}]\n",
         "InstanceGroups.0.InstanceCount", "65", "less than or equal to 64"),
        (MINIMAL_CLUSTER + "NodeRecovery: Sometimes\n", "NodeRecovery", "'Sometimes'", "'Automatic' or 'None'"),
        ("ClusterName: My_Cluster\nInstanceGroups: [{InstanceGroupName: w, InstanceCount: 1}]\n",
         "ClusterName", "'My_Cluster'", "[a-z0-9]"),
        ("ClusterName: c\nInstanceGroups: [{InstanceGroupName: Workers, InstanceCount: 1}]\n",
         "InstanceGroups.0.InstanceGroupName", "'Workers'", "should match pattern"),
        (MINIMAL_CLUSTER + "Local: {HeartbeatIntervalSeconds: 0.5}\n", "Local.HeartbeatIntervalSeconds", "0.5",
         "greater than or equal to 1"),
        ("ClusterName: c\nInstanceGroups: [{InstanceGroupName: w, InstanceCount: 1, OnStartDeepHealthChecks: [Quick]}]\n",
         "InstanceGroups.0.OnStartDeepHealthChecks.0", "'Quick'", "'InstanceStress' or 'InstanceConnectivity'"),
        ("ClusterName: c\nInstanceGroups: []\n", "InstanceGroups", "[]", "at least 1 item"),
    ],
)
def test_bad_cluster_value_names_field_value_and_reason(tmp_path: Path, text: str, field: str, value: str, why: str) -> None:
    message = cluster_error(write(tmp_path / "cluster.yaml", text))

    assert f"{field}: {value} is invalid: " in message
    assert why in message


@pytest.mark.parametrize(
    ("body", "field", "value", "why"),
    [
        ("resilience: {max_retry: -1}", "resilience.max_retry", "-1", "greater than or equal to 0"),
        ("resilience: {restart_policy: Always}", "resilience.restart_policy", "'Always'", "'OnFailure', 'ExitCode' or 'Never'"),
        ("resilience: {auto_resume: perhaps}", "resilience.auto_resume", "'perhaps'", "valid boolean"),
        ("nodes: 0", "nodes", "0", "greater than or equal to 1"),
        ("checkpoint: {keep: 0}", "checkpoint.keep", "0", "greater than or equal to 1"),
        ("env: {A: [1, 2]}", "env.A", "[1, 2]", "valid string"),
    ],
)
def test_bad_job_value_names_field_value_and_reason(tmp_path: Path, body: str, field: str, value: str, why: str) -> None:
    message = job_error(write(tmp_path / "job.yaml", f"name: j\ncommand: -m m\n{body}\n"))

    assert f"{field}: {value} is invalid: " in message
    assert why in message


@pytest.mark.parametrize("name", ["MyJob", "my_job", "-job", "job-", "a" * 64])
def test_job_name_must_be_a_dns_label(tmp_path: Path, name: str) -> None:
    message = job_error(write(tmp_path / "job.yaml", f"name: {name}\ncommand: -m m\n"))

    assert f"name: {repr(name)[:40]}" in message  # long values are shortened with '...'
    assert " is invalid: String should match pattern '^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$'" in message


@pytest.mark.parametrize("name", ["a", "my-job-2", "a" * 63])
def test_valid_job_names_load(tmp_path: Path, name: str) -> None:
    assert load_job(write(tmp_path / "job.yaml", f"name: {name}\ncommand: -m m\n")).name == name


def test_duplicate_instance_group_names_are_rejected(tmp_path: Path) -> None:
    text = ("ClusterName: c\nInstanceGroups:\n"
            "  - {InstanceGroupName: workers, InstanceCount: 1}\n"
            "  - {InstanceGroupName: other, InstanceCount: 1}\n"
            "  - {InstanceGroupName: workers, InstanceCount: 2}\n")
    message = cluster_error(write(tmp_path / "cluster.yaml", text))

    assert "InstanceGroups: " in message
    assert "InstanceGroupName must be unique, repeated: workers" in message


def test_node_lost_timeout_must_cover_two_heartbeats(tmp_path: Path) -> None:
    text = MINIMAL_CLUSTER + "Local: {HeartbeatIntervalSeconds: 1, NodeLostAfterSeconds: 1.5}\n"
    message = cluster_error(write(tmp_path / "cluster.yaml", text))

    assert message.split(": ", 1)[1].startswith("Local: ")
    assert "NodeLostAfterSeconds (1.5) must be at least twice HeartbeatIntervalSeconds (1.0)" in message


def test_several_problems_are_all_reported_on_one_line(tmp_path: Path) -> None:
    text = "ClusterName: c\nInstanceGroups: [{InstanceGroupName: w, InstanceCount: -1}]\nNodeRecovery: Sometimes\nColour: red\n"
    message = cluster_error(write(tmp_path / "cluster.yaml", text))

    assert "InstanceGroups.0.InstanceCount: -1 is invalid" in message
    assert "NodeRecovery: 'Sometimes' is invalid" in message
    assert "Colour: unknown field" in message
    assert message.count("; ") >= 2


# -- missing fields and unreadable files ---------------------------------------------


def test_missing_required_job_field(tmp_path: Path) -> None:
    message = job_error(write(tmp_path / "job.yaml", "name: j\n"))

    assert "command: required field is missing" in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("ClusterName: c\n", "InstanceGroups: required field is missing"),
        ("InstanceGroups: [{InstanceGroupName: w, InstanceCount: 1}]\n", "ClusterName: required field is missing"),
        ("ClusterName: c\nInstanceGroups: [{InstanceGroupName: w}]\n", "InstanceGroups.0.InstanceCount: required field is missing"),
    ],
)
def test_missing_required_cluster_field(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in cluster_error(write(tmp_path / "cluster.yaml", text))


def test_file_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "cluster.yaml"
    assert cluster_error(missing) == f"{missing}: file not found"
    missing_job = tmp_path / "job.yaml"
    assert job_error(missing_job) == f"{missing_job}: file not found"


def test_directory_instead_of_file(tmp_path: Path) -> None:
    folder = tmp_path / "job.yaml"
    folder.mkdir()
    assert "cannot read" in job_error(folder)


def test_invalid_yaml(tmp_path: Path) -> None:
    path = write(tmp_path / "cluster.yaml", "ClusterName: c\nInstanceGroups: [unclosed\n  - x: : :\n")
    message = cluster_error(path)

    assert message.startswith(f"{path}: not valid YAML: ")


def test_invalid_json(tmp_path: Path) -> None:
    path = write(tmp_path / "job.json", '{"name": "j", "command": ["-m", "m"],}')
    message = job_error(path)

    assert message.startswith(f"{path}: not valid JSON: ")


def test_binary_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_bytes(b"\xff\xfe\x00\x80garbage")

    assert "not UTF-8" in cluster_error(path)


@pytest.mark.parametrize(
    ("text", "kind"),
    [("- a\n- b\n", "list"), ("just a string\n", "str"), ("", "NoneType"), ("42\n", "int")],
)
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str, kind: str) -> None:
    path = write(tmp_path / "job.yaml", text)
    message = job_error(path)

    assert message == f"{path}: expected a mapping of fields at the top level, got {kind}"


def test_json_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    path = write(tmp_path / "cluster.json", "[1, 2]")

    assert cluster_error(path).endswith("got list")


# -- the error type itself -----------------------------------------------------------


def test_config_error_exits_2_and_is_an_unbroken_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_job(tmp_path / "missing.yaml")

    assert info.value.exit_code == 2
    assert isinstance(info.value, UnbrokenError)
    assert info.value.__cause__ is None and info.value.__suppress_context__  # raised 'from None': no chained traceback


def test_long_values_are_shortened_but_still_one_line(tmp_path: Path) -> None:
    long_value = "x" * 500
    message = job_error(write(tmp_path / "job.yaml", f"name: j\ncommand: -m m\nnodes: {long_value}\n"))

    assert "nodes: 'xxxx" in message
    assert long_value not in message
    assert "..." in message


def test_multi_line_value_is_shown_on_one_line(tmp_path: Path) -> None:
    message = job_error(write(tmp_path / "job.yaml", 'name: "a\\nb"\ncommand: -m m\n'))

    assert "name: 'a\\nb' is invalid" in message


# -- the spec stored for a job -------------------------------------------------------


def test_spec_round_trips_through_json_even_after_the_script_is_gone(tmp_path: Path) -> None:
    folder = job_dir(tmp_path)
    text = ("name: rt\nnodes: 2\nprocs_per_node: 3\ncommand: train.py --steps 5\nenv: {A: 1}\nworking_dir: .\n"
            "resilience: {auto_resume: true, max_retry: 4, restart_policy: Never, hang_timeout: 12.5}\n"
            "checkpoint: {dir: ckpt, keep: 3}\n")
    spec = load_job(write(folder / "job.yaml", text))
    (folder / "train.py").unlink()

    stored = spec.model_dump_json()
    assert JobSpec.model_validate_json(stored, context={"trusted": True}) == spec
    job = Job(name=spec.name, spec_json=stored, phase=JobPhase.PENDING)
    assert job.spec() == spec
    assert job.spec().checkpoint.dir == (folder / "ckpt").resolve()
    # without the trusted context the spec would be re-checked and the deleted script found missing
    with pytest.raises(ValidationError, match="not found"):
        JobSpec.model_validate_json(stored, context={"base_dir": str(folder)})


def test_loaded_spec_is_frozen(tmp_path: Path) -> None:
    spec = load_job(write(tmp_path / "job.yaml", "name: j\ncommand: -m m\n"))

    with pytest.raises(ValidationError):
        spec.name = "other"  # type: ignore[misc]


def test_missing_working_dir_is_a_config_error_naming_it(tmp_path: Path) -> None:
    job_file = write(tmp_path / "job.yaml", "name: a\ncommand: [-m, mod]\nworking_dir: nowhere\n")
    with pytest.raises(ConfigError) as err:
        load_job(job_file)
    message = str(err.value)
    assert str(job_file) in message and "working_dir" in message and "nowhere" in message and "\n" not in message
