"""The public surface is frozen: the Python API a training script uses and every CLI command
with its flags. Changing any of it must be deliberate, and must change this test."""

import dataclasses
import inspect
import subprocess
import sys

import typer.main

import unbroken
from unbroken.checkpoint.rank import dcp
from unbroken.cli.main import app

CLI = {
    # agent and operator hand their arguments to their own parsers (argparse: `unbroken operator --help`)
    "agent": [],
    "operator": [],
    "run": [],
    "chaos corrupt": ["--bit", "--dir", "--node", "--rank", "--step", "--target", "--transient", "--wait", "JOB"],
    "chaos corrupt-clear": ["--dir", "NODE"],
    "chaos hang-worker": ["--dir", "--node", "--rank", "JOB"],
    "chaos kill-controller": ["--dir"],
    "chaos kill-node": ["--dir", "NODE"],
    "chaos kill-worker": ["--dir", "--node", "--rank", "JOB"],
    "chaos slow-link": ["--clear", "--dir", "NODE", "RATE"],
    "chaos slow-node": ["--clear", "--dir", "--factor", "--period", "NODE"],
    "chaos xid": ["--dir", "--pci", "CODE", "NODE"],
    "check collective": ["--dir", "--iters/-n", "--maxbytes/-e", "--minbytes/-b", "--nodes", "--ops", "--output/-o", "--repeat",
                         "--stepfactor/-f", "--warmup_iters/-w"],
    "check list": ["--output/-o"],
    "check run": ["--dir", "--node/-n", "--output/-o", "--suite/-s"],
    "ckpt list": ["--dir", "--output/-o", "JOB"],
    "data imagenet-val": ["--output/-o", "--solutions", "VAL_DIR"],
    "data prepare-text": ["--out", "--output/-o", "--shard-tokens", "--tokenizer", "--vocab-size", "INPUTS"],
    "ckpt prune": ["--dir", "--dry-run", "--keep", "JOB"],
    "ckpt verify": ["--dir", "--output/-o", "--step", "JOB"],
    "cluster down": ["--dir"],
    "cluster status": ["--dir", "--output/-o", "--targets-file"],
    "cluster up": ["--dir", "--file/-f", "--gpu-metrics/--no-gpu-metrics", "--metrics-port", "--no-wait/--wait", "--nodes/-n", "--timeout"],
    "dashboard": ["--dir", "--host", "--port", "--token"],
    "demo": ["--dir", "--keep", "--steps"],
    "job cancel": ["--dir", "NAME"],
    "job describe": ["--dir", "--output/-o", "NAME"],
    "job list": ["--dir", "--output/-o"],
    "job logs": ["--attempt", "--dir", "--follow/-f", "--node", "--rank", "NAME"],
    "job start": ["--any-schedulable-node/--deep-health-check-passed-nodes-only", "--auto-resume/--no-auto-resume", "--checkpoint-claim",
                  "--dir", "--entry-script", "--file/-f", "--gpus-per-node", "--image", "--kind", "--label-selector", "--max-retry",
                  "--name", "--namespace/-n", "--node-count/--nodes", "--runtime", "--steps", "--tasks-per-node", "--wait"],
    "k8s render": ["--any-schedulable-node/--deep-health-check-passed-nodes-only", "--auto-resume/--no-auto-resume", "--checkpoint-claim",
                   "--entry-script", "--file/-f", "--gpus-per-node", "--image", "--kind", "--label-selector", "--max-retry", "--name",
                   "--namespace/-n", "--node-count", "--output/-o", "--runtime", "--spare-pods", "--tasks-per-node"],
    "k8s start": ["--any-schedulable-node/--deep-health-check-passed-nodes-only", "--auto-resume/--no-auto-resume", "--checkpoint-claim",
                  "--entry-script", "--file/-f", "--gpus-per-node", "--image", "--kind", "--label-selector", "--max-retry", "--name",
                  "--namespace/-n", "--node-count", "--runtime", "--spare-pods", "--tasks-per-node"],
    "node cordon": ["--dir", "NAME"],
    "node describe": ["--dir", "--output/-o", "NAME"],
    "node list": ["--all/-a", "--dir", "--output/-o"],
    "node reboot": ["--dir", "NAME"],
    "node replace": ["--dir", "NAME"],
    "node uncordon": ["--dir", "NAME"],
    "validate": ["--config", "--data", "--dir", "--output/-o", "--steps", "--timeout", "--workload"],
}


def _commands(command, prefix: str = "") -> dict[str, list[str]]:
    if hasattr(command, "commands"):
        found: dict[str, list[str]] = {}
        for name, sub in command.commands.items():
            found.update(_commands(sub, f"{prefix} {name}".strip()))
        return found
    flags = ["/".join(sorted([*p.opts, *p.secondary_opts])) if p.param_type_name == "option" else p.name.upper()
             for p in command.params]
    return {prefix: sorted(flags)}


def test_every_cli_command_and_its_flags():
    assert _commands(typer.main.get_command(app)) == CLI


def test_the_root_options_choose_the_cluster():
    root = typer.main.get_command(app)
    assert sorted(p.opts[0] for p in root.params) == ["--context", "--kubeconfig", "--unbroken-namespace"]


def test_top_level_names():
    assert sorted(unbroken.__all__) == ["Context", "__version__", "init"]
    assert callable(unbroken.init)


def test_the_context_a_training_script_gets():
    fields = {f.name for f in dataclasses.fields(unbroken.Context) if not f.name.startswith("_")}
    assert fields == {"rank", "world_size", "local_rank", "job", "node", "attempt", "checkpoint"}
    methods = {name for name, _ in inspect.getmembers(unbroken.Context) if not name.startswith("_")}
    assert methods == {"progress", "is_main", "run", "keep_live", "section", "finished", "watch_replicas", "agreed_step"}
    assert list(inspect.signature(unbroken.init).parameters) == ["checkpoint_dir", "backend", "init_process_group", "structured_logs"]


def test_the_dcp_storage_classes():
    assert sorted(dcp.__all__) == ["TieredStager", "TieredStorageReader", "TieredStorageWriter"]


def test_the_node_agent_starts_without_importing_torch():
    """An agent has NodeLostAfterSeconds (4 s locally) to register; ``import torch`` takes 2+ s
    of CPU and far more on a busy node. The checkpoint service must stay torch-free."""
    code = "import sys, unbroken.agent.main, unbroken.controller.main; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False", result.stderr
