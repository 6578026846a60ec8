"""FileCheckpointer with real torch and real files: commit rule, fallback, retention, RNG, agreement."""

from __future__ import annotations

import json
import os
import queue
import random
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from unbroken.checkpoint.api import Restored
from unbroken.checkpoint.rank.file import FileCheckpointer, committed_steps, rank_file, step_dir
from unbroken.errors import CheckpointError

SRC = Path(__file__).resolve().parents[2] / "src"


# -- helpers ---------------------------------------------------------------------------


def sample_state(step: int, rank: int = 0) -> dict[str, Any]:
    """A training-like state: tensors of many dtypes, nested dicts, lists, plain ints."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {
        "model": {
            "weight": torch.randn(8, 4, generator=g),
            "bias": torch.randn(4, dtype=torch.float64, generator=g),
            "half": torch.randn(5, generator=g).to(torch.bfloat16),
            "ids": torch.randint(-(2**40), 2**40, (6,), generator=g),
            "mask": torch.rand(7, generator=g) > 0.5,
            "special": torch.tensor([float("nan"), float("inf"), -0.0, 1e-45, -float("inf")]),
            "strided": torch.arange(20.0).reshape(4, 5)[:, 1:3] + step,
            "scalar": torch.tensor(step, dtype=torch.int32),
        },
        "optimizer": {
            "state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(3, generator=g)}},
            "param_groups": [{"lr": 0.1, "params": [0, 1]}],
        },
        "epoch": step // 10,
        "sampler": {"offset": 17 * step, "seed": 1234, "nested": {"deeper": {"n": -step}}},
        "big": 2**62 + step,
        "step": step,
        "rank": rank,
    }


def assert_same(actual: Any, expected: Any, where: str = "state") -> None:
    """Bit-exact, recursive equality (NaN, -0.0 and dtype included)."""
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: shape {actual.shape} != {expected.shape}"
        a = actual.contiguous().reshape(-1).view(torch.uint8)
        e = expected.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(a, e), f"{where}: tensor bits differ"
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), f"{where}: keys {actual.keys()} != {expected.keys()}"
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: length"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def step_folders(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


def flip_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, middle + 16):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def flip_tensor_data(path: Path) -> None:
    """Flip bytes inside the stored bits of ``state["model"]["bias"]``: the file still parses."""
    payload = torch.load(path, weights_only=False)
    needle = payload["state"]["model"]["bias"].numpy().tobytes()
    data = bytearray(path.read_bytes())
    at = data.find(needle)
    assert at > 0, "tensor bytes not found in the file"
    for i in range(at, at + 8):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def truncate_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def truncate_empty(path: Path) -> None:
    path.write_bytes(b"")


# -- round trip ------------------------------------------------------------------------


def test_round_trip_is_bit_exact_and_restores_newest_committed_step(tmp_path: Path) -> None:
    ck = FileCheckpointer(tmp_path, keep=10)
    for step in (10, 20, 30):
        ck.save(step, sample_state(step))
    # A newer step folder holding a rank file but no manifest is not committed.
    step_dir(tmp_path, 40).mkdir()
    torch.save({"step": 40, "state": sample_state(40), "rng": {}}, rank_file(tmp_path, 40, 0))
    assert committed_steps(tmp_path, 1) == [30, 20, 10]

    restored = ck.restore()

    assert isinstance(restored, Restored)
    assert restored.step == 30
    assert restored.source == str(step_dir(tmp_path, 30))
    assert Path(restored.source).name == "step-000000030"
    assert_same(restored.state, sample_state(30))
    on_disk = json.loads((step_dir(tmp_path, 30) / "manifest.json").read_text())
    assert on_disk["step"] == 30 and on_disk["world_size"] == 1


def test_restore_of_empty_or_missing_directory_is_a_fresh_start(tmp_path: Path) -> None:
    assert FileCheckpointer(tmp_path / "never-created").restore() is None
    (tmp_path / "empty").mkdir()
    assert FileCheckpointer(tmp_path / "empty").restore() is None


class Reports:
    """Collects what a checkpointer tells its observer (what ``unbroken.init()`` sends to the agent)."""

    def __init__(self) -> None:
        self.saves: list = []
        self.restores: list = []

    def saved(self, report) -> None:
        self.saves.append(report)

    def restored(self, report) -> None:
        self.restores.append(report)


def test_saves_and_restores_are_reported_with_their_cost(tmp_path: Path) -> None:
    reports = Reports()
    ck = FileCheckpointer(tmp_path, observer=reports)
    ck.save(7, {"x": torch.zeros(1000)})
    assert ck.restore().step == 7
    [save] = reports.saves
    assert (save.step, save.tier) == (7, "file") and save.stall_seconds > 0
    assert save.bytes == (tmp_path / "step-000000007" / "rank-00000.pt").stat().st_size
    [restore] = reports.restores
    assert (restore.step, restore.source) == (7, "file") and restore.seconds > 0


def test_restore_brings_back_every_rng(tmp_path: Path) -> None:
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    ck = FileCheckpointer(tmp_path)
    ck.save(5, {"x": torch.zeros(1)})

    def draw() -> tuple[torch.Tensor, float, np.ndarray]:
        return torch.rand(6), random.random(), np.random.rand(4)

    first = draw()
    moved_on = draw()  # the generators advanced: a later draw differs
    assert not torch.equal(first[0], moved_on[0])

    assert ck.restore().step == 5
    again = draw()

    assert torch.equal(again[0], first[0])
    assert again[1] == first[1]
    assert np.array_equal(again[2], first[2])


# -- torn steps (world_size=2 without torch.distributed) --------------------------------


def test_step_missing_a_rank_is_not_committed_and_restore_takes_the_older_one(tmp_path: Path, capsys) -> None:
    r0 = FileCheckpointer(tmp_path, rank=0, world_size=2, keep=10)
    r1 = FileCheckpointer(tmp_path, rank=1, world_size=2, keep=10)
    for ck in (r1, r0):
        ck.save(10, sample_state(10, ck.rank))
    r0.save(20, sample_state(20, 0))  # rank 1 died before writing step 20
    # A newer folder from a run of another world size: not ours to restore nor to delete.
    FileCheckpointer(tmp_path, rank=0, world_size=4, keep=10).save(30, sample_state(30, 0))

    assert (step_dir(tmp_path, 20) / "manifest.json").exists()
    assert rank_file(tmp_path, 20, 0).exists() and not rank_file(tmp_path, 20, 1).exists()
    assert committed_steps(tmp_path, 2) == [10]

    by_rank1 = r1.restore()
    assert by_rank1.step == 10
    assert_same(by_rank1.state, sample_state(10, 1))
    assert step_dir(tmp_path, 20).exists(), "only rank 0 discards abandoned folders"

    by_rank0 = r0.restore()
    assert by_rank0.step == 10
    assert_same(by_rank0.state, sample_state(10, 0))
    assert not step_dir(tmp_path, 20).exists(), "the torn step of the failed timeline is discarded"
    assert step_dir(tmp_path, 30).exists(), "a folder of another world size is kept"
    assert step_folders(tmp_path) == ["step-000000010", "step-000000030"]
    assert "discarding step-000000020" in capsys.readouterr().out


@pytest.mark.parametrize("world_size", [1, 2])
def test_leftover_tmp_from_a_killed_writer_is_ignored(tmp_path: Path, world_size: int) -> None:
    ranks = [FileCheckpointer(tmp_path, rank=r, world_size=world_size, keep=10) for r in reversed(range(world_size))]
    for ck in ranks:
        ck.save(10, sample_state(10, ck.rank))
    last = world_size - 1
    for ck in ranks:  # every rank but the last finishes step 20
        if ck.rank != last:
            ck.save(20, sample_state(20, ck.rank))
    # The last rank was killed -9 half way through writing its file.
    step_dir(tmp_path, 20).mkdir(exist_ok=True)
    tmp = rank_file(tmp_path, 20, last).with_name(f"rank-{last:05d}.pt.tmp")
    full = (tmp_path / "full.bin")
    torch.save({"step": 20, "state": sample_state(20, last), "rng": {}}, full)
    tmp.write_bytes(full.read_bytes()[:100])
    full.unlink()

    assert committed_steps(tmp_path, world_size) == [10]
    restored = FileCheckpointer(tmp_path, rank=last, world_size=world_size).restore()
    assert restored.step == 10
    assert_same(restored.state, sample_state(10, last))


def test_saving_again_over_a_leftover_tmp_commits(tmp_path: Path) -> None:
    ck = FileCheckpointer(tmp_path)
    step_dir(tmp_path, 20).mkdir(parents=True)
    (step_dir(tmp_path, 20) / "rank-00000.pt.tmp").write_bytes(b"half a checkpoint")
    ck.save(20, sample_state(20))
    assert committed_steps(tmp_path, 1) == [20]
    assert not (step_dir(tmp_path, 20) / "rank-00000.pt.tmp").exists()
    assert_same(ck.restore().state, sample_state(20))


# -- corruption ------------------------------------------------------------------------


@pytest.mark.parametrize("corrupt", [flip_middle, flip_tensor_data, truncate_half, truncate_empty])
def test_corrupted_newest_file_falls_back_to_the_previous_step(tmp_path: Path, capsys, corrupt) -> None:
    ck = FileCheckpointer(tmp_path, keep=10)
    for step in (10, 20):
        ck.save(step, sample_state(step))
    newest = rank_file(tmp_path, 20, 0)
    corrupt(newest)
    assert committed_steps(tmp_path, 1) == [20, 10], "still looks committed: only reading it can tell"

    restored = ck.restore()

    assert restored.step == 10
    assert_same(restored.state, sample_state(10))
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if str(newest) in line]
    assert lines, f"no line names {newest}:\n{out}"
    assert "older step" in lines[0]


def test_files_saved_without_crc32_still_restore(tmp_path: Path) -> None:
    """torch can be told not to compute record CRCs (they are stored as 0); those files are fine."""
    assert torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        FileCheckpointer(tmp_path).save(3, sample_state(3))
    finally:
        torch.serialization.set_crc32_options(True)
    restored = FileCheckpointer(tmp_path).restore()
    assert restored is not None and restored.step == 3
    assert_same(restored.state, sample_state(3))


def test_file_of_another_step_is_not_accepted(tmp_path: Path, capsys) -> None:
    ck = FileCheckpointer(tmp_path, keep=10)
    ck.save(10, sample_state(10))
    ck.save(20, sample_state(20))
    # A rank file copied into the wrong folder (a step-10 payload at step 20).
    rank_file(tmp_path, 20, 0).write_bytes(rank_file(tmp_path, 10, 0).read_bytes())
    assert ck.restore().step == 10
    assert str(rank_file(tmp_path, 20, 0)) in capsys.readouterr().out


def test_every_step_corrupted_gives_a_fresh_start(tmp_path: Path) -> None:
    ck = FileCheckpointer(tmp_path, keep=10)
    for step in (1, 2):
        ck.save(step, {"x": torch.arange(1000)})
        truncate_half(rank_file(tmp_path, step, 0))
    assert ck.restore() is None


# -- retention -------------------------------------------------------------------------


def test_retention_keeps_the_newest_two(tmp_path: Path) -> None:
    ck = FileCheckpointer(tmp_path, keep=2)
    for step in (10, 20, 30, 40):
        ck.save(step, {"step": step})
    assert step_folders(tmp_path) == ["step-000000030", "step-000000040"]
    assert committed_steps(tmp_path, 1) == [40, 30]


def test_retention_keeps_the_last_agreed_step_however_many_are_saved_after_it(tmp_path: Path) -> None:
    """Replicas compared every 40 steps, saves every 10, keep 2: the steps saved since the last agreement are
    unverified, so the agreed one stays (a disagreement rolls back to it) until a later step is agreed."""
    ck = FileCheckpointer(tmp_path, keep=2)
    ck.save(40, {"step": 40})
    ck.agreed(40)
    for step in (50, 60, 70):
        ck.save(step, {"step": step})
    assert committed_steps(tmp_path, 1) == [70, 60, 40]
    ck.distrust_after(40, "replicas disagree at step 80")
    restored = ck.restore()
    assert restored is not None and restored.step == 40
    ck.save(50, {"step": 50})
    ck.agreed(50)
    ck.save(60, {"step": 60})
    ck.save(70, {"step": 70})
    assert committed_steps(tmp_path, 1) == [70, 60, 50], "a later agreement lets the earlier one go"


def test_retention_never_deletes_the_newest_committed_step(tmp_path: Path) -> None:
    r0 = FileCheckpointer(tmp_path, rank=0, world_size=2, keep=1)
    r1 = FileCheckpointer(tmp_path, rank=1, world_size=2, keep=1)
    for step in (10, 20, 30, 40):
        # Rank 0 saves first, so its retention runs while its own step is not yet committed.
        r0.save(step, {"step": step})
        if step > 10:
            assert committed_steps(tmp_path, 2)[0] == step - 10, "the newest committed step must survive"
        r1.save(step, {"step": step})
    r0.save(50, {"step": 50})  # rank 1 never writes step 50

    assert committed_steps(tmp_path, 2) == [40]
    assert step_folders(tmp_path) == ["step-000000040", "step-000000050"]
    assert r1.restore().step == 40


# -- save failures ---------------------------------------------------------------------


def test_save_where_the_folder_cannot_be_created_raises_checkpoint_error(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a regular file where a folder should be")
    ck = FileCheckpointer(blocker / "ckpt")
    with pytest.raises(CheckpointError) as err:
        ck.save(10, {"x": 1})
    assert str(step_dir(blocker / "ckpt", 10)) in str(err.value)
    assert blocker.read_text() == "a regular file where a folder should be"
    assert committed_steps(blocker / "ckpt", 1) == []


def test_save_where_the_step_folder_is_a_file_raises_and_commits_nothing(tmp_path: Path) -> None:
    ck = FileCheckpointer(tmp_path, keep=10)
    ck.save(10, {"x": 10})
    step_dir(tmp_path, 20).write_text("not a folder")
    with pytest.raises(CheckpointError, match="step-000000020"):
        ck.save(20, {"x": 20})
    assert committed_steps(tmp_path, 1) == [10]
    assert ck.restore().step == 10


@pytest.mark.parametrize("blocked", ["rank-00000.pt.tmp", "manifest.json.tmp"])
def test_failed_write_inside_the_step_leaves_it_uncommitted(tmp_path: Path, blocked: str) -> None:
    ck = FileCheckpointer(tmp_path, keep=10)
    ck.save(10, {"x": 10})
    (step_dir(tmp_path, 20) / blocked).mkdir(parents=True)  # open(..., "wb") on it fails
    with pytest.raises(CheckpointError) as err:
        ck.save(20, {"x": 20})
    assert str(step_dir(tmp_path, 20)) in str(err.value)
    assert committed_steps(tmp_path, 1) == [10]
    restored = ck.restore()
    assert restored.step == 10 and restored.state == {"x": 10}


def test_negative_step_is_refused(tmp_path: Path) -> None:
    ck = FileCheckpointer(tmp_path)
    with pytest.raises(CheckpointError, match="-1"):
        ck.save(-1, {"x": 1})
    assert list(tmp_path.iterdir()) == []


# -- real multi-process agreement ------------------------------------------------------

WORKER = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from unbroken.checkpoint.rank.file import FileCheckpointer

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    directory, store = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world_size)
    ck = FileCheckpointer(directory, rank=rank, world_size=world_size, keep=10)
    for step in (1, 2, 3):
        ck.save(step, {"step": step, "rank": rank, "w": torch.full((64,), float(10 * step + rank))})
    dist.barrier()
    print("SAVED", flush=True)
    if sys.stdin.readline().strip() != "go":
        sys.exit(3)
    restored = ck.restore()
    print("RESULT " + json.dumps(None if restored is None else {
        "step": restored.step, "rank": restored.state["rank"], "w": restored.state["w"].tolist(),
        "source": restored.source,
    }), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    """
)


class _Worker:
    def __init__(self, rank: int, script: Path, directory: Path, store: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("UNBROKEN_", "TORCHELASTIC_"))}
        env.update(RANK=str(rank), WORLD_SIZE="2", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(SRC),
                   OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(directory), str(store)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_line(self, prefix: str, deadline: float) -> str:
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"timed out waiting for {prefix!r}; output so far:\n" + "\n".join(self.seen)) from None
            if line is None:
                raise AssertionError(f"worker exited ({self.proc.wait()}) before {prefix!r}:\n" + "\n".join(self.seen))
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def test_two_process_group_agrees_on_the_step_every_rank_can_read(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    directory = tmp_path / "ckpt"
    workers = [_Worker(rank, script, directory, tmp_path / "store") for rank in (0, 1)]
    deadline = time.monotonic() + 60
    try:
        for worker in workers:
            worker.wait_line("SAVED", deadline)
        assert committed_steps(directory, 2) == [3, 2, 1]
        victim = rank_file(directory, 3, 1)
        # Corrupt only tensor bits: the zip still parses, so only a checksum can tell.
        data = bytearray(victim.read_bytes())
        at = data.find(struct.pack("<f", 31.0) * 64)
        assert at > 0
        data[at + 100] ^= 0x01
        victim.write_bytes(bytes(data))

        for worker in workers:
            assert worker.proc.stdin is not None
            worker.proc.stdin.write("go\n")
            worker.proc.stdin.flush()
        results = [json.loads(w.wait_line("RESULT ", deadline)[len("RESULT "):]) for w in workers]
        for worker in workers:
            assert worker.proc.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, "\n".join(worker.seen)
    finally:
        for worker in workers:
            worker.kill()

    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} found nothing to restore"
        assert result["step"] == 2, f"rank {rank} restored step {result['step']}"
        assert result["rank"] == rank
        assert result["w"] == [float(20 + rank)] * 64
        assert result["source"] == str(step_dir(directory, 2))
    assert any(str(victim) in line for line in workers[1].seen), "rank 1 names the unreadable file"
    assert not step_dir(directory, 3).exists(), "rank 0 discards the step no rank set could restore"
    assert committed_steps(directory, 2) == [2, 1]


def test_a_step_written_by_another_world_size_is_not_committed_and_not_discarded(tmp_path: Path) -> None:
    """A world-size-4 run's step 30 (ranks 0 and 1 present) is not a step of a world-size-2 run."""
    two = [FileCheckpointer(tmp_path, rank=r, world_size=2) for r in range(2)]
    for ckpt in two:
        ckpt.save(10, {"x": torch.tensor([1.0])})
    four = [FileCheckpointer(tmp_path, rank=r, world_size=4) for r in range(2)]
    for ckpt in four:
        ckpt.save(30, {"x": torch.tensor([3.0])})
    assert committed_steps(tmp_path, 2) == [10]
    restored = two[0].restore()
    assert restored is not None and restored.step == 10
    assert step_dir(tmp_path, 30).is_dir(), "another run's folder is left alone"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs to fill needs root")
def test_disk_full_raises_checkpoint_error_and_leaves_the_previous_step_restorable(tmp_path: Path) -> None:
    disk = tmp_path / "small-disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], check=True)
    try:
        ckpt = FileCheckpointer(disk, rank=0, world_size=1)
        ckpt.save(1, {"x": torch.zeros(1000)})
        with pytest.raises(CheckpointError) as err:
            ckpt.save(2, {"x": torch.zeros(1_000_000)})  # 4 MB onto a 256 KiB disk
        message = str(err.value)
        assert "step 2" in message and str(disk) in message and "No space left" in message
        assert not list(disk.rglob("*.tmp")), "the half-written file is removed, not left filling the disk"
        assert committed_steps(disk, 1) == [1]
        restored = ckpt.restore()
        assert restored is not None and restored.step == 1
    finally:
        subprocess.run(["umount", str(disk)], check=True)
