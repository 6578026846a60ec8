"""The checkpoint catalog on Kubernetes: what one save costs the API server, at 1,000 ranks, beside the layout before.

For each system, on a fresh control plane (etcd and kube-apiserver from tests/controlplane):

* N Nodes, each with the real node agent's checkpoint half (``CheckpointService``, its HTTPS shard
  server, and its own ``KubernetesCatalog`` client, following the catalog and the Nodes by watch where
  the system does), passing every 0.5 s in its own thread as the Kubernetes agent does
  (``CHECKPOINT_PASS_SECONDS``);
* R ranks per node, each a real ``TieredCheckpointer`` writing a small state into the node's shared
  memory; tiers: memory (keep 2) with one replica on a peer;
* S saves: every rank saves step s, and the save is done when the catalog shows step s committed in
  memory with a replica of every rank; then the agents settle (their held copy records written).

Systems, the same driver run on each's sources (``git archive``):

* ``unbroken`` (this tree): one ConfigMap of copies per node; peers push a step as soon as they
  recorded it, and an agent holds its copy records (a second, and while a push to it is under way up to
  5 s more) so that a save's own copies and the replicas it holds are one patch; reads from watch caches;
* ``two-writes`` (commit ``TWO_WRITES_COMMIT``, the design before this one): the same, but replication
  waits for the step's commit, so the replicas a node holds are a second patch per save;
* ``baseline`` (commit ``BASELINE_COMMIT``): one ConfigMap per step, one patch per copy, a LIST of the
  job's ConfigMaps and one of the Nodes per pass.

Reported per system, from the API server's own ``apiserver_request_total`` and ``apiserver_response_sizes``:
writes per node per save (goal ≤ 1), LIST requests and bytes read per second while saving, and the
seconds from a save to its step committed with every replica. The cluster state (jobs, nodes) is a
SQLite file: it is not the catalog, and not what is measured.

    .venv/bin/python benchmarks/catalog.py                        # 16 nodes x 8 ranks, 5 saves, every system
    .venv/bin/python benchmarks/catalog.py --nodes 16 --ranks-per-node 64 --saves 3 --json   # 1,024 ranks

Every agent and rank shares this one process: at 125 agents of 8 ranks (1,000 ranks) it does not get through
a save in minutes here (docs/benchmarks.md); the figure per node is read at 16 nodes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import baseline  # benchmarks/baseline.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
BASELINE_COMMIT = "d1eb2d6"
"""The last commit with one ConfigMap per step holding a key per copy, written one copy at a time."""
TWO_WRITES_COMMIT = "032ea40"
"""The last commit whose agents replicated a step only once it was committed: two writes per node per save."""
COMMITS = {"baseline": BASELINE_COMMIT, "two-writes": TWO_WRITES_COMMIT}
NAMESPACE = "unbroken-system"
JOB = "team-a/llama"
PASS_SECONDS = 0.5
SAVE_TIMEOUT_S = 180.0
"""A save not committed with every replica by then ends the system's run (reported as failed)."""
WRITE_VERBS = {"POST", "PUT", "PATCH", "DELETE"}


@dataclass
class Result:
    system: str
    nodes: int
    ranks: int
    saves: int
    writes_per_node_per_save: float
    lists_per_s: float
    read_mb_s: float
    commit_p50_s: float
    commit_max_s: float
    passes_per_node_s: float
    """Agent passes achieved (the goal is 2 a second): below it, this machine could not keep up."""
    failed: str | None = None
    """Why the run stopped short (a save not committed in time), None when every save was."""


# -- the worker: one system, in a process whose sys.path has that system's sources ------------------------


def apiserver_totals(plane: Any) -> tuple[float, float, float]:
    """(ConfigMap writes, LIST requests, response bytes) so far, from the API server's own /metrics."""
    return plane.requests_answered(WRITE_VERBS, "configmaps"), plane.requests_answered({"LIST"}), plane.response_bytes()


def worker(system: str, nodes: int, ranks: int, saves: int) -> Result:
    import kubernetes
    import torch

    from controlplane.cluster import ControlPlane
    from unbroken.kubernetes.backend.catalog import KubernetesCatalog
    from unbroken.kubernetes.backend.client import api_client
    from unbroken.checkpoint.node import credentials
    from unbroken.checkpoint.node.service import CheckpointService
    from unbroken.checkpoint.rank.tiered import TieredCheckpointer
    from unbroken.config.job import JobSpec
    from unbroken.state.phases import DeepHealthStatus, JobPhase, NodeState
    from unbroken.state.records import CheckpointTier, Job, Node, StepStatus
    from unbroken.state.sqlite import SqliteStore

    logging.basicConfig(level=logging.WARNING)
    say = lambda text: print(f"[{time.strftime('%H:%M:%S')}] {system}: {text}", file=sys.stderr, flush=True)  # noqa: E731
    world = nodes * ranks
    with tempfile.TemporaryDirectory(prefix=f"catalog-{system}-") as scratch, \
            tempfile.TemporaryDirectory(prefix="unbroken-catalog-bench-", dir="/dev/shm") as shm_dir, \
            ControlPlane(Path(scratch) / "plane", kubeflow=False, crds=False) as plane:
        plane.create_namespace(NAMESPACE)
        api = api_client(plane.kubeconfig)
        core = kubernetes.client.CoreV1Api(api)
        names = [f"sim-{i:04d}" for i in range(nodes)]
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda n: core.create_node({"metadata": {"name": n}}), names))
        creds = credentials.create(Path(scratch) / "credentials", "bench")
        spec = JobSpec.model_validate({"name": JOB.partition("/")[2], "command": ["x.py"],
                                       # the services read the tiers only (a job file allows 64 nodes; 125 are simulated)
                                       "nodes": min(nodes, 64), "procs_per_node": ranks,
                                       "checkpoint": {"memory": {"keep": 2, "replicas": 1}}}, context={"trusted": True})
        store = SqliteStore(Path(scratch) / "state.db", create=True)
        store.add_job(Job(name=JOB, spec_json=spec.model_dump_json(), phase=JobPhase.RUNNING))
        for name in names:
            store.add_node(Node(name=name, group="g", instance_type="cpu-dev", state=NodeState.SCHEDULABLE,
                                deep_health=DeepHealthStatus.PASSED, heartbeat_at=time.time()))
        say(f"{nodes} agents, {world} ranks")
        services = {}
        followed: list[Any] = []  # watch caches, stopped before the control plane is
        for name in names:
            own = SqliteStore(Path(scratch) / "state.db")
            catalog = KubernetesCatalog(api_client(plane.kubeconfig), NAMESPACE)
            if hasattr(catalog, "follow"):  # as the agent does: the catalog and the Nodes from watch caches
                from unbroken.kubernetes.backend.watch_cache import WatchCache

                nodes_cache = WatchCache("nodes", kubernetes.client.CoreV1Api(api_client(plane.kubeconfig)).list_node)
                nodes_cache.start()
                followed.append(nodes_cache)
                followed.append(catalog.follow(nodes=nodes_cache))
            services[name] = CheckpointService(catalog, own, name, Path(shm_dir) / name, creds)
            services[name].start()
        checkpointers = [
            TieredCheckpointer(job=JOB, attempt=0, rank=node_index * ranks + local, world_size=world, node=name,
                               shm_root=Path(shm_dir) / name, policy=spec.checkpoint.tiers,
                               endpoint=services[name].server.address, credentials=creds, save_wait_seconds=30.0)
            for node_index, name in enumerate(names) for local in range(ranks)]
        stopping = threading.Event()
        passes = [0]

        def agent(service: CheckpointService) -> None:
            while not stopping.wait(PASS_SECONDS):
                try:
                    service.reconcile()
                    passes[0] += 1
                except Exception as exc:  # noqa: BLE001 - counted as a pass missed, as the agent logs and goes on
                    say(f"pass failed on {service.node}: {type(exc).__name__}: {exc}")
        threads = [threading.Thread(target=agent, args=(s,), daemon=True) for s in services.values()]
        for t in threads:
            t.start()
        reader = KubernetesCatalog(api, NAMESPACE)

        def committed(step: int) -> bool:
            rows = reader.list_checkpoint_steps(JOB, tier=CheckpointTier.MEMORY)
            if not any(r.step == step and r.status is StepStatus.COMMITTED for r in rows):
                return False
            return len({c.rank for c in reader.list_shard_copies(JOB, step=step, tier=CheckpointTier.REPLICA)}) == world

        def settled() -> None:
            """Until no ConfigMap write for 3 s (held copy records written, retired steps gone)."""
            last, quiet_since = apiserver_totals(plane)[0], time.monotonic()
            while time.monotonic() - quiet_since < 3.0:
                time.sleep(0.5)
                now = apiserver_totals(plane)[0]
                if now != last:
                    last, quiet_since = now, time.monotonic()

        commit_times: list[float] = []
        failed: str | None = None
        writes0 = lists0 = bytes0 = 0.0
        started = time.monotonic()
        passes0 = 0
        for step in range(1, saves + 2):  # the first save warms up (shared memory slots, first ConfigMaps): not counted
            if step == 2:
                settled()
                writes0, lists0, bytes0 = apiserver_totals(plane)
                started, passes0 = time.monotonic(), passes[0]
            state = {"w": torch.full((1024,), float(step))}
            saved_at = time.monotonic()
            for ck in checkpointers:
                ck.save(step, state)
            for ck in checkpointers:
                ck.wait()
            deadline = time.monotonic() + SAVE_TIMEOUT_S
            while not committed(step):
                if time.monotonic() > deadline:
                    failed = f"step {step} was not committed with every replica within {SAVE_TIMEOUT_S:.0f} s"
                    break
                time.sleep(0.2)
            if failed:
                say(failed)
                break
            if step >= 2:
                commit_times.append(time.monotonic() - saved_at)
            say(f"save {step}: committed with every replica in {time.monotonic() - saved_at:.1f} s")
        if not failed:
            settled()
        writes1, lists1, bytes1 = apiserver_totals(plane)
        seconds = time.monotonic() - started
        stopping.set()
        for t in threads:
            t.join(timeout=10)
        for ck in checkpointers:
            ck.close()
        for service in services.values():
            service.close()
        for cache in followed:
            cache.stop()
    commit_times.sort()
    done = max(len(commit_times), 1)
    nan = float("nan")
    return Result(system=system, nodes=nodes, ranks=world, saves=len(commit_times),
                  writes_per_node_per_save=(writes1 - writes0) / nodes / done if commit_times else nan,
                  lists_per_s=(lists1 - lists0) / seconds, read_mb_s=(bytes1 - bytes0) / seconds / 2**20,
                  commit_p50_s=commit_times[len(commit_times) // 2] if commit_times else nan,
                  commit_max_s=commit_times[-1] if commit_times else nan,
                  passes_per_node_s=(passes[0] - passes0) / seconds / nodes, failed=failed)


# -- the driver ----------------------------------------------------------------------------------------------


def run_system(system: str, args: argparse.Namespace) -> Result:
    env = dict(os.environ)
    src = ROOT / "src" if system == "unbroken" else baseline.sources(COMMITS[system])
    env["PYTHONPATH"] = os.pathsep.join([str(src), str(ROOT / "tests")])
    out = subprocess.run([sys.executable, __file__, "--worker", system, "--nodes", str(args.nodes), "--ranks-per-node",
                          str(args.ranks_per_node), "--saves", str(args.saves)], env=env, check=True, stdout=subprocess.PIPE)
    return Result(**json.loads(out.stdout))


def table(results: list[Result]) -> str:
    header = ("system", "nodes", "ranks", "saves", "writes/node/save", "LIST/s", "read MB/s", "commit p50 s", "commit max s",
              "passes/node/s", "failed")
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for r in results:
        lines.append(" | ".join([r.system, str(r.nodes), str(r.ranks), str(r.saves), f"{r.writes_per_node_per_save:.2f}",
                                 f"{r.lists_per_s:.0f}", f"{r.read_mb_s:.1f}", f"{r.commit_p50_s:.1f}", f"{r.commit_max_s:.1f}",
                                 f"{r.passes_per_node_s:.2f}", r.failed or ""]))
    by = {r.system: r for r in results}
    ours = by.get("unbroken")
    for other in (by[name] for name in COMMITS if name in by):
        if ours is not None and ours.writes_per_node_per_save:
            lines += ["", f"{other.system} writes {other.writes_per_node_per_save / ours.writes_per_node_per_save:.1f}x "
                          f"unbroken's per node per save; reads {other.read_mb_s / max(ours.read_mb_s, 1e-3):.1f}x"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n", 2)[2])
    parser.add_argument("--nodes", type=int, default=16, help="agents (default: %(default)s)")
    parser.add_argument("--ranks-per-node", type=int, default=8, help="(default: %(default)s)")
    parser.add_argument("--saves", type=int, default=5, help="saves measured, after one warm-up save (default: %(default)s)")
    parser.add_argument("--systems", default="unbroken,two-writes,baseline", help="(default: %(default)s)")
    parser.add_argument("--json", action="store_true", help='print {"results": [...]} instead of a table')
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(asdict(worker(args.worker, args.nodes, args.ranks_per_node, args.saves))))
        return 0
    systems = args.systems.split(",")
    unknown = [name for name in systems if name != "unbroken" and name not in COMMITS]
    if unknown:
        parser.error(f"--systems: unknown {', '.join(unknown)}; choose from unbroken, {', '.join(COMMITS)}")
    results = [run_system(system, args) for system in systems]
    print(json.dumps({"results": [asdict(r) for r in results]}, indent=2) if args.json else table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
