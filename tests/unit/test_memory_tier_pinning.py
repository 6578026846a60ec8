"""The memory tier's device path under CUDA's rules for pinned memory, on CPU tensors that play device tensors.

On an H100, a rank whose saved state changed size (64, 256, then 16 MiB) and that
made a new checkpointer in the same process (an in-process restart) lost 8 of 14
saves to ``cudaHostRegister`` returning 712 unchecked, and one save was recorded
with bytes that were not the rank's. These tests run the same story against a
stand-in runtime that keeps CUDA's rules (tests/cuda_rules.py): a second
registration of a range fails, and a registered mapping cannot be unmapped. Every
save is read back from shared memory and compared with what was saved.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import pytest
import torch
from cuda_rules import RuleKeepingCuda

from unbroken.checkpoint.format import shard
from unbroken.checkpoint.node import shm
from unbroken.checkpoint.node.credentials import Credentials
from unbroken.checkpoint.node.cuda_host import PinnedMemory
from unbroken.checkpoint.rank.tiered import TieredCheckpointer
from unbroken.config.checkpoint import TierPolicy

MIB = 1 << 20


def state_of(nbytes: int, seed: int) -> dict[str, Any]:
    """A model-and-optimizer-shaped state of about ``nbytes``: a few float tensors, an odd-sized one, a counter."""
    generator = torch.Generator().manual_seed(seed)
    quarter = nbytes // 16  # float32 elements in a quarter of the bytes
    return {
        "model": {"w": torch.randn(quarter, generator=generator), "b": torch.randn(quarter, generator=generator),
                  "odd": torch.randn(1001, generator=generator).to(torch.bfloat16)},
        "optimizer": {"exp_avg": torch.randn(2 * quarter, generator=generator), "step": torch.tensor(float(seed))},
        "progress": seed,
    }


def saved_payload(root: Path, job: str, step: int, rank: int = 0) -> dict[str, Any] | None:
    """What the memory tier holds of ``step`` on this node, read back from its slot file (None: not recorded)."""
    for stored in shm.scan(root, job):
        if stored.info.step == step and stored.info.rank == rank:
            with open(stored.path, "rb") as f, mmap.mmap(f.fileno(), stored.info.size, access=mmap.ACCESS_COPY) as view:
                assert shard.checksum(view, stored.info.size) == stored.info.checksum
                return shard.read(view, stored.info.metas(), stored.info.skeleton_offset, stored.info.size, copy=True)
    return None


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


@pytest.fixture
def cuda() -> RuleKeepingCuda:
    return RuleKeepingCuda()


@pytest.fixture
def checkpointer(shm_dir: Path, cuda: RuleKeepingCuda, cluster_credentials: Credentials):
    pinning = PinnedMemory(cuda)  # the process's record, shared by every checkpointer of the "process"
    made: list[TieredCheckpointer] = []

    def make(attempt: int = 0, keep: int = 2) -> TieredCheckpointer:
        ck = TieredCheckpointer(job="j", attempt=attempt, rank=0, world_size=1, node="node-1", shm_root=shm_dir,
                                policy=TierPolicy.model_validate({"memory": {"keep": keep, "replicas": 0}}), endpoint=None,
                                credentials=cluster_credentials, pinning=pinning)
        made.append(ck)
        return ck

    yield make
    for ck in made:
        ck.close()


def test_saves_of_changing_sizes_across_in_process_restarts_are_all_recorded_exactly_and_keep_cudas_rules(
        checkpointer, cuda: RuleKeepingCuda, shm_dir: Path) -> None:
    sizes = [4 * MIB, 16 * MIB, 1 * MIB, 8 * MIB, 16 * MIB]
    ck = checkpointer(attempt=0)
    recorded = []
    for step in range(1, 21):
        if step in (6, 11, 16):  # an in-process restart: the old checkpointer closes, a new one takes over
            ck.close()
            ck = checkpointer(attempt=ck.attempt + 1)
        state = state_of(sizes[step % len(sizes)], seed=step)
        ck.save(step, state)
        ck.wait()
        back = saved_payload(shm_dir, "j", step)
        recorded.append(back is not None and back["step"] == step and same(back["state"], state))
    ck.close()
    assert recorded == [True] * 20
    assert cuda.refused == [], "a registration of an already registered range, or an unregister of an unregistered one"
    assert cuda.registrations == {}, "a closed checkpointer must leave nothing registered"
    assert cuda.registered_on and "MainThread" not in cuda.registered_on, "slots are pinned off the training thread"


@pytest.mark.parametrize("corrupt", [False, True], ids=["exact", "a-bit-flipped"])
def test_a_slot_is_checksummed_and_read_back_as_its_copies_land_and_never_before(
        checkpointer, cuda: RuleKeepingCuda, shm_dir: Path, corrupt: bool) -> None:
    """Copies that land only when the host waits for them, as on a CUDA stream: the slot's checksum and the
    read-back of its fingerprints start while the copies are still queued, so each must wait for the copies
    before what it reads (checkpoint/rank/landing.py). A reader that did not would record the bytes the slot
    held before (the checksum) or call a good copy bad (the read-back)."""
    cuda.asynchronous = True
    ck = checkpointer()
    for step in range(1, 5):
        state = state_of(96 * MIB, seed=step)  # several 32 MiB checksum chunks: several markers to wait for
        if corrupt and step == 3:
            cuda.corrupt_next = 1
        ck.save(step, state)
        ck.wait()
        back = saved_payload(shm_dir, "j", step)
        if corrupt and step == 3:
            assert back is None, "a copy that landed other bytes must not be recorded"
        else:
            assert back is not None and back["step"] == step and same(back["state"], state)


def test_a_copy_that_fails_halfway_wakes_the_slots_readers_and_loses_only_its_step(
        checkpointer, cuda: RuleKeepingCuda, shm_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The checksum and the read-back wait for copies that will never land: the failed copy must wake them (or the
    save's thread, and every save after it, would hang), and the slot must not be recorded."""
    cuda.asynchronous = True
    ck = checkpointer()
    ck.save(1, state_of(96 * MIB, seed=1))
    ck.wait()
    cuda.fail_next = 1
    ck.save(2, state_of(96 * MIB, seed=2))
    ck.wait()
    assert saved_payload(shm_dir, "j", 2) is None
    assert "step 2 not checkpointed: copying it into the memory tier failed" in capsys.readouterr().out
    state = state_of(96 * MIB, seed=3)
    ck.save(3, state)
    ck.wait()
    assert same(saved_payload(shm_dir, "j", 3)["state"], state)


def test_a_copy_that_delivers_other_bytes_is_not_recorded_and_the_next_goes_through_a_bounce_buffer(
        checkpointer, cuda: RuleKeepingCuda, shm_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ck = checkpointer()
    first = state_of(4 * MIB, seed=1)
    ck.save(1, first)
    ck.wait()
    assert same(saved_payload(shm_dir, "j", 1)["state"], first)

    cuda.corrupt_next = 1  # one bit flipped in the next device-to-host copy
    ck.save(2, state_of(4 * MIB, seed=2))
    ck.wait()
    assert saved_payload(shm_dir, "j", 2) is None, "a save whose slot differs from the device must not be recorded"
    said = capsys.readouterr().out
    assert "step 2 not checkpointed" in said and "differ from the device's" in said

    # Every slot is used in turn: the distrusted one comes round again and goes through the bounce buffer.
    for step in range(3, 8):
        state = state_of(4 * MIB, seed=step)
        ck.save(step, state)
        ck.wait()
        assert same(saved_payload(shm_dir, "j", step)["state"], state)
    assert len(cuda.registrations) == 2, "the slot the bad copy went into is unpinned for good; the other two stay pinned"


def test_when_cuda_refuses_to_pin_every_save_goes_through_the_bounce_buffer_exactly(
        checkpointer, cuda: RuleKeepingCuda, shm_dir: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda, "host_register", lambda view, size: 2)  # cudaErrorMemoryAllocation: over the locked-memory limit
    ck = checkpointer()
    for step in range(1, 5):
        state = state_of(2 * MIB, seed=step)
        ck.save(step, state)
        ck.wait()
        assert same(saved_payload(shm_dir, "j", step)["state"], state)
    said = capsys.readouterr().out
    assert said.count("cudaHostRegister") == 1, "the refusal is said once, not at every save"
    assert "2 (cudaErrorMemoryAllocation)" in said


def test_prepare_maps_and_pins_the_slots_before_the_first_save(checkpointer, cuda: RuleKeepingCuda, shm_dir: Path) -> None:
    ck = checkpointer(keep=2)
    state = state_of(8 * MIB, seed=7)
    ck.prepare(state)
    ck.wait()
    assert len(cuda.registrations) == 3, "keep + 1 slots pinned ahead"
    assert set(cuda.registered_on) == {"ckpt-prepare"}
    registered = dict(cuda.registrations)
    ck.save(1, state)
    ck.wait()
    assert same(saved_payload(shm_dir, "j", 1)["state"], state)
    assert all(address in cuda.registrations for address in registered), "the first save used a prepared, pinned slot"
    assert cuda.refused == []


def test_two_checkpointers_of_one_process_never_pin_one_range_twice(shm_dir: Path, cluster_credentials: Credentials) -> None:
    """A script that makes its checkpointer twice in one attempt gets two pools over the same slot files; each
    maps them at its own addresses, and the process's one record keeps every range registered once."""
    cuda = RuleKeepingCuda()
    pinning = PinnedMemory(cuda)
    policy = TierPolicy.model_validate({"memory": {"keep": 1, "replicas": 0}})
    made = [TieredCheckpointer(job="j", attempt=0, rank=0, world_size=1, node="n", shm_root=shm_dir, policy=policy,
                               endpoint=None, credentials=cluster_credentials, pinning=pinning) for _ in range(2)]
    for step, ck in enumerate(made * 2, start=1):
        state = state_of(2 * MIB, seed=step)
        ck.save(step, state)
        ck.wait()
        assert same(saved_payload(shm_dir, "j", step)["state"], state)
    for ck in made:
        ck.close()
    assert cuda.refused == [] and cuda.registrations == {} and pinning.pinned_bytes == 0


def test_to_device_moves_a_payloads_state_through_pinned_buffers_and_leaves_the_rest(cuda: RuleKeepingCuda,
                                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from unbroken.checkpoint.rank import device_restore

    monkeypatch.setattr(device_restore, "CHUNK_BYTES", 1 * MIB)
    state = state_of(5 * MIB, seed=3)
    rng_part = {"torch": torch.get_rng_state()}
    moved = device_restore.to_device({"step": 4, "state": state, "rng": rng_part}, torch.device("cpu"), cuda)
    assert moved["step"] == 4 and same(moved["state"], state) and moved["rng"] is rng_part
    assert moved["state"]["model"]["w"] is not state["model"]["w"]
    assert cuda.copies_to_device >= 5
