"""Everything only a GPU can show, in one command, side by side with what it competes with.

Sections (``--only`` picks some; each runs on its own, and a failing one is reported, not fatal):

* ``health``: a one-node local cluster of the GPU's instance type (``p5.48xlarge``'s floors, its GPU
  count set to what is here): the node's join checks decide whether it becomes ``Schedulable``; then
  ``unbroken check run``'s suites (NVML inventory and errors, matmul, memory bandwidth, the collective
  sweep of one rank per GPU, storage), each with its figure.
* ``save``: memory-tier saves of 2 and 8 GiB of CUDA state beside a training step (``--step-seconds`` of
  matmuls on other tensors), against a pinned ``copy_(non_blocking=True)`` of the same bytes: the first
  save's stall (slots prepared ahead with ``ctx.checkpoint.prepare``), the warm saves' stall, the step
  beside a save against the step alone, save -> committed by the node agent (a real one, in its own
  process), and, for the largest size, ``restore(device="cuda")`` against a pinned host-to-device copy
  of the same bytes and against the old way (a host restore, then ``.to("cuda")``).
* ``readback``: twenty saves whose size changes (64, 256, 16 MiB ...), three in-process restarts (a new
  checkpointer in the same process), every recorded slot read back and compared with the state it was
  given (``mismatched_saves``, ``unrecorded_saves``); then pinned memory left registered (must be none)
  and ``dcp.async_save`` with a pinned stager in the same process.
* ``dcp``: ``dcp.async_save`` of 2 GiB: alone (no process group) and in the process group
  ``unbroken.init`` makes (``cpu:gloo,cuda:nccl``); blocking time of each.
* ``abort``: the leave watch's end of a ``cpu:gloo,cuda:nccl`` group from its thread, and the group
  formed again, with an all-reduce on the device and one on the host.
* ``overhead``: a ~5 ms GPU step bare, with ``ctx.progress``, and with four ``ctx.section``\\ s (CUDA
  events) and ``ctx.progress``.
* ``agreement``: replica agreement's fingerprint on the device against the host's (bit for bit), a bit
  flipped on the device, a check's host time judged a step later against the previous design's wait, and
  a loop of 50 ms steps with a check every 10 against none (the end-to-end overhead).
* ``llm``: the LLM workload (``--config small``) through the local cluster, its rank SIGKILLed, cold
  and with a warm spare, each to ``Succeeded``: kill -> first step, and how each job ended.

``--quick`` runs every section on the CPU at toy sizes (the test suite runs it, so the script never
rots); ``--json`` prints one object (``{"device", "sections": {name: {...}}, "goals": [...]}``);
``--out DIR`` also writes ``gpu.json`` (after each section: a run cut short keeps what it measured)
and ``gpu.md`` (the table for docs/benchmarks.md).

A GPU machine with a CUDA torch but none of unbroken's other dependencies and no network:
``--print-wheels`` prints the ``pip download`` line to run where there is a network; carry the folder
and give it to ``--wheels DIR``, which installs them into a private folder for this run::

    python3 benchmarks/gpu.py --print-wheels --python-version 3.12      # here: prints the download line
    python3 benchmarks/gpu.py --wheels .whl --out OUT                   # there: about 7 minutes on one H100
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from datetime import datetime
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WHEELS = ("pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
          "typing-extensions==4.16.0", "tenacity==9.2.1", "python-json-logger==4.2.0", "cryptography==50.0.2",
          "cffi==2.1.1", "pycparser==3.12")
"""unbroken's dependencies that a CUDA image with torch does not hold (pinned to what the tests run with)."""
GIB = 1 << 30
MIB = 1 << 20
AGREEMENT_STEP_S = 0.05
"""The step of the agreement section's loop (GPU): a check every 10 of them, of its 1 GiB state."""


def install_wheels(folder: Path) -> None:
    """Install the carried wheels into a private folder and put it first on the path (no network, no venv)."""
    target = Path(tempfile.gettempdir()) / "unbroken-gpu-site"
    wheels = sorted(str(p) for p in folder.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"--wheels {folder}: no .whl files there (run --print-wheels where there is a network)")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade",
                    "--target", str(target), *wheels], check=True)
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(target), str(REPO / "src"), os.environ.get("PYTHONPATH", "")])


def print_wheels(python_version: str) -> None:
    platforms = " ".join(f"--platform manylinux_2_{n}_x86_64" for n in (17, 27, 28, 34)) + " --platform manylinux2014_x86_64"
    print(f"python3 -m pip download --no-deps --only-binary=:all: --python-version {python_version} --implementation cp "
          f"--abi cp{python_version.replace('.', '')} --abi abi3 --abi none {platforms} -d .whl {' '.join(WHEELS)}")


# -- shared ---------------------------------------------------------------------------


class Run:
    """What the sections share: the device, sizes, a scratch folder, and the local cluster (made once)."""

    def __init__(self, quick: bool, work: Path, step_seconds: float, save_gib: list[float] | None = None) -> None:
        import torch

        self.quick = quick
        self.cuda = torch.cuda.is_available() and not quick
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        self.gpus = torch.cuda.device_count() if self.cuda else 0
        self.work = work
        self.step_seconds = step_seconds if self.cuda else 0.05
        self.save_gib = save_gib or [2.0, 8.0]
        self._cluster: Any = None

    def sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()

    def cluster(self) -> Any:
        """A one-node local cluster of this machine's instance type, joined (its join checks run)."""
        if self._cluster is None:
            from unbroken.config.cluster import ClusterConfig
            from unbroken.plumbing.layout import ClusterLayout
            from unbroken.runtime import local_cluster

            group: dict[str, Any] = {"InstanceGroupName": "gpus", "InstanceCount": 1,
                                     "OnStartDeepHealthChecks": ["InstanceStress", "InstanceConnectivity"]}
            settings: dict[str, Any] = {"ClusterName": "gpu-bench", "InstanceGroups": [group]}
            if self.cuda:
                group["InstanceType"] = "p5.48xlarge"
                # this machine's GPUs and no EFA: the floors stay the H100's
                settings["Health"] = {"Profiles": {"p5.48xlarge": {"GpuCount": self.gpus, "RdmaDevices": 0}}}
            else:
                group["InstanceType"] = "cpu-dev"
            layout = ClusterLayout.at(self.work / "cluster")
            runtime, _ = local_cluster.up(layout, ClusterConfig.model_validate(settings))
            started = time.monotonic()
            local_cluster.wait_ready(runtime, 600)
            self._cluster = (layout, runtime, round(time.monotonic() - started, 1))
        return self._cluster

    def close(self) -> None:
        if self._cluster is not None:
            from unbroken.runtime import local_cluster

            local_cluster.down(self._cluster[0])


def median(values: list[float]) -> float:
    return round(statistics.median(values), 4)


def size_label(nbytes: int) -> str:
    return f"{nbytes // GIB}GiB" if nbytes >= GIB else f"{nbytes // MIB}MiB"


def make_state(nbytes: int, device: Any, seed: int = 0) -> dict[str, Any]:
    """A model-and-Adam-shaped state of about ``nbytes`` on ``device``: bf16 weights, fp32 moments, a step counter."""
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)
    weights, moments = nbytes // 5, nbytes * 2 // 5  # bytes: bf16 weights, then two fp32 moments
    per = 8
    model = {f"layer{i}.weight": torch.randn(weights // per // 2, device=device, generator=generator).to(torch.bfloat16)
             for i in range(per)}
    optimizer = {f"layer{i}.{m}": torch.randn(moments // per // 4, device=device, generator=generator)
                 for i in range(per) for m in ("exp_avg", "exp_avg_sq")}
    return {"model": model, "optimizer": optimizer, "step": torch.tensor(float(seed)), "odd": torch.ones(1001, device=device)}


def tensors_of(state: Any) -> list[Any]:
    from unbroken.checkpoint.rank.device_restore import tensors_in

    return list(tensors_in(state))


def nbytes_of(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(state))


def same_state(a: Any, b: Any) -> bool:
    import torch

    left, right = tensors_of(a), tensors_of(b)
    return len(left) == len(right) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.to(y.device), y) for x, y in zip(left, right, strict=True))


class StepWork:
    """The next forward and backward: matmuls on tensors of their own, sized once to take ``seconds``."""

    def __init__(self, run: Run, seconds: float) -> None:
        import torch

        self.run_ = run
        size = 8192 if run.cuda else 256
        dtype = torch.bfloat16 if run.cuda else torch.float32
        self.a = torch.randn(size, size, device=run.device, dtype=dtype)
        self.b = torch.randn(size, size, device=run.device, dtype=dtype)
        self.units = 1
        self.time()
        self.units = max(1, round(seconds / max(self.time(), 1e-6)))

    def queue(self) -> None:
        """Queue the step's kernels (on a GPU: returns before they ran)."""
        import torch

        for _ in range(self.units):
            torch.mm(self.a, self.b)

    def time(self) -> float:
        self.run_.sync()
        started = time.perf_counter()
        self.queue()
        self.run_.sync()
        return time.perf_counter() - started


# -- health ---------------------------------------------------------------------------


def section_health(run: Run) -> dict[str, Any]:
    from unbroken.cli.check import run_checks
    from unbroken.health.result import Suite

    layout, runtime, joined_s = run.cluster()
    nodes = runtime.cluster.list_nodes()
    node = nodes[0]
    join_events = [e for e in runtime.cluster.list_events(object_kind="Node", object_name=node.name)]
    # the suites once more, each check's figure in a row (--quick: the join's run is enough, the suite's minutes are not)
    results = [] if run.quick else run_checks(layout, runtime.cluster, runtime.config, nodes,
                                              [Suite.INSTANCE_STRESS, Suite.INSTANCE_CONNECTIVITY])
    keep = ("tflops", "gflops", "gbps", "busbw", "algbw", "floor", "world", "gpus", "count", "write_mbps", "busbw_judged")
    return {
        "node_state": node.state.value, "deep_health": node.deep_health.value if node.deep_health else None,
        "join_s": joined_s, "gpus": run.gpus,
        "join_events": [f"{e.reason}: {e.message}"[:300] for e in join_events][-12:],
        "checks": [{"check": r.check, "status": r.status.value, "reason": r.reason, "message": r.message[:300],
                    "metrics": {k: v for k, v in r.metrics.items() if any(w in k.lower() for w in keep)},
                    "duration_s": r.duration_s} for r in results],
    }


# -- save and restore -----------------------------------------------------------------


def pinned_copy_seconds(run: Run, state: dict[str, Any]) -> tuple[float, float]:
    """(device -> pinned host, pinned host -> device) seconds for the state's bytes: the links' yardsticks."""
    import torch

    tensors = tensors_of(state)
    if not run.cuda:
        host = [torch.empty_like(t) for t in tensors]
        started = time.perf_counter()
        for h, t in zip(host, tensors, strict=True):
            h.copy_(t)
        took = time.perf_counter() - started
        return took, took
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    stream = torch.cuda.Stream()

    def timed_copies(destinations: list[Any], sources: list[Any]) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.cuda.stream(stream):
            for destination, source in zip(destinations, sources, strict=True):
                destination.copy_(source, non_blocking=True)
        stream.synchronize()
        return time.perf_counter() - started

    down, up = [], []
    for _ in range(3):
        down.append(timed_copies(host, tensors))
        targets = [torch.empty_like(t) for t in tensors]
        up.append(timed_copies(targets, host))
        del targets
    return median(down), median(up)


def section_save(run: Run) -> dict[str, Any]:
    import checkpoint as checkpoint_bench  # benchmarks/checkpoint.py: the agent in its own process

    from unbroken.config.job import JobSpec

    sizes = [int(g * GIB) for g in run.save_gib] if run.cuda else [32 * MIB]
    work = StepWork(run, run.step_seconds)
    out: dict[str, Any] = {"step_units": work.units}
    for size in sizes:
        label = size_label(size)
        state = make_state(size, run.device, seed=1)
        nbytes = nbytes_of(state)
        alone = median([work.time() for _ in range(5)])
        to_host, to_device = pinned_copy_seconds(run, state)
        spec = JobSpec.model_validate({"name": "gpu", "command": ["x.py"], "checkpoint": {"memory": {"keep": 1, "replicas": 0}}},
                                      context={"trusted": True})
        shm = Path(tempfile.mkdtemp(prefix="unbroken-gpu-", dir="/dev/shm"))
        cluster = checkpoint_bench.Cluster(run.work / f"save-{label}", shm, spec, ["node-1"])
        row: dict[str, Any] = {"bytes": nbytes, "step_alone_s": alone, "pinned_d2h_s": to_host, "pinned_h2d_s": to_device}
        try:
            ck = cluster.checkpointer("node-1", endpoint=cluster.endpoints["node-1"])
            started = time.perf_counter()
            ck.prepare(state)
            ck.wait()
            row["prepare_s"] = round(time.perf_counter() - started, 3)
            stalls, besides, committed, timings = [], [], [], []
            for step in range(1, 6):
                run.sync()
                started = time.perf_counter()
                ck.save(step, state)
                watcher = Committed(cluster, step, started)  # the agent commits while the step runs
                work.time()  # the next forward and backward, beside the copy
                ck.fence()  # what optimizer.step() does first
                besides.append(time.perf_counter() - started)
                stalls.append(ck.last_stall_seconds)
                committed.append(watcher.seconds())
                ck.wait()
                timings.append(dict(ck.last_save_timing))
            row["save_timing_s"] = {k: median([t[k] for t in timings[1:] if k in t]) for k in timings[-1]}
            row.update(first_stall_s=round(stalls[0], 4), warm_stall_s=median(stalls[1:]), first_step_beside_s=round(besides[0], 4),
                       step_beside_s=median(besides[1:]), committed_s=median(committed[1:]))
            row["step_slowdown"] = round(row["step_beside_s"] / alone - 1, 4)
            row["committed_over_pinned_copy"] = round(row["committed_s"] / to_host, 2)
            ck.close()
            if size == sizes[-1]:
                row.update(restore_section(run, cluster, state))
        finally:
            cluster.close()
            shutil.rmtree(shm, ignore_errors=True)
        out[label] = row
        del state
    return out


class Committed:
    """Polls, in a thread of its own, for a step to be committed in the memory tier: seconds from ``started``."""

    def __init__(self, cluster: Any, step: int, started: float) -> None:
        from unbroken.state.records import CheckpointTier

        self._at: float | None = None
        self._thread = threading.Thread(target=self._poll, args=(cluster, step, started, CheckpointTier.MEMORY), daemon=True)
        self._thread.start()

    def _poll(self, cluster: Any, step: int, started: float, tier: Any) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if cluster.committed(tier, step):
                self._at = time.perf_counter() - started
                return
            time.sleep(0.002)  # polling the agent's row: it says nothing when it writes it

    def seconds(self) -> float:
        self._thread.join()
        if self._at is None:
            raise TimeoutError("the step was not committed within 300 s")
        return self._at


def restore_section(run: Run, cluster: Any, state: dict[str, Any]) -> dict[str, Any]:
    """The newest step back onto the device, the new way and the old, against the pinned copy."""
    import torch

    from unbroken.checkpoint.rank import device_restore

    out: dict[str, Any] = {}
    readers = device_restore.READERS
    for attempt, how in ((1, "device"), (2, "host"), (3, "device_16_readers")):
        ck = cluster.checkpointer("node-1", endpoint=cluster.endpoints["node-1"], attempt=attempt)
        ck.wait_prefetch()  # a restart maps ahead while it imports and builds its model (seconds): not counted
        device_restore.READERS = 16 if how == "device_16_readers" else readers
        run.sync()
        started = time.perf_counter()
        if how.startswith("device"):
            restored = ck.restore(device=run.device)
        else:
            restored = ck.restore()
            if restored is not None:
                restored = type(restored)(restored.step, {k: _to(v, run.device) for k, v in restored.state.items()}, restored.source)
        run.sync()
        took = time.perf_counter() - started
        device_restore.READERS = readers
        out[f"restore_{how}_s"] = round(took, 4)
        out[f"restore_{how}_exact"] = restored is not None and same_state(restored.state, state)
        if ck.last_restore_timing:
            out[f"restore_{how}_timing_s"] = {k: round(v, 4) for k, v in ck.last_restore_timing.items()}
        ck.close()
        del restored
        # this attempt's own slots (prepared for its next saves, which never come): the memory back for the next
        for slot in (ck.shm_root / "own").glob(f"*/a{attempt:04d}-*"):
            slot.unlink(missing_ok=True)
        if run.cuda:
            torch.cuda.empty_cache()
    return out


def _to(value: Any, device: Any) -> Any:
    from unbroken.checkpoint.rank.device_restore import map_tensors

    return map_tensors(value, lambda t: t.to(device))


# -- read-back ------------------------------------------------------------------------


def section_readback(run: Run) -> dict[str, Any]:
    import mmap

    import torch

    from unbroken.checkpoint.format import shard
    from unbroken.checkpoint.node import cuda_host, shm
    from unbroken.checkpoint.node.credentials import create
    from unbroken.checkpoint.rank.tiered import TieredCheckpointer
    from unbroken.config.checkpoint import TierPolicy

    sizes = [64 * MIB, 256 * MIB, 16 * MIB, 128 * MIB, 256 * MIB] if run.cuda else [4 * MIB, 16 * MIB, 1 * MIB, 8 * MIB, 16 * MIB]
    root = Path(tempfile.mkdtemp(prefix="unbroken-gpu-readback-", dir="/dev/shm"))
    credentials = create(run.work / "readback-credentials", "gpu")
    policy = TierPolicy.model_validate({"memory": {"keep": 2, "replicas": 0}})

    def checkpointer(attempt: int) -> TieredCheckpointer:
        return TieredCheckpointer(job="gpu", attempt=attempt, rank=0, world_size=1, node="node-1", shm_root=root, policy=policy,
                                  endpoint=None, credentials=credentials)

    def read_back(step: int) -> Any:
        for stored in shm.scan(root, "gpu"):
            if stored.info.step == step:
                with open(stored.path, "rb") as f, mmap.mmap(f.fileno(), stored.info.size, access=mmap.ACCESS_COPY) as view:
                    if shard.checksum(view, stored.info.size) != stored.info.checksum:
                        return "checksum"
                    return shard.read(view, stored.info.metas(), stored.info.skeleton_offset, stored.info.size, copy=True)
        return None

    mismatched, unrecorded, restarts = [], [], 0
    ck = checkpointer(0)
    try:
        for step in range(1, 21):
            if step in (6, 11, 16):
                ck.close()
                restarts += 1
                ck = checkpointer(restarts)
            state = make_state(sizes[step % len(sizes)], run.device, seed=step)
            ck.save(step, state)
            ck.wait()
            back = read_back(step)
            if back is None:
                unrecorded.append(step)
            elif back == "checksum" or back["step"] != step or not same_state(back["state"], state):
                mismatched.append(step)
        ck.close()
        pinned_left = cuda_host.process_pinned_memory().pinned_bytes if run.cuda else 0
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out: dict[str, Any] = {"saves": 20, "in_process_restarts": restarts, "mismatched_saves": len(mismatched),
                           "mismatched_steps": mismatched, "unrecorded_saves": len(unrecorded), "unrecorded_steps": unrecorded,
                           "pinned_bytes_left": pinned_left}
    state = make_state(64 * MIB if run.cuda else 4 * MIB, run.device, seed=99)
    try:
        blocked, done = async_save(state, run.work / "readback-dcp", pinned=run.cuda)
        out["dcp_async_save_after"] = {"ok": True, "blocking_s": blocked, "done_s": done}
    except Exception as exc:  # noqa: BLE001 - the row says how it failed
        out["dcp_async_save_after"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
    del torch
    return out


# -- dcp.async_save -------------------------------------------------------------------


def async_save(state: dict[str, Any], folder: Path, *, pinned: bool) -> tuple[float, float]:
    """(seconds ``dcp.async_save`` blocked, seconds until its future is done), with a pinned stager where asked."""
    import torch.distributed.checkpoint as dcp

    kwargs: dict[str, Any] = {}
    if pinned:
        with contextlib.suppress(ImportError, TypeError):
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            kwargs["async_stager"] = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                                  use_async_staging=True, use_non_blocking_copy=True))
    shutil.rmtree(folder, ignore_errors=True)
    started = time.perf_counter()
    result: Any = dcp.async_save(state, checkpoint_id=str(folder), **kwargs)
    blocked = time.perf_counter() - started
    future = getattr(result, "upload_completion", result)
    staging = getattr(result, "staging_completion", None)
    if staging is not None:
        staging.result()
    future.result()
    return round(blocked, 4), round(time.perf_counter() - started, 4)


def section_dcp(run: Run) -> dict[str, Any]:
    import torch.distributed as dist

    from unbroken.plumbing.ports import free_port
    from unbroken.rank.process_group import default_backend

    state = make_state(2 * GIB if run.cuda else 16 * MIB, run.device, seed=3)
    out: dict[str, Any] = {"bytes": nbytes_of(state)}
    alone = [async_save(state, run.work / "dcp-alone", pinned=run.cuda) for _ in range(3)]
    out["alone_blocking_s"] = median([a[0] for a in alone])
    out["alone_done_s"] = median([a[1] for a in alone])
    backend = default_backend(run.cuda)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group(backend=backend)
    out["backend"] = backend
    try:
        grouped = [async_save(state, run.work / "dcp-grouped", pinned=run.cuda) for _ in range(3)]
        out.update(in_group_ok=True, in_group_blocking_s=median([g[0] for g in grouped]), in_group_done_s=median([g[1] for g in grouped]))
    except Exception as exc:  # noqa: BLE001 - the row says how it failed
        out.update(in_group_ok=False, in_group_error=f"{type(exc).__name__}: {exc}"[:400])
    finally:
        dist.destroy_process_group()
    return out


# -- the leave watch's abort ----------------------------------------------------------


def section_abort(run: Run) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from unbroken.rank import process_group
    from unbroken.rank.env import GroupPlacement
    from unbroken.plumbing.ports import free_port

    def form() -> Any:
        placement = GroupPlacement(group_rank=0, nnodes=1, rendezvous=f"127.0.0.1:{free_port()}", rejoin_dir=run.work / "rejoin",
                                   collective_timeout=30.0)
        os.environ.update(placement.rank_environ(0, 1))
        return process_group.init_process_group(None, 0, placement)

    def works() -> bool:
        on_device = torch.ones(4, device=run.device)
        on_host = torch.ones(4)
        dist.all_reduce(on_device)
        dist.all_reduce(on_host)
        run.sync()
        return bool(on_device.sum().item() == 4 and on_host.sum().item() == 4)

    started = time.perf_counter()
    sockets = form()
    out: dict[str, Any] = {"backend": str(dist.get_backend_config()), "formed_s": round(time.perf_counter() - started, 3),
                           "collectives_ok": works()}
    took: list[float] = []
    watch = threading.Thread(target=lambda: took.append(_timed(lambda: process_group.end_group_connections(sockets))), name="leave-watch")
    watch.start()
    watch.join(60)
    out["abort_s"] = round(took[0], 3) if took else None
    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()
    started = time.perf_counter()
    form()
    out["reformed_s"] = round(time.perf_counter() - started, 3)
    out["reformed_collectives_ok"] = works()
    dist.destroy_process_group()
    return out


# -- replica agreement ----------------------------------------------------------------


def section_agreement(run: Run) -> dict[str, Any]:
    """Replica agreement on the device (checkpoint/rank/agreement.py): its words on the GPU equal the host's bit for
    bit (small tensors packed, large ones in blocks), one bit flipped on the GPU changes the rank's word, and what a
    check costs the host in ``unbroken.init``'s process group (``cpu:gloo,cuda:nccl``, world 1): started at one step
    and judged at the next, beside the previous design, which waited for the all-reduce at once (and so for every
    kernel queued before it)."""
    import torch
    import torch.distributed as dist

    from unbroken.checkpoint.rank import agreement
    from unbroken.plumbing.ports import free_port
    from unbroken.rank import process_group
    from unbroken.rank.env import GroupPlacement

    generator = torch.Generator(device=run.device).manual_seed(0)
    large = (GIB if run.cuda else 32 * MIB) // 8 // 4  # eight large float32 tensors
    state: dict[str, Any] = {f"small.{i}": torch.randn(1 + (97 * i) % 4096, device=run.device, generator=generator) for i in range(300)}
    state.update({f"large.{i}": torch.randn(large, device=run.device, generator=generator) for i in range(8)})
    tensors = [t for _, t in agreement.tensors_of(state)]
    on_device = agreement.tensor_words(tensors, run.device).cpu()
    on_host = agreement.tensor_words([t.cpu() for t in tensors], torch.device("cpu"))
    out: dict[str, Any] = {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors),
                           "device_words_equal_host": bool(torch.equal(on_device, on_host))}
    base = int(agreement.rank_word(on_device))
    flipped = {}
    for name in ("small.7", "large.3"):
        raw = state[name].view(torch.uint8)
        raw[5] ^= 16
        flipped[name] = int(agreement.rank_word(agreement.tensor_words(tensors, run.device))) != base
        raw[5] ^= 16
    out["flip_seen"] = all(flipped.values())

    placement = GroupPlacement(group_rank=0, nnodes=1, rendezvous=f"127.0.0.1:{free_port()}", rejoin_dir=run.work / "agreement",
                               collective_timeout=30.0)
    os.environ.update(placement.rank_environ(0, 1))
    process_group.init_process_group(None, 0, placement)
    work = StepWork(run, 0.005)
    try:
        waited, paid = [], []
        for step in range(23):
            work.queue()  # the step the check follows, queued
            waited.append(_timed(lambda step=step: agreement.compare(step, state)))
            run.sync()
            work.queue()
            started = time.perf_counter()
            flight = agreement.InFlight.start(step, state)
            start_s = time.perf_counter() - started
            work.queue()  # the next step: queued, and done (a loop's loss.item()) before its progress judges the check
            run.sync()
            started = time.perf_counter()
            verdict = flight.verdict()
            paid.append(start_s + time.perf_counter() - started)
            if not verdict.agreed:
                raise RuntimeError(f"a world of one disagreed with itself at step {step}")
        out["check_host_ms"] = round(1000 * median(paid[3:]), 3)
        out["check_waited_ms"] = round(1000 * median(waited[3:]), 3)
        out.update(agreement_loop(run, state))
    finally:
        dist.destroy_process_group()
    return out


def agreement_loop(run: Run, state: dict[str, Any]) -> dict[str, Any]:
    """A training loop's wall time with a check every 10 steps against none, interleaved trials: what replica
    agreement costs end to end on the device (its kernels on the GPU, its launches and verdict on the host). Each
    step is ``AGREEMENT_STEP_S`` of matmuls and ends as a loop's ``loss.item()`` does (the host waits for it)."""
    from unbroken.checkpoint.rank import agreement

    work = StepWork(run, AGREEMENT_STEP_S if run.cuda else 0.01)
    steps = 60 if run.cuda else 20

    def trial(every: int | None) -> float:
        flight = None
        run.sync()
        started = time.perf_counter()
        for step in range(steps):
            work.queue()
            if flight is not None:  # the progress after a check's step judges it
                if not flight.verdict().agreed:
                    raise RuntimeError(f"a world of one disagreed with itself at step {step}")
                flight = None
            if every is not None and step % every == 0:
                flight = agreement.InFlight.start(step, state)
            run.sync()
        if flight is not None:
            flight.verdict()
        return (time.perf_counter() - started) / steps

    trial(10)  # warm
    bare, checked = [], []
    for _ in range(3):
        bare.append(trial(None))
        checked.append(trial(10))
    overhead = [c / b - 1 for b, c in zip(bare, checked, strict=True)]
    return {"loop_step_s": median(bare), "loop_overhead_fraction": round(statistics.median(overhead), 5),
            "loop_overhead_trials": [round(o, 5) for o in overhead]}


def _timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


# -- step overhead --------------------------------------------------------------------


def section_overhead(run: Run) -> dict[str, Any]:
    import unbroken

    work = StepWork(run, 0.005)
    ctx = unbroken.init(init_process_group=False, structured_logs=False)
    steps = 200 if run.cuda else 50

    def loop(mode: str) -> float:
        run.sync()
        started = time.perf_counter()
        for step in range(steps):
            if mode == "sections":
                with ctx.section("data"):
                    pass
                with ctx.section("forward"):
                    work.queue()
                with ctx.section("backward", waits_on_peers=True):
                    pass
                with ctx.section("optimizer"):
                    pass
            else:
                work.queue()
            if mode != "bare":
                ctx.progress(step)
        run.sync()
        return (time.perf_counter() - started) / steps

    rounds: dict[str, list[float]] = {"bare": [], "progress": [], "sections": []}
    loop("sections")  # warm: CUDA events made, the first interval read
    for _ in range(5):
        for mode in rounds:
            rounds[mode].append(loop(mode))
    bare = statistics.median(rounds["bare"])
    out: dict[str, Any] = {"step_s": round(bare, 6), "steps": steps, "gpu_sections": ctx._gpu is not None}
    for mode in ("progress", "sections"):
        extra = statistics.median(rounds[mode]) - bare
        out[f"{mode}_us"] = round(extra * 1e6, 1)
        out[f"{mode}_fraction"] = round(extra / bare, 4)
    # the host's own cost, whatever the GPU hides of it: the same loops with nothing queued
    host: dict[str, float] = {}
    for mode in ("bare", "sections"):
        started = time.perf_counter()
        for step in range(1000):
            if mode == "sections":
                for name in ("data", "forward", "backward", "optimizer"):
                    with ctx.section(name):
                        pass
            ctx.progress(step)
        host[mode] = (time.perf_counter() - started) / 1000
    out["host_sections_us"] = round((host["sections"] - host["bare"]) * 1e6, 1)
    out["host_progress_us"] = round(host["bare"] * 1e6, 1)
    return out


# -- the host's own speeds ------------------------------------------------------------


def section_primitives(run: Run) -> dict[str, Any]:
    """What the memory tier's host work runs at on this machine: the ceilings its figures sit under."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    import torch
    import xxhash

    size = 1 * GIB if run.cuda else 64 * MIB
    data = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    out: dict[str, Any] = {"bytes": size}
    started = time.perf_counter()
    xxhash.xxh3_64(memoryview(data)).hexdigest()
    out["xxh3_GBps"] = round(size / (time.perf_counter() - started) / 1e9, 2)
    tensor = torch.from_numpy(data)
    started = time.perf_counter()
    tensor.view(torch.int64).view(-1, 1 << 17).sum(dim=1)
    out[f"int64_block_sums_GBps_{torch.get_num_threads()}_threads"] = round(size / (time.perf_counter() - started) / 1e9, 2)
    copy = np.empty_like(data)
    started = time.perf_counter()
    np.copyto(copy, data)
    out["memcpy_GBps"] = round(size / (time.perf_counter() - started) / 1e9, 2)
    path = Path(tempfile.mkdtemp(prefix="unbroken-gpu-prim-", dir="/dev/shm")) / "f"
    try:
        path.write_bytes(data.tobytes())
        fd = os.open(path, os.O_RDONLY)
        chunk = 32 * MIB
        for threads in (1, 3, 8):
            buffers = [np.empty(chunk, dtype=np.uint8) for _ in range(threads)]

            def read(i: int, buffers: list[Any] = buffers, threads: int = threads) -> None:
                for start in range(i * chunk, size, chunk * threads):
                    os.preadv(fd, [memoryview(buffers[i])[: min(chunk, size - start)]], start)

            started = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(read, range(threads)))
            out[f"pread_tmpfs_GBps_{threads}_threads"] = round(size / (time.perf_counter() - started) / 1e9, 2)
        os.close(fd)
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)
    return out


# -- the LLM job through the local cluster --------------------------------------------


def section_llm(run: Run) -> dict[str, Any]:
    from unbroken.controller import jobs, report
    from unbroken.runtime import fault_injection
    from unbroken.supervision.warm_spare import READY_MARK
    from unbroken.config.job import JobSpec
    from unbroken.data.prepare_text import prepare_text
    from unbroken.plumbing.waiting import wait_until

    layout, runtime, _ = run.cluster()
    store, backend = runtime.cluster, runtime.backend
    corpus = run.work / "corpus.txt"
    text = "\n".join(p.read_text(errors="replace") for p in sorted([REPO / "README.md", *REPO.glob("docs/*.md")]))
    corpus.write_text(text * (4 if run.cuda else 1))
    data = prepare_text([corpus], run.work / "tokens", vocab_size=2048, shard_tokens=2**20)
    del data
    # --step-time stands in for a bigger model's compute: a job with a warm spare must outlast its warming (~10 s)
    step_time = 0.1
    out: dict[str, Any] = {}
    for spares in (0, 1):
        name = f"llm-{'warm' if spares else 'cold'}"
        steps, kill_at = (300, 145) if run.cuda else ((300, 60) if spares else (100, 30))
        spec = JobSpec.model_validate({
            "name": name, "nodes": 1, "procs_per_node": max(1, run.gpus),
            "command": ["-m", "unbroken.workloads.llm", "--data", str(run.work / "tokens"), "--config", "small" if run.cuda else "tiny",
                        "--steps", str(steps), "--checkpoint-every", "20", "--global-batch", "8" if run.cuda else "4",
                        "--micro-batch", "8" if run.cuda else "2", "--log-every", "20", "--step-time", str(step_time)],
            "env": {"PYTHONWARNINGS": "ignore"},
            "resilience": {"auto_resume": True, "max_retry": 3, "hang_timeout": 120, "warm_spares": spares,
                           "require_deep_health_passed": False},
            "checkpoint": {"memory": {"keep": 2, "replicas": 0, "every_steps": 20}},
        })
        jobs.submit(store, spec, note="benchmarks/gpu.py")
        row: dict[str, Any] = {"warm_spares": spares}
        try:
            wait_until(lambda n=name, k=kill_at: jobs.current_step(backend.observe_attempt(n, 0)) >= k or store.get_job(n).phase.is_terminal,
                       600, f"{name} at step {kill_at}")
            if spares:
                spare_log = layout.node_dir(store.list_nodes()[0].name) / f"spares-{name}.log"
                wait_until(lambda p=spare_log: p.exists() and READY_MARK in p.read_text(errors="replace"), 180, "a ready warm spare")
            if store.get_job(name).phase.is_terminal:
                raise RuntimeError(f"{name} ended before the kill")
            target = fault_injection.pick_rank(runtime, name, rank=0)
            fault_injection.signal_rank(runtime, target, signal.SIGKILL, "ChaosKillWorker")
            job = wait_until(lambda n=name: (j := store.get_job(n)).phase.is_terminal and j, 600, f"{name} to end")
            row["phase"] = job.phase.value
            row["reason"] = job.reason[:200]
            summary = report.summarize(job, backend.worker_history(name), store.list_events(object_kind="Job", object_name=name))
            if summary.recoveries:
                r = summary.recoveries[0]
                row.update(kill_to_first_step_s=round(r.total_s, 2), detect_s=round(r.detected_at - r.fault_at, 2),
                           startup_s=round(r.first_step_at - r.scheduled_at, 2))
            row["steps_lost"] = summary.steps_lost
            row["attempts"] = job.attempt + 1
            ended = [e.message for e in store.list_events(object_kind="Job", object_name=name) if e.reason == "RanksEndedAfterFinishing"]
            row["ranks_ended_after_finishing"] = ended[:1]
            row["restart_timeline"] = restart_timeline(store, backend, name)
        except Exception as exc:  # noqa: BLE001 - the row says where it stopped
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
            job = store.get_job(name)
            row["phase"] = job.phase.value
        if row.get("phase") != "Succeeded" or "error" in row:
            row["logs"] = {str(path.relative_to(layout.root)): path.read_text(errors="replace")[-1500:]
                           for worker in backend.worker_history(name) if worker.log_dir
                           for path in sorted(Path(worker.log_dir).rglob("*.log"))[:6]}
        out[name] = row
    return out


def restart_timeline(store: Any, backend: Any, name: str) -> list[str]:
    """What the restarted attempt did, in order and relative to the fault: the job's events, its worker's start, and
    its rank's first log lines (where a cold start's seconds go)."""
    events = store.list_events(object_kind="Job", object_name=name)
    fault = next((e.ts for e in events if e.reason in ("JobRestarting", "ChaosKillWorker")), None)
    if fault is None:
        return []
    lines = [(e.ts, f"event {e.reason}: {e.message[:120]}") for e in events if e.ts >= fault - 1]
    for worker in backend.observe_attempt(name, 1):
        if worker.started_at:
            lines.append((worker.started_at, "worker started"))
        if worker.first_progress_at:
            lines.append((worker.first_progress_at, f"first step {worker.first_step}"))
        for path in sorted(Path(worker.log_dir or "/nonexistent").rglob("*.log")):
            for text in path.read_text(errors="replace").splitlines()[:12]:
                try:
                    record = json.loads(text)
                    stamp = datetime.fromisoformat(str(record["ts"]).replace("Z", "+00:00")).timestamp()
                except (ValueError, KeyError, TypeError, AttributeError):
                    record, stamp = {}, None
                if isinstance(record, dict) and "process_began" in record:
                    lines.append((float(record["process_began"]), "rank process began"))
                message = record.get("msg", text) if isinstance(record, dict) else text
                lines.append((stamp if stamp is not None else float("inf"), f"{path.name}: {str(message)[:160]}"))
    return [f"{'?' if at == float('inf') else f'{at - fault:+.2f}'} s {text}" for at, text in sorted(lines)][:60]


# -- the report -----------------------------------------------------------------------


SECTIONS: dict[str, Callable[[Run], dict[str, Any]]] = {
    "primitives": section_primitives, "readback": section_readback, "save": section_save, "dcp": section_dcp, "abort": section_abort,
    "overhead": section_overhead, "agreement": section_agreement, "health": section_health, "llm": section_llm,
}


def goals(sections: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's goals, each with the figure this run measured (None: not measured or failed)."""
    def get(*path: str) -> Any:
        value: Any = sections
        for key in path:
            if not isinstance(value, dict) or key not in value:
                return None
            value = value[key]
        return value

    big = next((k for k in ("8GiB", "32MiB") if get("save", k)), None)
    rows = [
        ("saves whose read-back differs, 20 saves of changing sizes, 3 in-process restarts", get("readback", "mismatched_saves"),
         "0", lambda v: v == 0),
        ("saves not recorded, same run", get("readback", "unrecorded_saves"), "0", lambda v: v == 0),
        ("stall of the first save of a slot (prepared ahead)", get("save", big or "", "first_stall_s"), "<= 0.010 s",
         lambda v: v <= 0.010),
        ("stall of a warm save", get("save", big or "", "warm_stall_s"), "<= 0.010 s", lambda v: v <= 0.010),
        ("step beside a warm save", get("save", big or "", "step_slowdown"), "<= +3 %", lambda v: v <= 0.03),
        ("save -> committed / pinned copy", get("save", big or "", "committed_over_pinned_copy"), "<= 3x", lambda v: v <= 3),
        ("restore to the device", get("save", big or "", "restore_device_s"), "<= 0.5 s", lambda v: v <= 0.5),
        ("LLM job, kill -> first step, warm spare", get("llm", "llm-warm", "kill_to_first_step_s"), "<= 2 s", lambda v: v <= 2),
        ("same, ended", get("llm", "llm-warm", "phase"), "Succeeded", lambda v: v == "Succeeded"),
        ("LLM job, kill -> first step, cold", get("llm", "llm-cold", "kill_to_first_step_s"), "<= 10 s", lambda v: v <= 10),
        ("dcp.async_save in unbroken's process group", get("dcp", "in_group_ok"), "works", lambda v: v is True),
        ("its blocking time / alone", _ratio(get("dcp", "in_group_blocking_s"), get("dcp", "alone_blocking_s")), "<= 1 (noise aside)",
         lambda v: v <= 1.2),
        ("healthy one-GPU node joins", get("health", "node_state"), "Schedulable", lambda v: v == "Schedulable"),
        ("four sections + progress, share of a ~5 ms step", get("overhead", "sections_fraction"), "<= 1 %", lambda v: v <= 0.01),
        ("replica agreement: the device's fingerprint words equal the host's", get("agreement", "device_words_equal_host"), "yes",
         lambda v: v is True),
        ("replica agreement: one bit flipped on the device is seen", get("agreement", "flip_seen"), "yes", lambda v: v is True),
        ("replica check of 1 GiB in 308 tensors, host ms (judged a step later)", get("agreement", "check_host_ms"),
         "below the previous design's wait", lambda v: v < (get("agreement", "check_waited_ms") or 0)),
        ("replica agreement end to end: a check of 1 GiB every 10 steps of 50 ms", get("agreement", "loop_overhead_fraction"),
         "<= 0.5 %", lambda v: v <= 0.005),
    ]
    return [{"figure": f, "measured": v, "goal": g, "met": None if v is None else bool(ok(v))} for f, v, g, ok in rows]


def _ratio(a: Any, b: Any) -> float | None:
    return round(a / b, 2) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def markdown(result: dict[str, Any]) -> str:
    lines = [f"Device: {result['device']}", "", "| figure | measured | goal | met |", "|---|---|---|---|"]
    for row in result["goals"]:
        met = "" if row["met"] is None else ("yes" if row["met"] else "**no**")
        lines.append(f"| {row['figure']} | {row['measured']} | {row['goal']} | {met} |")
    return "\n".join(lines) + "\n"


def describe_device(run: Run) -> str:
    import torch

    if not run.cuda:
        return f"CPU (--quick), torch {torch.__version__}"
    props = torch.cuda.get_device_properties(0)
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
    return f"{run.gpus}x {props.name} ({props.total_memory / GIB:.0f} GiB), torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="every section on the CPU at toy sizes (what the test suite runs)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--out", type=Path, help="also write gpu.json (after every section) and gpu.md here")
    parser.add_argument("--wheels", type=Path, help="a folder of carried wheels to install first (a machine with no network)")
    parser.add_argument("--print-wheels", action="store_true", help="print the pip download line for --wheels, and exit")
    parser.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}",
                        help="with --print-wheels: the GPU machine's Python (default: this one's)")
    parser.add_argument("--only", help=f"comma-separated sections, of: {', '.join(SECTIONS)}")
    parser.add_argument("--step-seconds", type=float, default=0.5, help="the training step a save runs beside (GPU)")
    parser.add_argument("--save-gib", default="2,8", help="the states the save section saves, in GiB (GPU); the last is restored")
    args = parser.parse_args()
    if args.print_wheels:
        print_wheels(args.python_version)
        return 0
    if args.wheels is not None:
        install_wheels(args.wheels)
    sys.path[:0] = [str(REPO / "src"), str(REPO / "benchmarks")]
    chosen = [s.strip() for s in args.only.split(",")] if args.only else list(SECTIONS)
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        parser.error(f"--only: unknown section(s) {', '.join(unknown)}; valid: {', '.join(SECTIONS)}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    # What the sections and the libraries print goes to stderr, at the descriptor (NCCL and children too): stdout
    # is the report's alone.
    sys.stdout.flush()
    report_out = os.dup(1)
    os.dup2(2, 1)
    with tempfile.TemporaryDirectory(prefix="unbroken-gpu-") as tmp:
        run = Run(args.quick, Path(tmp), args.step_seconds, [float(g) for g in args.save_gib.split(",")])
        result: dict[str, Any] = {"device": describe_device(run), "sections": {}, "goals": []}
        try:
            for name in chosen:
                started = time.monotonic()
                print(f"# {name} ...", file=sys.stderr, flush=True)
                try:
                    section = SECTIONS[name](run)
                except Exception as exc:  # noqa: BLE001 - one section's failure is its row, the others go on
                    section = {"error": f"{type(exc).__name__}: {exc}"[:600], "traceback": traceback.format_exc()[-3000:]}
                section["seconds"] = round(time.monotonic() - started, 1)
                result["sections"][name] = section
                print(f"# {name}: {json.dumps(section, default=str)[:2000]}", file=sys.stderr, flush=True)
                result["goals"] = goals(result["sections"])
                if args.out is not None:
                    (args.out / "gpu.json").write_text(json.dumps(result, indent=1, default=str))
        finally:
            run.close()
    if args.out is not None:
        (args.out / "gpu.md").write_text(markdown(result))
    sys.stdout.flush()
    os.dup2(report_out, 1)
    print(json.dumps(result, default=str) if args.json else markdown(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
