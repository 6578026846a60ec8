"""``torch.distributed.checkpoint`` through the tiers, with real ranks.

Each test runs a real ``CheckpointService`` (shard server, store, a reconcile loop in a
thread) and starts its ranks as real processes (this file run as a script, gloo on
localhost, torchrun's environment variables), each with its own ``TieredCheckpointer``
on the same shared-memory folder. Ranks and the test poll for commits, never sleep.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from unbroken.checkpoint.node import credentials, shm
from unbroken.checkpoint.node.credentials import Credentials
from unbroken.checkpoint.rank.dcp import TieredStager, TieredStorageReader, TieredStorageWriter
from unbroken.checkpoint.node.persistent import PersistentStore
from unbroken.config.checkpoint import TierPolicy
from unbroken.checkpoint.node.service import CheckpointService
from unbroken.checkpoint.rank.tiered import TieredCheckpointer
from unbroken.config.job import JobSpec
from unbroken.state.phases import JobPhase
from unbroken.state.records import Job
from unbroken.plumbing.waiting import wait_until
from unbroken.state.sqlite import SqliteStore

JOB = "j"
RANK_TIMEOUT = 120.0
COMMIT_TIMEOUT = 30.0


# -- shared by the test process and the ranks --------------------------------------------


def _poll(predicate: Callable[[], Any], what: str, timeout: float = COMMIT_TIMEOUT) -> Any:
    return wait_until(predicate, timeout, what, interval=0.02)


def _committed_in_memory(ck: TieredCheckpointer, step: int) -> None:
    ck.wait()
    _poll(lambda: ck.catalog().memory_step(step) is not None, f"step {step} committed in memory")


def _committed_in_persistent(ck: TieredCheckpointer, step: int) -> None:
    assert ck.policy.persistent is not None
    store = PersistentStore(ck.policy.persistent.uri)
    _poll(lambda: step in store.committed_steps(JOB), f"step {step} committed in the persistent tier")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _assert_same(got: Any, want: Any, where: str = "state") -> None:
    """Bit-exact equality of two nests (same dtypes, same bytes)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}"
        assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
        assert torch.equal(_bits(got), _bits(want)), f"{where}: values differ"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{where}: keys {sorted(got)} vs {sorted(want)}"
        for key in want:
            _assert_same(got[key], want[key], f"{where}.{key}")
    else:
        assert got == want, f"{where}: {got!r} vs {want!r}"


def _plain_state(step: int) -> dict[str, Any]:
    """DDP-style state: the same plain tensors on every rank (a function of the step only)."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "layer.weight": torch.randn(64, 32, generator=g),
            "layer.bias": torch.randn(64, generator=g),
            "embedding": torch.randn(100, 8, generator=g).to(torch.bfloat16),
        },
        "meta": {"epoch": step, "tag": f"step-{step}"},
    }


def _blank(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _blank(v) for k, v in state.items()}
    return type(state)() if isinstance(state, (int, str)) else None


# -- the ranks ----------------------------------------------------------------------------


class _DeferringPlanner(DefaultSavePlanner):
    """Overrides ``create_global_plan``: the writer then stages rank 0's shard in ``finish()``."""

    def create_global_plan(self, all_plans):  # type: ignore[no-untyped-def]
        return super().create_global_plan(all_plans)


def _checkpointer(cfg: dict[str, Any]) -> TieredCheckpointer:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return TieredCheckpointer(
        job=JOB, attempt=0, rank=rank, world_size=world, node="node-1", shm_root=Path(cfg["shm_root"]),
        policy=TierPolicy.model_validate_json(cfg["policy"]), endpoint=cfg["endpoint"],
        credentials=credentials.load(Path(cfg["credentials"])),
    )


def _rank_ddp(ck: TieredCheckpointer, cfg: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    early = TieredStorageWriter(ck, 1, rank_state={"rank": ck.rank, "seen": 10 * ck.rank})
    dcp.save(_plain_state(1), storage_writer=early)
    save_seconds = time.perf_counter() - started
    # The second save goes through a planner the writer cannot read the metadata from early.
    deferred = TieredStorageWriter(ck, 2, rank_state={"rank": ck.rank})
    dcp.save(_plain_state(2), storage_writer=deferred, planner=_DeferringPlanner())
    if ck.rank == 0:  # which path rank 0 took: its shard staged in write_data, or in finish()
        assert early._staged_metadata is not None and deferred._staged_metadata is None
    _committed_in_memory(ck, 2)

    target = _blank(_plain_state(2))
    reader = TieredStorageReader(ck)
    dcp.load(target, storage_reader=reader)
    assert reader.step == 2, reader.step
    _assert_same(target, _plain_state(2))
    assert reader.rank_state() == {"rank": ck.rank}

    older = _blank(_plain_state(1))
    reader = TieredStorageReader(ck, 1)
    dcp.load(older, storage_reader=reader)
    _assert_same(older, _plain_state(1))
    assert reader.rank_state() == {"rank": ck.rank, "seen": 10 * ck.rank}

    holders: dict[str, list[int]] = {}
    for step in (1, 2):
        for r in range(ck.world_size):
            loaded = ck.load_shard(step, r)
            assert loaded is not None
            for key, value in loaded.payload["state"]["items"].items():
                if isinstance(value, torch.Tensor):
                    holders.setdefault(f"{step}:{key}", []).append(r)
    return {"save_seconds": save_seconds, "holders": holders}


def _fsdp_model(seed: int, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 7))  # 7 rows: uneven shards
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 16)).sum().backward()  # one step, so the optimizer has state
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _full(state: Any) -> Any:
    """Every DTensor gathered to its full value (a collective: all ranks call it)."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return state.full_tensor()
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _full(v) for k, v in state.items()}
    if isinstance(state, list):
        return {str(i): _full(v) for i, v in enumerate(state)}
    return state


def _fsdp_load(ck: TieredCheckpointer, cfg: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer = _fsdp_model(seed=1, world=ck.world_size)  # other weights than the saved ones
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    reader = TieredStorageReader(ck)
    started = time.perf_counter()
    dcp.load(state, storage_reader=reader)
    load_seconds = time.perf_counter() - started
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    msd, osd = get_state_dict(model, optimizer)
    got = _full({"model": msd, "optim": osd})
    _assert_same(got, torch.load(cfg["expected"], weights_only=False))
    return {"step": reader.step, "sources": reader.sources, "load_seconds": load_seconds}


def _rank_fsdp_save(ck: TieredCheckpointer, cfg: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = _fsdp_model(seed=0, world=ck.world_size)
    msd, osd = get_state_dict(model, optimizer)
    expected = _full({"model": msd, "optim": osd})
    if ck.rank == 0:
        torch.save(expected, cfg["expected"])
    dcp.save({"model": msd, "optim": osd}, storage_writer=TieredStorageWriter(ck, 1))
    _committed_in_memory(ck, 1)
    return _fsdp_load(ck, cfg)


def _sharded_state(step: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(step)
    full = torch.randn(10, 6, generator=g)
    return {"w": distribute_tensor(full, init_device_mesh("cpu", (world,)), [Shard(0)]), "b": torch.randn(6, generator=g), "count": step}


def _rank_async(ck: TieredCheckpointer, cfg: dict[str, Any]) -> dict[str, Any]:
    stager = TieredStager()
    pointers = []
    stalls = []
    for step in (1, 2):
        live = _sharded_state(step, ck.world_size)
        started = time.perf_counter()
        future = dcp.async_save(live, storage_writer=TieredStorageWriter(ck, step, stager=stager), async_stager=stager)
        stalls.append(time.perf_counter() - started)
        assert isinstance(future, Future), type(future)
        with torch.no_grad():  # training goes on: the staged copy must not see this
            live["w"].to_local().add_(1000.0)
            live["b"].add_(1000.0)
        future.result()
        pointers.append({"/".join(map(str, path)): buffer.data_ptr() for path, buffer in stager.buffers.items()})
    assert pointers[0] and pointers[0] == pointers[1], pointers
    _committed_in_memory(ck, 2)

    for step in (2, 1):
        want = _sharded_state(step, ck.world_size)
        target = {"w": torch.zeros_like(want["w"]), "b": torch.zeros_like(want["b"]), "count": 0}
        dcp.load(target, storage_reader=TieredStorageReader(ck, step))
        _assert_same(target["w"].to_local(), want["w"].to_local(), f"step {step} w")
        _assert_same(target["b"], want["b"], f"step {step} b")
        assert target["count"] == step
    stager.close()
    return {"stall_seconds": stalls, "buffers": sorted(pointers[0])}


def _rank_two_steps(ck: TieredCheckpointer, cfg: dict[str, Any]) -> dict[str, Any]:
    dcp.save(_plain_state(2), storage_writer=TieredStorageWriter(ck, 2))
    _committed_in_memory(ck, 2)
    _committed_in_persistent(ck, 2)  # drained before step 3, which the persistent tier skips
    dcp.save(_plain_state(3), storage_writer=TieredStorageWriter(ck, 3))
    _committed_in_memory(ck, 3)
    return {}


SCENARIOS: dict[str, Callable[[TieredCheckpointer, dict[str, Any]], dict[str, Any]]] = {
    "ddp": _rank_ddp, "fsdp_save": _rank_fsdp_save, "fsdp_load": _fsdp_load, "async": _rank_async, "two_steps": _rank_two_steps,
}


def _rank_main(scenario: str, cfg: dict[str, Any]) -> None:
    ck = _checkpointer(cfg)
    try:
        result = SCENARIOS[scenario](ck, cfg)
        dist.barrier()
    finally:
        ck.close()
        dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)


# -- the test side -------------------------------------------------------------------------


@dataclass
class Tiers:
    tmp: Path
    shm_root: Path
    spec: JobSpec
    service: CheckpointService
    store: SqliteStore
    credentials: Credentials

    @property
    def policy(self) -> TierPolicy:
        tiers = self.spec.checkpoint.tiers
        assert tiers is not None
        return tiers

    @property
    def endpoint(self) -> str:
        assert self.service.server is not None
        return self.service.server.address

    def checkpointer(self, rank: int = 0, world_size: int = 1) -> TieredCheckpointer:
        return TieredCheckpointer(job=JOB, attempt=0, rank=rank, world_size=world_size, node="node-1", shm_root=self.shm_root,
                                  policy=self.policy, endpoint=self.endpoint, credentials=self.credentials)

    def ranks(self, scenario: str, world: int, **extra: Any) -> list[dict[str, Any]]:
        """Run ``world`` ranks of ``scenario``; each rank's result."""
        cfg = {"shm_root": str(self.shm_root), "policy": self.policy.model_dump_json(), "endpoint": self.endpoint,
               "credentials": str(self.credentials.cert.parent), **extra}
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for rank in range(world):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen([sys.executable, __file__, scenario, json.dumps(cfg)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = []
        try:
            for proc in procs:
                out, _ = proc.communicate(timeout=RANK_TIMEOUT)
                outputs.append(out)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
        assert not failed, f"ranks failed {failed}:\n" + "\n".join(f"--- rank {r}:\n{o[-4000:]}" for r, o in enumerate(outputs))
        return [json.loads(o.rsplit("RESULT ", 1)[1]) for o in outputs]


@pytest.fixture
def make_tiers(tmp_path: Path, cluster_credentials: Credentials) -> Iterator[Callable[..., Tiers]]:
    made: list[tuple[Tiers, threading.Event, threading.Thread]] = []

    def make(checkpoint: dict[str, Any] | None = None) -> Tiers:
        checkpoint = checkpoint or {"memory": {"keep": 2}, "persistent": {"uri": f"file://{tmp_path}/persist", "every_steps": 1}}
        spec = JobSpec.model_validate({"name": JOB, "command": ["x.py"], "checkpoint": checkpoint}, context={"trusted": True})
        store = SqliteStore(tmp_path / "state.db", create=True)
        store.add_job(Job(name=JOB, spec_json=spec.model_dump_json(), phase=JobPhase.RUNNING))
        shm_root = Path(tempfile.mkdtemp(prefix="unbroken-dcp-test-", dir="/dev/shm"))
        service = CheckpointService(store, store, "node-1", shm_root, cluster_credentials)
        service.start()
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(0.05):
                service.reconcile()

        thread = threading.Thread(target=loop, name="ckpt-service", daemon=True)
        thread.start()
        tiers = Tiers(tmp_path, shm_root, spec, service, store, cluster_credentials)
        made.append((tiers, stop, thread))
        return tiers

    yield make
    for tiers, stop, thread in made:
        stop.set()
        thread.join(timeout=30)
        tiers.service.close()
        shutil.rmtree(tiers.shm_root, ignore_errors=True)


def _flip_first_byte(shm_root: Path, step: int, rank: int) -> None:
    [stored] = [s for s in shm.scan(shm_root, JOB) if s.info.step == step and s.info.rank == rank and not s.held]
    with open(stored.path, "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))


def test_ddp_state_round_trips_and_is_written_once(make_tiers) -> None:
    tiers = make_tiers()
    results = tiers.ranks("ddp", 2)
    holders = results[0]["holders"]
    tensors = {f"{step}:model.{name}@{','.join('0' * t.dim())}" for step in (1, 2) for name, t in _plain_state(step)["model"].items()}
    assert set(holders) == tensors
    assert all(len(ranks) == 1 for ranks in holders.values()), holders  # one copy of each replicated tensor
    assert {r for ranks in holders.values() for r in ranks} == {0, 1}  # spread over the ranks, not all on rank 0


def test_fsdp2_round_trips_and_reshards_to_one_rank(make_tiers, tmp_path: Path) -> None:
    """FSDP2 (``fully_shard``) runs on CPU with gloo in this torch: model + AdamW state, uneven shards."""
    tiers = make_tiers()
    expected = str(tmp_path / "expected.pt")
    two = tiers.ranks("fsdp_save", 2, expected=expected)
    assert [r["step"] for r in two] == [1, 1]
    assert all(s.startswith("memory on node-1") for r in two for s in r["sources"].values())
    [one] = tiers.ranks("fsdp_load", 1, expected=expected)  # a 2-rank step loaded by 1 rank
    assert one["step"] == 1 and sorted(one["sources"]) == ["0", "1"]


def test_async_save_with_the_stager_reuses_its_buffers(make_tiers) -> None:
    tiers = make_tiers()
    results = tiers.ranks("async", 2)
    assert results[0]["buffers"] == ["b", "w"]


def test_restore_falls_back_to_an_older_step_then_to_the_persistent_copy(make_tiers, tmp_path: Path) -> None:
    """Step 3 is only in memory (persistent every 2 steps); step 2 is in memory and persistent.
    A corrupt step-3 shard makes the reader take step 2 from memory; once step 2's memory copy
    is corrupt too, that shard comes from the persistent tier."""
    tiers = make_tiers({"memory": {"keep": 2}, "persistent": {"uri": f"file://{tmp_path}/persist", "every_steps": 2}})
    tiers.ranks("two_steps", 2)
    ck = tiers.checkpointer()
    try:
        _flip_first_byte(tiers.shm_root, 3, 1)
        target = _blank(_plain_state(2))
        reader = TieredStorageReader(ck)
        dcp.load(target, storage_reader=reader, no_dist=True)
        assert reader.step == 2
        _assert_same(target, _plain_state(2))
        assert all(s.startswith("memory") for s in reader.sources.values()), reader.sources

        _flip_first_byte(tiers.shm_root, 2, 1)
        target = _blank(_plain_state(2))
        reader = TieredStorageReader(ck)
        dcp.load(target, storage_reader=reader, no_dist=True)
        assert reader.step == 2
        _assert_same(target, _plain_state(2))
        assert reader.sources[0].startswith("memory") and reader.sources[1].startswith("persistent"), reader.sources
    finally:
        ck.close()



@pytest.mark.parametrize(("memory", "step", "message"), [
    ({"every_steps": 5}, 7, "step 7 is not taken by the memory tier"),
    ({"every_seconds": 60}, 5, "without every_seconds"),
])
def test_a_save_the_memory_tier_would_skip_fails_before_writing(make_tiers, memory, step, message) -> None:
    tiers = make_tiers({"memory": memory})
    ck = tiers.checkpointer()
    try:
        with pytest.raises(CheckpointException) as raised:  # DCP wraps each rank's error
            dcp.save(_plain_state(step), storage_writer=TieredStorageWriter(ck, step), no_dist=True)
        assert message in str(raised.value.failures[0])
        assert not shm.scan(tiers.shm_root, JOB)
    finally:
        ck.close()

if __name__ == "__main__":
    _rank_main(sys.argv[1], json.loads(sys.argv[2]))
    # Everything is checked, reported and closed. Skip the C++ static destructors: after
    # async_save, torch 2.13 occasionally aborts there ("terminate called without an
    # active exception", a joinable thread of its async machinery), which says nothing
    # about the checkpoint and would fail the test at random.
    sys.stdout.flush()
    os._exit(0)
