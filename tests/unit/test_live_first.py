"""``LiveFirst`` without a process group: a job of one rank (an elastic job shrunk to its last pod) restores the
survivor's own memory, newer than any checkpoint; without live state it reads the checkpoints as before."""

from __future__ import annotations

from pathlib import Path

import torch

from unbroken.checkpoint.rank import rng
from unbroken.checkpoint.rank.file import FileCheckpointer
from unbroken.checkpoint.rank.live import LiveFirst, LiveState


def test_a_group_of_one_restores_its_own_memory_newer_than_the_checkpoint_and_else_the_checkpoint(tmp_path: Path) -> None:
    files = FileCheckpointer(tmp_path, rank=0, world_size=1)
    files.save(10, {"w": torch.zeros(3)})
    live = LiveState(step=17, state={"w": torch.ones(3)}, rng=rng.capture())

    restored = LiveFirst(files, live, rank=0).restore()
    assert restored is not None and (restored.step, restored.source) == (17, "own memory")
    assert torch.equal(restored.state["w"], torch.ones(3))

    from_files = LiveFirst(files, None, rank=0).restore()
    assert from_files is not None and from_files.step == 10 and torch.equal(from_files.state["w"], torch.zeros(3))
