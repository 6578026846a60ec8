"""Throughput of the real workloads under unbroken vs plain torchrun, and what an elastic resize costs.

Part 1, overhead. The same script, the same 4 ranks, side by side in one run:

* torchrun: two ``torchrun`` agents (2 "nodes" x 2 ranks, c10d rendezvous) on this machine,
  checkpoints to files (DCP folders for the LLM, ``torch.save`` per rank for ResNet);
* unbroken: a 2-node local cluster, the job started by the controller and watched by the node
  agents, checkpoints in the memory tier (one replica on the other node).

Throughput is each run's steady state: the median over steps of the script's own per-step
figure (tokens/s or images/s, global), skipping the first quarter; "wall" is submit → last step,
startup and checkpoints included. Overhead = 1 - unbroken / torchrun.

Part 2, elastic resize (``--elastic``). The LLM job with ``nodes: {min: 1, max: 2}`` on a
2-node cluster: one node is killed → the job continues on one node (shrink: fault → first step
at the smaller size); the replacement node joins → the job grows at its next checkpoint
(grow: JobResizing → first step at the larger size; lost: steps recomputed).

    .venv/bin/python benchmarks/workloads.py [--steps 120] [--elastic] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpus import write_kjv  # noqa: E402
from harness import free_port  # noqa: E402
from imagenet_fixture import make_imagenet_val  # noqa: E402

from unbroken.controller import jobs  # noqa: E402
from unbroken.runtime import fault_injection
from unbroken.config.cluster import ClusterConfig  # noqa: E402
from unbroken.config.job import JobSpec  # noqa: E402
from unbroken.data.imagenet_val import sort_into_classes  # noqa: E402
from unbroken.data.prepare_text import prepare_text  # noqa: E402
from unbroken.plumbing.layout import ClusterLayout  # noqa: E402
from unbroken.runtime import local_cluster  # noqa: E402
from unbroken.plumbing.waiting import wait_until  # noqa: E402


@dataclass
class Throughput:
    workload: str
    system: str
    unit: str
    per_second: float | None
    wall_s: float | None
    note: str = ""


def llm_args(data: Path, steps: int) -> list[str]:
    return ["-m", "unbroken.workloads.llm", "--data", str(data), "--config", "tiny", "--steps", str(steps),
            "--checkpoint-every", "20", "--global-batch", "8", "--micro-batch", "2", "--log-every", "1"]


def resnet_args(data: Path, steps: int) -> list[str]:
    return ["-m", "unbroken.workloads.resnet", "--data", str(data), "--width", "8", "--image-size", "32",
            "--batch-size", "8", "--steps", str(steps), "--checkpoint-every", "20", "--warmup", "5", "--log-every", "1"]


def steady_rate(lines: list[str], field: str) -> float | None:
    """Median of the per-step ``field`` of rank 0's JSON log lines, the first quarter skipped."""
    values = []
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("rank") == 0 and field in record:
            values.append(float(record[field]))
    values = values[len(values) // 4 :]
    return round(statistics.median(values), 1) if values else None


def run_torchrun(name: str, args: list[str], field: str, work: Path) -> Throughput:
    work.mkdir(parents=True)
    port = free_port()
    started = time.monotonic()
    groups = []
    for node_rank in range(2):
        env = {**os.environ, "UNBROKEN_CHECKPOINT_DIR": str(work / "ckpt"), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"bench-{name}",
                "--rdzv-conf", f"is_host={1 if node_rank == 0 else 0}", *args]
        groups.append(subprocess.Popen(argv, stdout=open(work / f"node{node_rank}.log", "wb"), stderr=subprocess.STDOUT, env=env))
    codes = [g.wait(900) for g in groups]
    wall = time.monotonic() - started
    lines = (work / "node0.log").read_text(errors="replace").splitlines()
    note = "" if codes == [0, 0] else f"exit codes {codes}"
    return Throughput(name, "torchrun", field.removesuffix("_per_s") + "/s", steady_rate(lines, field), round(wall, 1), note)


def run_unbroken(name: str, args: list[str], field: str, root: Path) -> Throughput:
    layout = ClusterLayout.at(root / f"unbroken-{name}")
    runtime, _ = local_cluster.up(layout, ClusterConfig.with_nodes(2, name="bench"))
    try:
        local_cluster.wait_ready(runtime, 120)
        spec = JobSpec.model_validate({
            "name": name, "nodes": 2, "procs_per_node": 2, "command": args, "env": {"PYTHONWARNINGS": "ignore"},
            "resilience": {"auto_resume": True, "max_retry": 0, "hang_timeout": 120, "require_deep_health_passed": False},
            "checkpoint": {"memory": {"keep": 2, "replicas": 1}},
        })
        started = time.monotonic()
        jobs.submit(runtime.cluster, spec, note="benchmarks/workloads.py")
        job = wait_until(lambda: (j := runtime.cluster.get_job(name)).phase.is_terminal and j, 900, f"{name} to end")
        wall = time.monotonic() - started
        workers = runtime.backend.observe_attempt(name, 0)
        lines = []
        for worker in workers:
            for log in Path(worker.log_dir or "").rglob("stdout.log"):
                lines += log.read_text(errors="replace").splitlines()
        return Throughput(name, "unbroken", field.removesuffix("_per_s") + "/s", steady_rate(lines, field), round(wall, 1),
                          "" if job.phase.value == "Succeeded" else f"{job.phase.value}: {job.reason}")
    finally:
        local_cluster.down(layout)


@dataclass
class Resize:
    shrink_s: float | None
    grow_s: float | None
    lost_steps_on_grow: int | None
    sizes: list[int]
    note: str = ""


def run_elastic(data: Path, steps: int, root: Path) -> Resize:
    layout = ClusterLayout.at(root / "unbroken-elastic")
    runtime, _ = local_cluster.up(layout, ClusterConfig.with_nodes(2, name="elastic"))
    store, backend = runtime.cluster, runtime.backend
    losses = root / "elastic-losses.jsonl"
    try:
        local_cluster.wait_ready(runtime, 120)
        spec = JobSpec.model_validate({
            "name": "elastic", "nodes": {"min": 1, "max": 2}, "procs_per_node": 2,
            "command": [*llm_args(data, steps), "--step-time", "0.15", "--loss-log", str(losses)], "env": {"PYTHONWARNINGS": "ignore"},
            "resilience": {"auto_resume": True, "max_retry": 3, "hang_timeout": 120, "require_deep_health_passed": False},
            "checkpoint": {"memory": {"keep": 2, "replicas": 1}},
        })
        jobs.submit(store, spec, note="benchmarks/workloads.py --elastic")
        wait_until(lambda: jobs.current_step(backend.observe_attempt("elastic", 0)) >= 30, 180, "step 30")
        victim = next(w.node for w in backend.observe_attempt("elastic", 0) if w.node_rank == 1)
        faulted = time.time()
        fault_injection.kill_node(runtime, victim)
        job = wait_until(lambda: (j := store.get_job("elastic")).phase.is_terminal and j, 600, "the elastic job to end")
        events = store.list_events(object_kind="Job", object_name="elastic")
        history = backend.worker_history("elastic")

        def first_step(attempt: int) -> float | None:
            return min((w.first_progress_at for w in history if w.attempt == attempt and w.first_progress_at), default=None)

        shrunk = next((e for e in events if e.reason == "JobResized" and e.message.startswith("2 → 1")), None)
        growing = next((e for e in events if e.reason == "JobResizing"), None)
        shrink_attempt = next((w.attempt for w in history if shrunk and w.created_at >= shrunk.ts), None)
        grow_attempt = next((w.attempt for w in history if growing and w.created_at >= growing.ts), None)
        at_shrink = first_step(shrink_attempt) if shrink_attempt is not None else None
        at_grow = first_step(grow_attempt) if grow_attempt is not None else None
        records = [json.loads(line) for line in losses.read_text().splitlines()]
        before_grow = [r["step"] for r in records if r["attempt"] == (grow_attempt or 0) - 1]
        after_grow = [r["step"] for r in records if r["attempt"] == grow_attempt]
        lost = (max(before_grow) - min(after_grow) + 1) if before_grow and after_grow else None
        sizes = []
        for record in records:
            if not sizes or sizes[-1] != record["world_size"]:
                sizes.append(record["world_size"])
        return Resize(round(at_shrink - faulted, 2) if at_shrink else None,
                      round(at_grow - growing.ts, 2) if at_grow and growing else None, lost, sizes,
                      "" if job.phase.value == "Succeeded" else f"{job.phase.value}: {job.reason}")
    finally:
        local_cluster.down(layout)



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120, help="steps of each throughput run")
    parser.add_argument("--elastic", action="store_true", help="also measure a shrink and a grow")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-") as tmp:
        root = Path(tmp)
        text = prepare_text([write_kjv(root / "kjv.txt")], root / "kjv", vocab_size=2048, shard_tokens=2**20)
        images, solutions = make_imagenet_val(root / "imagenet", classes=4, per_class=32)
        sort_into_classes(images, solutions)
        results: list[Throughput] = []
        for name, workload_args, field in (("llm", llm_args(root / "kjv", args.steps), "tokens_per_s"),
                                           ("resnet", resnet_args(images, args.steps), "images_per_s")):
            results.append(run_torchrun(name, workload_args, field, root / f"torchrun-{name}"))
            results.append(run_unbroken(name, workload_args, field, root))
        resize = run_elastic(root / "kjv", 300, root) if args.elastic else None
    overhead = {}
    for name in ("llm", "resnet"):
        base = next(r for r in results if r.workload == name and r.system == "torchrun").per_second
        ours = next(r for r in results if r.workload == name and r.system == "unbroken").per_second
        overhead[name] = round(1 - ours / base, 4) if base and ours else None
    if args.json:
        print(json.dumps({"steps": args.steps, "tokens": text.total_tokens, "results": [asdict(r) for r in results],
                          "overhead": overhead, "resize": asdict(resize) if resize else None}))
        return 0
    print(f"steady-state throughput, {args.steps} steps, 2 nodes x 2 ranks (LLM tiny; ResNet-50 width 8, 32 px)\n")
    print("| workload | system | throughput | wall (s) | overhead vs torchrun | note |")
    print("|---|---|---|---|---|---|")
    for r in results:
        ratio = f"{overhead[r.workload]:+.1%}" if r.system == "unbroken" and overhead[r.workload] is not None else ""
        print(f"| {r.workload} | {r.system} | {r.per_second} {r.unit} | {r.wall_s} | {ratio} | {r.note} |")
    if resize is not None:
        print("\nelastic LLM job, nodes 1-2, kill-node at step 30\n")
        print("| shrink: fault -> first step on 1 node (s) | grow: JobResizing -> first step on 2 nodes (s) | steps redone at the grow | world sizes | note |")
        print("|---|---|---|---|---|")
        print(f"| {resize.shrink_s} | {resize.grow_s} | {resize.lost_steps_on_grow} | {' → '.join(map(str, resize.sizes))} | {resize.note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
