"""The tiered checkpointer end to end in one process: real shared memory, real agents' services
(shard servers on loopback, the sqlite store), real persistent tiers (file://, tmpfs mounts,
moto's S3 server) and a real rank process killed with SIGKILL.

Each test plays both sides: ranks (``TieredCheckpointer``) and node agents
(``CheckpointService.reconcile``, called here instead of by the agent's loop).
"""

from __future__ import annotations

import contextlib
import http.client
import mmap
import os
import random
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from unbroken.plumbing.waiting import wait_until
from s3 import empty_and_delete_bucket
from cuda_rules import RuleKeepingCuda
from test_file_checkpoint import Reports, assert_same, sample_state

from unbroken.checkpoint.node import drain as drain_module
from unbroken.checkpoint.format import shard
from unbroken.checkpoint.node import shm
from unbroken.checkpoint.format.manifest import ShardInfo
from unbroken.checkpoint.node.credentials import Credentials
from unbroken.checkpoint.node.peer import SHARD_HEADER, AuthError, PeerClient, ShardServer
from unbroken.checkpoint.node.persistent import PersistentStore
from unbroken.checkpoint.node.service import CheckpointService
from unbroken.checkpoint.node.cuda_host import PinnedMemory
from unbroken.checkpoint.rank.tiered import TieredCheckpointer
from unbroken.config.job import JobSpec
from unbroken.errors import CheckpointError
from unbroken.state.phases import DeepHealthStatus, JobPhase, NodeState
from unbroken.state.records import CheckpointStep, CheckpointTier, EventType, Job, Node, StepStatus
from unbroken.state.sqlite import SqliteStore
from unbroken.state.updates import JobUpdate, NodeUpdate

SRC = Path(__file__).resolve().parents[2] / "src"
MEMORY, REPLICA, PERSISTENT = CheckpointTier.MEMORY, CheckpointTier.REPLICA, CheckpointTier.PERSISTENT


# -- the rig: one store, one service per node, checkpointers for ranks ---------------------------


@dataclass
class Rig:
    tmp: Path
    shm: Path
    store: SqliteStore
    spec: JobSpec
    services: dict[str, CheckpointService]
    credentials: Credentials
    checkpointers: list[TieredCheckpointer] = field(default_factory=list)
    job: str = "j"
    serial: bool = True
    """Let each agent's background upload finish before the next pass: agents racing to commit the
    same persistent step is its own test (a known bug), not something every test should trip on."""

    def root(self, node: str) -> Path:
        return self.shm / node

    def checkpointer(self, *, node: str = "node-1", attempt: int = 0, rank: int = 0, world_size: int = 1,
                     agent: bool = True, shm_root: Path | None = None, pinning: PinnedMemory | None = None) -> TieredCheckpointer:
        service = self.services.get(node)
        ck = TieredCheckpointer(
            job=self.job, attempt=attempt, rank=rank, world_size=world_size, node=node,
            shm_root=shm_root or self.root(node), policy=self.spec.checkpoint.tiers,
            endpoint=service.server.address if agent and service and service.server else None, credentials=self.credentials,
            save_wait_seconds=5.0, pinning=pinning,
        )
        self.checkpointers.append(ck)
        return ck

    def reconcile(self) -> None:
        for service in self.services.values():
            if self.serial:
                self.wait_idle()
            service.reconcile()

    def settle(self, predicate: Callable[[], Any], what: str, timeout: float = 15.0) -> Any:
        """Run agent passes until ``predicate`` holds (the agents' loop, driven by the test)."""
        def one_pass() -> Any:
            self.reconcile()
            return predicate()
        return wait_until(one_pass, timeout, what, interval=0.02)

    def rows(self, tier: CheckpointTier) -> list[CheckpointStep]:
        return self.store.list_checkpoint_steps(self.job, tier=tier)

    def steps(self, tier: CheckpointTier, status: StepStatus = StepStatus.COMMITTED) -> list[int]:
        return [r.step for r in self.rows(tier) if r.status is status]

    def row(self, tier: CheckpointTier, step: int) -> CheckpointStep | None:
        return next((r for r in self.rows(tier) if r.step == step), None)

    def copies(self, tier: CheckpointTier, step: int | None = None) -> list[tuple[int, int, str]]:
        return [(c.step, c.rank, c.node) for c in self.store.list_shard_copies(self.job, step=step, tier=tier)]

    def save(self, ck: TieredCheckpointer, step: int, state: dict[str, Any], *, replicas: int = 0,
             persistent: bool = False) -> None:
        """Save, then run agent passes until the step is committed in memory (and replicated/drained)."""
        ck.save(step, state)
        ck.wait()

        def done() -> bool:
            if step not in self.steps(MEMORY):
                return False
            if replicas and len({c for c in self.copies(REPLICA, step) if c[1] == ck.rank}) < replicas:
                return False
            return not persistent or step in self.steps(PERSISTENT)
        self.settle(done, f"step {step} committed (replicas={replicas}, persistent={persistent})")

    def own(self, step: int, *, node: str = "node-1", rank: int = 0) -> shm.StoredShard:
        return next(s for s in shm.scan(self.root(node), self.job) if not s.held and s.info.step == step and s.info.rank == rank)

    def held(self, step: int, *, node: str = "node-2", rank: int = 0) -> shm.StoredShard:
        return next(s for s in shm.scan(self.root(node), self.job) if s.held and s.info.step == step and s.info.rank == rank)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until no service has a replication or drain thread running."""
        def idle() -> bool:
            return not any(s._replicator.busy() or s._drainer.busy() for s in self.services.values())
        wait_until(idle, timeout, "checkpoint services idle", interval=0.02)


def job_spec(memory: dict[str, Any], persistent: dict[str, Any] | None = None) -> JobSpec:
    checkpoint: dict[str, Any] = {"memory": memory}
    if persistent is not None:
        checkpoint["persistent"] = persistent
    return JobSpec.model_validate({"name": "j", "command": ["x.py"], "checkpoint": checkpoint}, context={"trusted": True})


@pytest.fixture
def make_rig(tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch,
             cluster_credentials: Credentials) -> Iterator[Callable[..., Rig]]:
    """Rigs torn down before ``monkeypatch`` is undone: agents' threads still see the test's AWS settings."""
    rigs: list[Rig] = []

    def make(memory: dict[str, Any] | None = None, persistent: dict[str, Any] | None = None,
             nodes: tuple[str, ...] = ("node-1", "node-2")) -> Rig:
        spec = job_spec({"keep": 2, "replicas": 1} if memory is None else memory, persistent)
        store = SqliteStore(tmp_path / "state.db", create=True)
        store.add_job(Job(name="j", spec_json=spec.model_dump_json(), phase=JobPhase.RUNNING))
        services: dict[str, CheckpointService] = {}
        for name in nodes:
            store.add_node(Node(name=name, group="g", instance_type="cpu-dev", state=NodeState.SCHEDULABLE,
                                deep_health=DeepHealthStatus.PASSED, heartbeat_at=time.time()))
        rig = Rig(tmp_path, shm_dir, store, spec, services, cluster_credentials)
        rigs.append(rig)
        for name in nodes:  # every agent has its own connection to the store, as separate processes do
            own = SqliteStore(tmp_path / "state.db")
            services[name] = CheckpointService(own, own, name, shm_dir / name, cluster_credentials)
            services[name].start()
        return rig

    yield make
    for rig in rigs:
        for ck in rig.checkpointers:
            ck.close()
        rig.wait_idle()
        for service in rig.services.values():
            service.close()


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def tensor_offset(info: ShardInfo) -> int:
    """An offset inside the stored bits of the shard's largest tensor: the shard still parses."""
    largest = max(info.tensors, key=lambda t: t.nbytes)
    return largest.offset + largest.nbytes // 2


def slot_files(root: Path, rank: int) -> list[Path]:
    return sorted(shm.own_dir(root, "j").glob(f"a*-r{rank:05d}-s*.slot"))


def file_checksum(fd: int, size: int) -> str:
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as view:
        return shard.checksum(view, size)


def small_state(step: int, rank: int = 0, n: int = 1000) -> dict[str, Any]:
    return {"step": step, "rank": rank, "w": torch.full((n,), float(step)) + rank, "ids": torch.arange(n) * step}


# -- 1. memory round trip ----------------------------------------------------------------------


def test_memory_round_trip_restores_the_newest_step_bit_exact_and_its_rng(make_rig, capsys) -> None:
    rig = make_rig()
    ck = rig.checkpointer()
    for step in (10, 20):
        rig.save(ck, step, sample_state(step), replicas=1)
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    rig.save(ck, 30, sample_state(30), replicas=1)

    def draw() -> tuple[torch.Tensor, float, np.ndarray]:
        return torch.rand(6), random.random(), np.random.rand(4)

    first = draw()
    assert not torch.equal(draw()[0], first[0]), "the generators moved on"

    reports = Reports()
    ck.observer = reports
    restored = ck.restore()

    assert restored is not None and restored.step == 30
    assert restored.source == "memory on node-1"
    assert_same(restored.state, sample_state(30))
    assert [(r.step, r.source) for r in reports.restores] == [(30, "memory")]
    again = draw()
    assert torch.equal(again[0], first[0]) and again[1] == first[1] and np.array_equal(again[2], first[2])
    assert "restored step 30 from memory on node-1" in capsys.readouterr().out

    # The restored tensors are copies: rewriting every slot afterwards does not change them.
    for step in (40, 50, 60):
        rig.save(ck, step, sample_state(step))
    assert_same(restored.state, sample_state(30))

    # A rank of the next attempt (a new process) finds the newest step the same way.
    rig.store.update_job("j", JobUpdate(attempt=1))
    restored = rig.checkpointer(attempt=1).restore()
    assert restored is not None and restored.step == 60 and restored.source == "memory on node-1"
    assert_same(restored.state, sample_state(60))


def trained_model(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and an SGD-with-momentum optimizer after one step (momentum buffers exist), grads left set."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(8, width)).square().mean().backward()
        optimizer.step()
    return model, optimizer


def test_a_restore_to_the_device_streams_the_shard_through_pinned_buffers_and_refuses_a_flipped_byte(
        make_rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, ``restore(device="cuda")`` reads the shard file into pinned buffers and copies them to the device,
    checksumming on the way (device_restore.py); here a CPU target plays the device, with the stand-in runtime."""
    from unbroken.checkpoint.rank import device_restore

    from unbroken.checkpoint.format import integrity

    # many chunks: the ring of buffers goes round, and the readers hash chunk by chunk
    monkeypatch.setattr(device_restore, "CHUNK_BYTES", 1 << 20)
    monkeypatch.setattr(integrity, "CHUNK_BYTES", 1 << 20)
    cuda = RuleKeepingCuda()
    rig = make_rig({"keep": 2, "replicas": 0})
    first = rig.checkpointer(pinning=PinnedMemory(cuda))
    older, newer = sample_state(1), sample_state(2)
    older["big"], newer["big"] = torch.randn(2_000_000), torch.randn(2_000_000)
    rig.save(first, 1, older)
    saved_rng = torch.get_rng_state()  # what the next save captures
    rig.save(first, 2, newer)

    torch.manual_seed(0)
    restored = rig.checkpointer(attempt=1, pinning=PinnedMemory(cuda)).restore(device="cpu")
    assert restored is not None and restored.step == 2
    assert_same(restored.state, newer)
    assert cuda.copies_to_device >= 8, "the state went through the pinned buffers, chunk by chunk"
    assert torch.equal(torch.get_rng_state(), saved_rng), "the RNG state came back too (kept on the host)"

    flip_byte(rig.own(2).path, tensor_offset(rig.own(2).info))
    again = rig.checkpointer(attempt=2, pinning=PinnedMemory(cuda)).restore(device="cpu")
    assert again is not None and again.step == 1, "the checksum taken on the way refused the flipped shard"
    assert_same(again.state, older)


def test_an_overlapped_save_keeps_the_values_at_its_step_while_the_optimizer_moves_on(make_rig) -> None:
    """save() returns before its copy is done; the next optimizer.step() waits for the copy (the global pre-hook),
    so the checkpoint holds the parameters and momentum of the save step, bit for bit, not the step after."""
    rig = make_rig({"keep": 2, "replicas": 0})
    ck = rig.checkpointer()
    model, optimizer = trained_model(4096)  # 64 MiB of weights + 64 MiB of momentum: a copy of tens of ms
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    expected = {"model": type(state["model"])((k, v.clone()) for k, v in state["model"].items()),
                "momentum": [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]}

    reports = Reports()
    ck.observer = reports
    ck.save(5, state)
    assert reports.saves == [], "told once its stall is known, at the fence"
    optimizer.step()  # straight away, with the grads still set: changes every weight and buffer in place
    assert ck.last_fence_seconds > 0, "the step had to wait: save() returned before its copy was done"
    [save] = reports.saves  # the agent's stall metric and badput see the fence's wait too
    assert (save.step, save.stall_seconds) == (5, ck.last_stall_seconds) and save.stall_seconds > ck.last_fence_seconds
    assert not torch.equal(model[0].weight, expected["model"]["0.weight"]), "the step did change the weights"
    for _ in range(3):  # and training goes on
        optimizer.zero_grad()
        model(torch.randn(8, 4096)).square().mean().backward()
        optimizer.step()
    ck.wait()
    rig.settle(lambda: 5 in rig.steps(MEMORY), "step 5 committed")

    rig.store.update_job("j", JobUpdate(attempt=1))
    restored = rig.checkpointer(attempt=1).restore()
    assert restored is not None and restored.step == 5
    assert_same(restored.state["model"], expected["model"])
    saved_momentum = [entry["momentum_buffer"] for entry in restored.state["optim"]["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(saved_momentum, expected["momentum"], strict=True))


def test_a_change_outside_the_optimizer_after_fence_is_not_in_the_checkpoint(make_rig) -> None:
    rig = make_rig({"keep": 2, "replicas": 0})
    ck = rig.checkpointer()
    weights = torch.randn(32 * 1024 * 1024)  # 128 MiB
    expected = weights.clone()
    ck.save(7, {"w": weights})
    ck.fence()
    assert ck.last_stall_seconds >= ck.last_fence_seconds > 0
    weights.add_(1.0)  # a manual update, as a script may do between steps
    ck.wait()
    rig.settle(lambda: 7 in rig.steps(MEMORY), "step 7 committed")
    rig.store.update_job("j", JobUpdate(attempt=1))
    restored = rig.checkpointer(attempt=1).restore()
    assert restored is not None and torch.equal(restored.state["w"], expected)


def test_a_checkpointer_that_is_closed_is_no_longer_fenced(make_rig) -> None:
    from unbroken.checkpoint.rank import fence

    rig = make_rig({"keep": 2, "replicas": 0})
    ck = rig.checkpointer()
    assert ck in fence._live
    ck.close()
    assert ck not in fence._live
    _, optimizer = trained_model(16)
    optimizer.step()  # the hook has nothing to wait for and must not touch a closed checkpointer


def test_restore_with_nothing_saved_is_a_fresh_start(make_rig) -> None:
    rig = make_rig()
    assert rig.checkpointer().restore() is None


# -- 2. retention ------------------------------------------------------------------------------


def test_retention_keeps_exactly_the_newest_two_steps_and_bounded_slots(make_rig) -> None:
    rig = make_rig({"keep": 2, "replicas": 1})
    ranks = [rig.checkpointer(rank=r, world_size=2) for r in (0, 1)]
    for step in range(1, 10):
        for ck in ranks:
            ck.save(step, small_state(step, ck.rank))
        for ck in ranks:
            ck.wait()
        rig.settle(lambda s=step: s in rig.steps(MEMORY) and len(rig.copies(REPLICA, s)) == 2, f"step {step} committed and replicated")

        assert rig.steps(MEMORY) == [s for s in (step, step - 1) if s >= 1]
        for rank in (0, 1):
            slots = slot_files(rig.root("node-1"), rank)
            assert len(slots) <= 2 + 2, f"rank {rank} has {len(slots)} slots: {[p.name for p in slots]}"
        held = sorted(s.info.step for s in shm.scan(rig.root("node-2"), "j") if s.held and s.info.rank == 0)
        assert held == sorted(s for s in (step, step - 1) if s >= 1), f"replicas held on node-2: {held}"

    for ck in ranks:
        loaded = ck.load_shard(9, ck.rank)
        assert loaded is not None and loaded.source == "memory on node-1"
        assert_same(loaded.payload["state"], small_state(9, ck.rank))
        assert ck.load_shard(7, ck.rank) is None, "step 7 was retired"


def test_restore_of_a_second_rank_without_torch_distributed(make_rig) -> None:
    rig = make_rig({"keep": 2, "replicas": 0})
    ranks = [rig.checkpointer(rank=r, world_size=2) for r in (0, 1)]
    for ck in ranks:
        ck.save(3, small_state(3, ck.rank))
        ck.wait()
    rig.settle(lambda: rig.steps(MEMORY) == [3], "step 3 committed")
    restored = ranks[1].restore()
    assert restored is not None and restored.step == 3
    assert_same(restored.state, small_state(3, 1))


def test_a_reader_holding_a_slot_neither_blocks_saves_nor_sees_its_bytes_rewritten(make_rig) -> None:
    rig = make_rig({"keep": 2, "replicas": 0})
    ck = rig.checkpointer()
    rig.save(ck, 1, small_state(1))
    stored = rig.own(1)

    # A replication or drain reading step 1's slot (LOCK_SH held) while training goes on.
    with shm.SharedRead(stored) as read:
        assert read.ok
        for step in range(2, 10):
            rig.save(ck, step, small_state(step))
            committed = rig.steps(MEMORY)
            assert committed == [step, step - 1], f"after step {step}: {committed}"
            for s in committed:  # every committed step is still whole in memory
                loaded = ck.load_shard(s, 0)
                assert loaded is not None and loaded.source == "memory on node-1", f"step {s} not loadable"
            assert len(slot_files(rig.root("node-1"), 0)) <= 2 + 2
        assert file_checksum(read.fd, stored.info.size) == stored.info.checksum, "the slot was rewritten under its reader"
        with mmap.mmap(read.fd, stored.info.size, access=mmap.ACCESS_COPY) as view:
            payload = shard.read(view, stored.info.metas(), stored.info.skeleton_offset, stored.info.size)
        assert_same(payload["state"], small_state(1))

    rig.save(ck, 10, small_state(10))
    assert rig.steps(MEMORY) == [10, 9]
    assert len(slot_files(rig.root("node-1"), 0)) <= 2 + 2


def test_when_readers_hold_every_free_slot_the_save_is_skipped_not_blocked_forever(make_rig, capsys) -> None:
    # keep 1: six slots at most (1 kept + 1 being written + 4 held by readers)
    rig = make_rig({"keep": 1, "replicas": 0})
    ck = rig.checkpointer()
    ck.save_wait_seconds = 0.2
    with contextlib.ExitStack() as readers:
        for step in (1, 2, 3, 4, 5):
            rig.save(ck, step, small_state(step))
            reading = readers.enter_context(shm.SharedRead(rig.own(step)))
            assert reading.ok
        rig.save(ck, 6, small_state(6))
        assert len(slot_files(rig.root("node-1"), 0)) == 6
        # The only unlocked slot holds step 6, the newest: it is never overwritten.
        ck.save(7, small_state(7))
        ck.wait()
        assert "step 7 not checkpointed" in capsys.readouterr().out
        for _ in range(3):
            rig.reconcile()
        assert rig.steps(MEMORY) == [6]
        loaded = ck.load_shard(6, 0)
        assert loaded is not None
        assert_same(loaded.payload["state"], small_state(6))
        assert len(slot_files(rig.root("node-1"), 0)) == 6
    rig.save(ck, 8, small_state(8))
    restored = ck.restore()
    assert restored is not None and restored.step == 8


# -- 3. a flipped byte in each tier ------------------------------------------------------------


def test_flipped_byte_in_memory_then_in_the_replica_falls_back_to_replica_then_persistent(
    make_rig, tmp_path: Path, capsys
) -> None:
    rig = make_rig({"keep": 2, "replicas": 1}, {"uri": f"file://{tmp_path}/persist", "every_steps": 1, "keep": 3})
    ck = rig.checkpointer()
    for step in (1, 2, 3):
        rig.save(ck, step, sample_state(step), replicas=1, persistent=True)
    capsys.readouterr()

    own = rig.own(3)
    flip_byte(own.path, tensor_offset(own.info))
    restored = ck.restore()
    assert restored is not None and restored.step == 3 and restored.source == "replica on node-2"
    assert_same(restored.state, sample_state(3))
    out = capsys.readouterr().out
    assert f"{own.path}: checksum mismatch" in out, out

    held = rig.held(3)
    flip_byte(held.path, tensor_offset(held.info))
    restored = ck.restore()
    assert restored is not None and restored.step == 3
    assert restored.source == f"persistent file://{rig.tmp}/persist"
    assert_same(restored.state, sample_state(3))
    out = capsys.readouterr().out
    assert "replica on node-2" in out and "checksum mismatch" in out, out


def test_flipped_byte_in_memory_and_replica_without_persistent_falls_back_to_the_older_step(make_rig, capsys) -> None:
    rig = make_rig({"keep": 2, "replicas": 1})
    ck = rig.checkpointer()
    for step in (1, 2):
        rig.save(ck, step, sample_state(step), replicas=1)
    for stored in (rig.own(2), rig.held(2)):
        flip_byte(stored.path, tensor_offset(stored.info))
    restored = ck.restore()
    assert restored is not None and restored.step == 1 and restored.source == "memory on node-1"
    assert_same(restored.state, sample_state(1))
    assert "step 2 is not restorable on every rank; trying an older step" in capsys.readouterr().out


def test_flipped_byte_in_the_persistent_shard_with_empty_memory_falls_back_to_the_previous_persistent_step(
    make_rig, tmp_path: Path, capsys
) -> None:
    persist = tmp_path / "persist"
    rig = make_rig({"keep": 2, "replicas": 0}, {"uri": f"file://{persist}", "every_steps": 1, "keep": 3})
    ck = rig.checkpointer()
    for step in (1, 2, 3):
        rig.save(ck, step, sample_state(step), persistent=True)
    newest = persist / "j" / "step-000000003" / "rank-00000.shard"
    info = PersistentStore(f"file://{persist}").manifest("j", 3).shard(0)
    flip_byte(newest, tensor_offset(info))
    capsys.readouterr()

    # A replacement node: empty shared memory and no agent catalog, only the persistent tier.
    fresh = rig.checkpointer(node="node-9", attempt=1, agent=False, shm_root=rig.shm / "node-9")
    restored = fresh.restore()

    assert restored is not None and restored.step == 2
    assert restored.source == f"persistent file://{persist}"
    assert_same(restored.state, sample_state(2))
    out = capsys.readouterr().out
    assert "rank-00000.shard: checksum mismatch" in out and "step-000000003" in out, out


# -- 4. a rank killed with SIGKILL in the middle of a save -------------------------------------

KILLED_RANK = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import torch

    from unbroken.checkpoint.node import credentials
    from unbroken.config.checkpoint import TierPolicy
    from unbroken.checkpoint.rank.tiered import TieredCheckpointer

    root, endpoint, policy = Path(sys.argv[1]), sys.argv[2], TierPolicy.model_validate_json(sys.argv[3])
    ck = TieredCheckpointer(job="j", attempt=0, rank=0, world_size=1, node="node-1", shm_root=root,
                            policy=policy, endpoint=endpoint, credentials=credentials.load(Path(sys.argv[4])))
    ck.save(1, {"step": 1, "w": torch.full((1000,), 1.0)})
    ck.wait()
    big = {"step": 2, "w": torch.full((75_000_000,), 2.0)}  # 300 MB
    print("SAVED", flush=True)
    if sys.stdin.readline().strip() != "go":
        sys.exit(3)
    ck.save(2, big)
    ck.wait()
    print("DONE", flush=True)
    """
)

BIG = 75_000_000 * 4


def test_rank_killed_mid_save_leaves_the_previous_step_restorable(make_rig, tmp_path: Path) -> None:
    rig = make_rig({"keep": 2, "replicas": 0})
    script = tmp_path / "rank.py"
    script.write_text(KILLED_RANK)
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(rig.root("node-1")), rig.services["node-1"].server.address,
         rig.spec.checkpoint.tiers.model_dump_json(), str(rig.credentials.cert.parent)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()
        assert line.strip() == "SAVED", line + proc.stdout.read()
        rig.settle(lambda: rig.steps(MEMORY) == [1], "step 1 committed")
        first_slot = rig.own(1).path

        proc.stdin.write("go\n")
        proc.stdin.flush()

        def writing() -> Path | None:
            for path in slot_files(rig.root("node-1"), 0):
                if path == first_slot:
                    continue
                st = path.stat()
                if st.st_size >= BIG and st.st_blocks * 512 >= BIG:  # allocated: the copy is under way
                    return path
            if proc.poll() is not None:
                raise AssertionError("the rank finished before it could be killed: " + proc.stdout.read())
            return None

        victim = wait_until(writing, 60, "the rank writing its 300 MB slot", interval=0.001)
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    assert not shm.descriptor_path(victim).exists(), "the save completed before the kill: the test proves nothing"
    for _ in range(5):  # the agent keeps running its passes
        rig.reconcile()
    assert rig.steps(MEMORY) == [1]
    assert rig.copies(MEMORY, 2) == []
    assert [s.info.step for s in shm.scan(rig.root("node-1"), "j")] == [1]

    rig.store.update_job("j", JobUpdate(attempt=1))
    ck = rig.checkpointer(attempt=1)
    restored = ck.restore()
    assert restored is not None and restored.step == 1 and restored.source == "memory on node-1"
    assert_same(restored.state, {"step": 1, "w": torch.full((1000,), 1.0)})

    # The new attempt saves step 2 itself: that one commits, the half-written one never does.
    rig.save(ck, 2, small_state(2))
    for _ in range(3):
        rig.reconcile()
    assert rig.steps(MEMORY) == [2, 1]
    assert {r.attempt for r in rig.rows(MEMORY) if r.step == 2} == {1}
    restored = rig.checkpointer(attempt=1).restore()
    assert restored is not None and restored.step == 2
    assert_same(restored.state, small_state(2))


def test_half_written_slot_of_a_finished_attempt_is_reclaimed(make_rig) -> None:
    rig = make_rig({"keep": 1, "replicas": 0})
    dead = rig.checkpointer(attempt=0)
    rig.save(dead, 1, small_state(1))
    # Attempt 0's rank dies between taking a slot for step 2 (descriptor removed) and publishing it.
    slot = dead._pool.acquire(wait_seconds=1)
    slot.ensure_capacity(1 << 20)
    dead._pool.release(slot, None)
    orphan = slot.path
    dead.close()
    rig.checkpointers.remove(dead)

    rig.store.update_job("j", JobUpdate(attempt=1))
    ck = rig.checkpointer(attempt=1)
    for step in (2, 3, 4):
        rig.save(ck, step, small_state(step))
    rig.settle(lambda: not orphan.exists(), f"{orphan.name} of finished attempt 0 removed", timeout=3)


# -- 5. a failing persistent tier degrades, training goes on -----------------------------------


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Backoff between drain retries in milliseconds instead of seconds: the same path, sooner."""
    monkeypatch.setattr(drain_module, "RETRY_BASE_SECONDS", 0.01)


def assert_tier_failing(rig: Rig, step: int, needle: str) -> None:
    row = rig.row(PERSISTENT, step)
    assert row is not None and row.status is StepStatus.FAILED, row
    assert needle in (row.message or ""), row.message
    events = [e for e in rig.store.list_events(object_kind="Job", object_name="j", reason="CheckpointTierFailing")
              if f"step {step}" in e.message]
    assert events, [e.message for e in rig.store.list_events()]
    assert events[0].type is EventType.WARNING and needle in events[0].message


def test_persistent_tier_on_a_full_disk_fails_the_drain_and_memory_keeps_committing(make_rig, mount_tmpfs, fast_retries) -> None:
    disk = mount_tmpfs("small", size="1m")
    rig = make_rig({"keep": 2, "replicas": 0}, {"uri": f"file://{disk}", "every_steps": 1})
    ck = rig.checkpointer()
    rig.save(ck, 1, small_state(1), persistent=True)  # 8 KB: fits

    ck.save(2, small_state(2, n=500_000))  # 6 MB onto a 1 MiB disk
    ck.wait()
    rig.settle(lambda: (r := rig.row(PERSISTENT, 2)) is not None and r.status is StepStatus.FAILED, "step 2's drain Failed")
    assert_tier_failing(rig, 2, "No space left on device")
    assert not list(disk.rglob("*.tmp")), "the half-written shard is removed, not left filling the disk"
    assert PersistentStore(f"file://{disk}").committed_steps("j") == [1]

    for step in (3, 4):  # training goes on: memory commits, and small drains succeed again
        rig.save(ck, step, small_state(step), persistent=True)
    assert rig.steps(MEMORY) == [4, 3]
    restored = ck.restore()
    assert restored is not None and restored.step == 4 and restored.source == "memory on node-1"


def test_persistent_tier_on_a_read_only_filesystem_fails_every_drain_and_memory_keeps_committing(
    make_rig, mount_tmpfs, fast_retries
) -> None:
    disk = mount_tmpfs("readonly", size="1m", read_only=True)
    rig = make_rig({"keep": 2, "replicas": 0}, {"uri": f"file://{disk}/runs", "every_steps": 1})
    ck = rig.checkpointer()
    for step in (1, 2, 3):
        ck.save(step, small_state(step))
        ck.wait()
        rig.settle(lambda s=step: (r := rig.row(PERSISTENT, s)) is not None and r.status is StepStatus.FAILED,
                   f"step {step}'s drain Failed")
        assert_tier_failing(rig, step, "Read-only file system")
        assert rig.steps(MEMORY)[0] == step
    assert rig.steps(PERSISTENT) == []
    restored = ck.restore()
    assert restored is not None and restored.step == 3 and restored.source == "memory on node-1"
    assert_same(restored.state, small_state(3))


def test_s3_drain_and_restore_are_bit_exact_and_a_deleted_bucket_degrades(make_rig, s3_bucket, fast_retries) -> None:
    uri = f"s3://{s3_bucket.name}/runs"
    rig = make_rig({"keep": 2, "replicas": 0}, {"uri": uri, "every_steps": 1})
    ck = rig.checkpointer()
    for step in (1, 2):
        rig.save(ck, step, sample_state(step), persistent=True)
    keys = sorted(o["Key"] for o in s3_bucket.client.list_objects_v2(Bucket=s3_bucket.name)["Contents"])
    assert "runs/j/step-000000002/COMMITTED" in keys and "runs/j/step-000000002/rank-00000.shard" in keys

    fresh = rig.checkpointer(node="node-9", attempt=1, agent=False, shm_root=rig.shm / "node-9")
    restored = fresh.restore()
    assert restored is not None and restored.step == 2 and restored.source == f"persistent {uri}"
    assert_same(restored.state, sample_state(2))

    empty_and_delete_bucket(s3_bucket.client, s3_bucket.name)
    ck.save(3, sample_state(3))
    ck.wait()
    rig.settle(lambda: (r := rig.row(PERSISTENT, 3)) is not None and r.status is StepStatus.FAILED, "step 3's drain Failed")
    assert_tier_failing(rig, 3, "bucket does not exist")
    rig.save(ck, 4, sample_state(4))
    assert rig.steps(MEMORY) == [4, 3]
    assert ck.restore().step == 4


def test_a_drain_in_flight_keeps_its_step_and_slot_while_training_saves_on(make_rig, s3_bucket) -> None:
    """A real drain stuck on a paused S3 server: its row stays Draining, its slot is read-locked."""
    uri = f"s3://{s3_bucket.name}/runs"
    rig = make_rig({"keep": 2, "replicas": 0}, {"uri": uri, "every_steps": 2})
    node1, node2 = rig.services["node-1"], rig.services["node-2"]
    ranks = [rig.checkpointer(node="node-1", rank=0, world_size=2), rig.checkpointer(node="node-2", rank=1, world_size=2)]

    def save_both(step: int) -> None:
        for ck in ranks:
            ck.save(step, sample_state(step, ck.rank))
        for ck in ranks:
            ck.wait()

    save_both(1)  # not due for the persistent tier: S3 not touched
    rig.settle(lambda: rig.steps(MEMORY) == [1], "step 1 committed in memory")
    save_both(2)
    node1.reconcile()  # records rank 0's shard; the step needs rank 1's too
    assert 2 not in rig.steps(MEMORY)
    node2.reconcile()  # records rank 1's, commits step 2, opens the drain (and prepares the tier for it)
    assert rig.row(PERSISTENT, 2).status is StepStatus.DRAINING
    node2.reconcile()  # uploads rank 1's shard
    rig.wait_idle()
    assert [c.rank for c in rig.store.list_shard_copies("j", step=2, tier=PERSISTENT)] == [1]
    draining_slot = rig.own(2, node="node-1", rank=0)

    rig.serial = False  # node-1's upload hangs on purpose while the agents' passes go on
    s3_bucket.server.pause()
    try:
        node1.reconcile()  # uploads rank 0's shard: the request hangs, LOCK_SH held on its slot
        assert node1._drainer.busy()
        for step in range(3, 9):
            save_both(step)
            rig.settle(lambda s=step: s in rig.steps(MEMORY), f"step {step} committed in memory")
            assert rig.row(PERSISTENT, 2).status is StepStatus.DRAINING
            committed = rig.steps(MEMORY)
            assert committed[:2] == [step, step - 1] and committed[-1] == 2 and len(committed) <= 3, committed
            # the draining step stays committed, on top of keep=2
            for rank in (0, 1):
                assert len(slot_files(rig.root(f"node-{rank + 1}"), rank)) <= 2 + 2
            assert node1._drainer.busy(), "the upload is still hanging"
        assert rig.own(2, node="node-1", rank=0).info.checksum == draining_slot.info.checksum, "the slot being drained was rewritten"
    finally:
        s3_bucket.server.resume()
    rig.settle(lambda: 2 in rig.steps(PERSISTENT), "step 2 committed in S3 once the server answers again", timeout=30)

    fresh = rig.checkpointer(node="node-9", attempt=1, world_size=2, agent=False, shm_root=rig.shm / "node-9")
    for rank in (0, 1):
        loaded = fresh.load_shard(2, rank)
        assert loaded is not None and loaded.source == f"persistent {uri}"
        assert_same(loaded.payload["state"], sample_state(2, rank))
    rig.settle(lambda: rig.steps(MEMORY) == [8, 7], "step 2 released from memory after its drain")


# -- 6. authentication between nodes -----------------------------------------------------------


def shard_file(tmp: Path, state: dict[str, Any], *, step: int = 5, rank: int = 0) -> tuple[Path, ShardInfo]:
    layout, tensors = shard.plan({"step": step, "state": state, "rng": {}})
    buffer = bytearray(layout.size)
    shard.write(buffer, layout, tensors)
    path = tmp / f"shard-{step}-{rank}.bin"
    path.write_bytes(buffer)
    info = ShardInfo.describe(job="j", step=step, rank=rank, world_size=1, attempt=0, layout=layout,
                              checksum=shard.checksum(buffer, layout.size))
    return path, info


def test_a_client_of_another_cluster_is_refused(make_rig, other_credentials: Credentials) -> None:
    rig = make_rig()
    address = rig.services["node-2"].server.address
    with pytest.raises(AuthError, match="is not of this cluster"):
        PeerClient(address, other_credentials)  # it does not trust our server either
    # one that trusts our CA but holds another cluster's certificate: the server is the one refusing
    stranger = Credentials(ca=rig.credentials.ca, cert=other_credentials.cert, key=other_credentials.key)
    with pytest.raises(AuthError, match="refused us: not of this cluster"):
        with PeerClient(address, stranger) as client:
            client.shards("j")
    with PeerClient(address, rig.credentials) as client:  # the server still serves the cluster's own
        assert client.shards("j") == []


def test_a_server_of_another_cluster_is_refused_by_the_client(shm_dir: Path, cluster_credentials: Credentials,
                                                              other_credentials: Credentials) -> None:
    impostor = ShardServer(shm_dir / "impostor", other_credentials).start()
    try:
        with pytest.raises(AuthError, match="is not of this cluster"):
            PeerClient(impostor.address, cluster_credentials)
    finally:
        impostor.close()


def test_a_plaintext_put_is_dropped_and_writes_nothing(make_rig, tmp_path: Path) -> None:
    """No TLS, no certificate: whatever the bytes say, they are never read as a request."""
    rig = make_rig()
    path, info = shard_file(tmp_path, small_state(5))
    host, _, port = rig.services["node-2"].server.address.rpartition(":")
    body = path.read_bytes()
    request = (f"PUT /v1/jobs/j/replicas/5/0 HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
               f"Unbroken-Shard: {info.model_dump_json()}\r\n\r\n").encode() + body
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        try:
            sock.sendall(request)
            answer = sock.recv(1024)
        except (BrokenPipeError, ConnectionResetError):
            answer = b""  # closed on us: refused
    assert b"HTTP/1.1 200" not in answer, f"the server answered a client without TLS: {answer!r}"
    held = shm.held_dir(rig.root("node-2"), "j")
    assert not held.exists() or list(held.iterdir()) == []
    rig.reconcile()
    assert rig.copies(REPLICA) == []
    with PeerClient(rig.services["node-2"].server.address, rig.credentials) as client:
        assert client.shards("j") == [], "and the server goes on serving"


def test_put_and_get_round_trip_and_a_put_with_a_wrong_checksum_is_refused(make_rig, tmp_path: Path) -> None:
    rig = make_rig()
    address = rig.services["node-2"].server.address
    state = sample_state(5)
    path, info = shard_file(tmp_path, state)
    with PeerClient(address, rig.credentials) as client:
        client.put(path, info)
        held = shm.held_path(rig.root("node-2"), "j", 5, 0)
        assert held.read_bytes()[: info.size] == path.read_bytes()
        assert shm.read_descriptor(held) == info

        buffers: list[bytearray] = []

        def into(got: ShardInfo) -> memoryview:
            buffers.append(bytearray(got.size))
            return memoryview(buffers[-1])

        got = client.get("j", 5, 0, into)
        assert got == info and bytes(buffers[0]) == path.read_bytes()
        payload = shard.read(buffers[0], got.metas(), got.skeleton_offset, got.size)
        assert_same(payload["state"], state)
        assert [(i.step, held_) for i, held_ in client.shards("j")] == [(5, True)]

        bad_path, bad_info = shard_file(tmp_path, small_state(6), step=6)
        lying = bad_info.model_copy(update={"checksum": "xxh3_64:0000000000000000"})
        with pytest.raises(CheckpointError, match="checksum mismatch"):
            client.put(bad_path, lying)
        assert not shm.held_path(rig.root("node-2"), "j", 6, 0).exists()
        assert not shm.descriptor_path(shm.held_path(rig.root("node-2"), "j", 6, 0)).exists()
        assert sorted(p.name for p in shm.held_dir(rig.root("node-2"), "j").iterdir()) == [
            "s000000005-r00000.json", "s000000005-r00000.shard"]
        with pytest.raises(CheckpointError, match="no complete shard"):
            client.get("j", 6, 0, into)
        assert client.get("j", 5, 0, into) == info  # the connection is still good


# -- 7. fencing: a late shard of a failed attempt ------------------------------------------------


def test_a_shard_of_a_failed_attempt_for_an_uncommitted_step_is_never_recorded(make_rig) -> None:
    rig = make_rig({"keep": 2, "replicas": 1})
    old = rig.checkpointer(attempt=0)
    rig.save(old, 4, small_state(4), replicas=1)
    # Attempt 0 failed; the controller moved the job to attempt 1 while a slow rank was still saving.
    rig.store.update_job("j", JobUpdate(attempt=1))
    old.save(5, small_state(5))
    old.wait()
    assert any(s.info.step == 5 for s in shm.scan(rig.root("node-1"), "j")), "the late shard is in shared memory"
    for _ in range(5):
        rig.reconcile()
    assert rig.copies(MEMORY, 5) == [] and rig.copies(REPLICA, 5) == []
    assert rig.steps(MEMORY) == [4], "a step of the failed timeline committed"

    new = rig.checkpointer(attempt=1)
    restored = new.restore()
    assert restored is not None and restored.step == 4
    assert_same(restored.state, small_state(4))
    rig.save(new, 5, small_state(5, n=10), replicas=1)
    assert {(r.step, r.attempt) for r in rig.rows(MEMORY)} == {(5, 1), (4, 0)}
    restored = rig.checkpointer(attempt=1).restore()
    assert restored.step == 5
    assert_same(restored.state, small_state(5, n=10))


def resave_step_2_in_attempt_1(rig: Rig) -> TieredCheckpointer:
    """Attempt 0 committed steps 1 and 2 everywhere; step 2 then could not be restored on every
    rank (say the node holding a shard died), so attempt 1 resumed from step 1 and saved step 2 again."""
    old = rig.checkpointer(attempt=0)
    for step in (1, 2):
        rig.save(old, step, small_state(step), replicas=1, persistent=rig.spec.checkpoint.persistent is not None)
    rig.store.update_job("j", JobUpdate(attempt=1))
    new = rig.checkpointer(attempt=1)
    new.save(2, small_state(2, n=10))
    new.wait()
    rig.settle(lambda: (r := rig.row(MEMORY, 2)) is not None and r.attempt == 1, "attempt 1's step 2 committed in memory")
    return new


def test_a_step_re_saved_by_a_new_attempt_is_replicated_again(make_rig) -> None:
    rig = make_rig({"keep": 2, "replicas": 1})
    resave_step_2_in_attempt_1(rig)
    rig.settle(lambda: any(c.attempt == 1 for c in rig.store.list_shard_copies("j", step=2, tier=REPLICA)),
               "attempt 1's step 2 replicated to node-2", timeout=3)


def test_a_step_re_saved_by_a_new_attempt_does_not_stall_the_persistent_tier(make_rig, tmp_path: Path) -> None:
    rig = make_rig({"keep": 2, "replicas": 1}, {"uri": f"file://{tmp_path}/persist", "every_steps": 1})
    new = resave_step_2_in_attempt_1(rig)
    new.save(3, small_state(3))
    new.wait()
    rig.settle(lambda: 3 in rig.steps(PERSISTENT), "step 3 committed in the persistent tier", timeout=3)


# -- agents running concurrently -----------------------------------------------------------------


STEPS = 16


def test_concurrent_agents_commit_each_persistent_step_once_and_never_mark_it_failed(make_rig, tmp_path: Path) -> None:
    """Every agent runs its passes on its own thread, as on a real cluster; all of them see a
    drain complete and may try to write the manifest and marker at the same moment."""
    nodes = ("node-1", "node-2", "node-3", "node-4")
    rig = make_rig({"keep": 2, "replicas": 3}, {"uri": f"file://{tmp_path}/persist", "every_steps": 1, "keep": 2}, nodes=nodes)
    stop = threading.Event()
    errors: list[BaseException] = []

    def agent_loop(service: CheckpointService) -> None:
        while not stop.is_set():
            try:
                service.reconcile()
            except BaseException as exc:  # noqa: BLE001 - reported by the test below
                errors.append(exc)
                return
            stop.wait(0.002)

    loops = [threading.Thread(target=agent_loop, args=(s,), daemon=True) for s in rig.services.values()]
    for loop in loops:
        loop.start()
    try:
        ck = rig.checkpointer()
        for step in range(1, STEPS + 1):
            ck.save(step, small_state(step))
            ck.wait()
            wait_until(lambda s=step: (r := rig.row(PERSISTENT, s)) is not None and r.status is not StepStatus.DRAINING,
                     15, f"step {step}'s drain finished")
    finally:
        stop.set()
        for loop in loops:
            loop.join(timeout=30)
    assert not errors, errors
    failed = [(r.step, r.message) for r in rig.rows(PERSISTENT) if r.status is StepStatus.FAILED]
    assert failed == [], failed
    assert rig.store.list_events(reason="CheckpointTierFailing") == []
    assert rig.steps(PERSISTENT) == [STEPS, STEPS - 1]
    assert PersistentStore(f"file://{tmp_path}/persist").committed_steps("j") == [STEPS, STEPS - 1]


def test_a_pushed_step_keeps_its_own_slot_until_it_survives_losing_either_node(make_rig) -> None:
    """A rank saving every step reuses a slot as soon as nobody holds it. A push keeps holding
    the slot it replicated until the step is fully replicated and pinned: released at once,
    the peers would hold replicas of a step this node had overwritten, and losing a peer would
    lose the step (a kill-node benchmark, saving every step, once resumed from step 0)."""
    rig = make_rig({"keep": 1, "replicas": 1})
    r0 = rig.checkpointer(node="node-1", rank=0, world_size=2)
    r1 = rig.checkpointer(node="node-2", rank=1, world_size=2)
    for step in (1, 2):
        for ck in (r0, r1):
            ck.save(step, small_state(step, ck.rank))
            ck.wait()
        if step == 1:
            rig.settle(lambda: 1 not in rig.steps(MEMORY) or len(rig.copies(REPLICA, 1)) == 2, "step 1 replicated both ways")
    node_1, node_2 = rig.services["node-1"], rig.services["node-2"]
    node_2.reconcile()  # records rank 1's step 2 and pushes it (before its commit: rank 0's is not recorded yet)
    node_1.reconcile()  # records rank 0's, commits step 2 and pushes rank 0's shard to node-2
    rig.wait_idle()
    assert rig.held(2, node="node-2", rank=0).info.step == 2
    assert rig.own(1).info.step == 1  # pinned: step 1 is still the one that survives a node loss
    for step in (3, 4, 5):  # rank 0 trains on before its agent's next pass
        r0.save(step, small_state(step))
        r0.wait()
    assert rig.own(2).info.step == 2  # not reused: the push still holds it
    # node-2 pushes rank 1's step 2; step 2 is then on two nodes for both ranks and replaces step 1
    rig.settle(lambda: 1 not in rig.steps(MEMORY) and 2 in rig.steps(MEMORY), "step 2 to replace step 1")
    # Losing either node leaves every rank's step 2: node-1 has rank 0's own and rank 1's replica.
    assert rig.own(2, node="node-1", rank=0).info.step == 2
    assert rig.held(2, node="node-1", rank=1).info.step == 2
    assert rig.own(2, node="node-2", rank=1).info.step == 2
    assert rig.held(2, node="node-2", rank=0).info.step == 2


def test_the_newest_fully_replicated_step_outlives_retention_while_replication_lags(make_rig) -> None:
    """Replication skips ahead when it falls behind, so for a while the newest memory steps
    have no replicas. Losing the node then must still leave a step to resume from: the newest
    step every rank has a replica of keeps its memory row, its replicas and its own slots
    (pinned by the agent) until a newer one is fully replicated."""
    rig = make_rig({"keep": 2, "replicas": 1})
    ck = rig.checkpointer()
    rig.save(ck, 1, sample_state(1), replicas=1)
    rig.services["node-2"].close()  # the peer stops taking replicas: replication now lags forever
    del rig.services["node-2"]
    for step in (2, 3, 4, 5, 6):
        rig.save(ck, step, sample_state(step))
    rig.reconcile()
    assert 1 in rig.steps(MEMORY), rig.steps(MEMORY)  # the fully replicated step stays listed
    assert {5, 6} <= set(rig.steps(MEMORY))
    assert rig.own(1).info.step == 1  # its own slot was not overwritten: the agent pins it
    assert rig.copies(REPLICA, 1) == [(1, 0, "node-2")]
    # node-1 lost: its agent and its shared memory are gone, the node is retired. The rank
    # starts again on node-2, which holds step 1's replica: it asks node-2's agent for the
    # (real) restore catalog and resumes from that replica, not from scratch.
    rig.services.pop("node-1").close()
    shutil.rmtree(rig.root("node-1"))
    own = SqliteStore(rig.tmp / "state.db")
    rig.services["node-2"] = CheckpointService(own, own, "node-2", rig.root("node-2"), rig.credentials)  # its agent is back
    rig.services["node-2"].start()
    rig.store.update_node("node-1", NodeUpdate(state=NodeState.PENDING_REPLACEMENT))
    rig.store.update_node("node-1", NodeUpdate(state=NodeState.RETIRED))
    rig.store.update_job("j", JobUpdate(attempt=1))
    rig.settle(lambda: not rig.copies(MEMORY), "node-1's copies forgotten")
    resumed = rig.checkpointer(node="node-2", attempt=1)
    catalog = resumed.catalog()
    assert [s.step for s in catalog.memory][-1] == 1 and catalog.memory_step(1).copies[0][0].node == "node-2"
    restored = resumed.restore()
    assert restored is not None and restored.step == 1 and restored.source == "replica on node-2"


# -- one catalog write per node per save ----------------------------------------------------------


def hold_writes(rig: Rig, *, delay: float, replica_wait: float) -> None:
    """Give every agent's catalog the write holds of one whose writes cost (KubernetesCatalog's ConfigMap patches)."""
    for service in rig.services.values():
        service.catalog.copy_write_delay = delay  # type: ignore[misc]
        service.catalog.replica_write_wait = replica_wait  # type: ignore[misc]


def test_a_nodes_own_copy_of_a_save_and_the_replica_it_holds_of_it_land_in_one_write(make_rig) -> None:
    """Peers push a step as soon as they recorded it, not after its commit, so an agent that holds
    its records a moment writes its own copies of a save and the replicas it holds of it together:
    one catalog write per node per save. Before, the replicas could only follow the commit, which
    waits for every node's own copies: a second write."""
    rig = make_rig({"keep": 2, "replicas": 1})
    hold_writes(rig, delay=1.0, replica_wait=5.0)
    ranks = {"node-1": 0, "node-2": 1}
    for node, rank in ranks.items():
        ck = rig.checkpointer(node=node, rank=rank, world_size=2)
        ck.save(1, small_state(1, rank))
        ck.wait()
    seen: dict[str, set[tuple[bool, bool]]] = {node: set() for node in ranks}

    def both_in_catalog() -> bool:
        for node, rank in ranks.items():
            own = (1, rank, node) in rig.copies(MEMORY, 1)
            held = (1, 1 - rank, node) in rig.copies(REPLICA, 1)
            seen[node].add((own, held))
        return all((True, True) in states for states in seen.values()) and 1 in rig.steps(MEMORY)

    rig.settle(both_in_catalog, "both nodes' copies and replicas of step 1 in the catalog, step 1 committed")
    for node, states in seen.items():
        assert states <= {(False, False), (True, True)}, f"{node}: own copy and held replica landed apart: {states}"


@contextlib.contextmanager
def stalled_push(server: ShardServer, credentials: Credentials, tmp: Path, *, step: int) -> Iterator[None]:
    """A peer that begins pushing rank 0's shard of ``step`` and stops sending (a hung host, a cut link)."""
    path, info = shard_file(tmp, small_state(step), step=step)
    host, _, port = server.address.rpartition(":")
    connection = http.client.HTTPSConnection(host, int(port), timeout=5, context=credentials.client_context())
    try:
        connection.putrequest("PUT", f"/v1/jobs/j/replicas/{step}/0")
        connection.putheader("Content-Length", str(info.size))
        connection.putheader(SHARD_HEADER, info.model_dump_json())
        connection.endheaders()
        connection.send(path.read_bytes()[:16])  # and nothing more
        wait_until(lambda: server.receiving() == {("j", step)}, 5, "the server to see the push begin")
        yield
    finally:
        connection.close()
    wait_until(lambda: not server.receiving(), 10, "a closed push to stop counting")


@contextlib.contextmanager
def saved_while_a_push_stalls(rig: Rig, tmp: Path, *, stalled: int, saved: int) -> Iterator[CheckpointService]:
    """node-2's rank 1 saves step ``saved`` while a peer's push of step ``stalled`` to node-2 stalls: node-2's agent."""
    node_2 = rig.services["node-2"]
    assert node_2.server is not None
    with stalled_push(node_2.server, rig.credentials, tmp, step=stalled):
        ck = rig.checkpointer(node="node-2", rank=1, world_size=2)
        ck.save(saved, small_state(saved, 1))
        ck.wait()
        yield node_2


def test_a_stalled_push_holds_a_nodes_copy_records_no_longer_than_the_replica_wait(make_rig, tmp_path: Path) -> None:
    """A push that stalls delays the node's own copy records of that step by ``replica_write_wait`` at most."""
    rig = make_rig({"keep": 2, "replicas": 1})
    hold_writes(rig, delay=0.0, replica_wait=1.0)
    with saved_while_a_push_stalls(rig, tmp_path, stalled=1, saved=1) as node_2:
        recorded_from = time.monotonic()
        node_2.reconcile()
        assert rig.copies(MEMORY, 1) == [], "held while a peer pushes"

        def written() -> bool:
            node_2.reconcile()
            return rig.copies(MEMORY, 1) == [(1, 1, "node-2")]

        wait_until(written, 10, "node-2's own copy written despite the stalled push", interval=0.05)
        assert time.monotonic() - recorded_from >= 1.0, "written before the replica wait was over"
        assert node_2.server is not None and node_2.server.receiving() == {("j", 1)}, \
            "the push still stalls: the wait, not its end, let the write go"


def test_a_push_of_an_older_step_never_holds_a_newer_saves_records(make_rig, tmp_path: Path) -> None:
    """Replication lagging a step behind the saves must not delay every save's commit by the replica wait."""
    rig = make_rig({"keep": 2, "replicas": 1})
    hold_writes(rig, delay=0.0, replica_wait=30.0)
    with saved_while_a_push_stalls(rig, tmp_path, stalled=1, saved=2) as node_2:
        node_2.reconcile()
        assert rig.copies(MEMORY, 2) == [(2, 1, "node-2")], "step 2's record went out in its first pass"
