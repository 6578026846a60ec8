"""The checkpoint collectives (``checkpoint/rank/collectives.py``) with real process groups.

No GPU here, so NCCL cannot run; a ``cuda:gloo`` group stands in for the NCCL-only
group ``unbroken.init()`` makes on GPUs: like it, it serves no CPU tensors, and the
file checkpointer's old CPU all-reduce fails on it exactly as on NCCL ("No backend
type associated with device type cpu").
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import unbroken.checkpoint as checkpoint_package

RANK_SCRIPT = r'''
import json, sys
from pathlib import Path
import torch, torch.distributed as dist
from unbroken.checkpoint.rank import collectives
from unbroken.checkpoint.rank.file import FileCheckpointer

backend, rank, world, store, ckpt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
dist.init_process_group(backend=backend, init_method=f"file://{store}", rank=rank, world_size=world)
out = {"device": collectives.device().type}
if "cpu" in dist.get_backend_config():
    out["all_ok"] = collectives.all_ok(rank == 0)
    out["all_ok_true"] = collectives.all_ok(True)
    out["any_rank"] = collectives.any_rank(rank == 1)
    out["from_rank0"] = collectives.from_rank0(lambda: {"rank": dist.get_rank(), "steps": [3, 2]})
    def boom():
        raise OSError("disk gone")
    try:
        collectives.from_rank0(boom)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    ck = FileCheckpointer(Path(ckpt), rank=rank, world_size=world)
    for step in (1, 2):
        ck.save(step, {"w": torch.full((3,), float(step))})
    dist.barrier()
    if rank == 1:  # rank 1's newest file is damaged: every rank must fall back to step 1 together
        path = Path(ckpt) / "step-000000002" / "rank-00001.pt"
        path.write_bytes(path.read_bytes()[:50])
    dist.barrier()
    restored = ck.restore()
    out["restored"] = restored.step if restored else None
print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
'''


def run_ranks(tmp_path: Path, backend: str, world: int = 2) -> list[dict]:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    store = tmp_path / f"store-{backend.replace(':', '_').replace(',', '_')}"
    ckpt = tmp_path / f"ckpt-{store.name}"
    procs = [subprocess.Popen([sys.executable, str(script), backend, str(r), str(world), str(store), str(ckpt)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    results = []
    for proc in procs:
        output, _ = proc.communicate(timeout=120)
        line = next((line for line in output.splitlines() if line.startswith("RESULT ")), None)
        assert line is not None, output
        import json

        results.append(json.loads(line.removeprefix("RESULT ")))
    return results


@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo", "cpu:gloo,cuda:gloo"])
def test_ranks_agree_and_restore_together_on_groups_that_serve_the_cpu(tmp_path: Path, backend: str) -> None:
    results = run_ranks(tmp_path, backend)
    for rank, out in enumerate(results):
        assert out["device"] == "cpu"
        assert out["all_ok"] is False and out["all_ok_true"] is True and out["any_rank"] is True
        assert out["from_rank0"] == {"rank": 0, "steps": [3, 2]}, f"rank {rank} did not get rank 0's value"
        assert out["error"] == "CheckpointError: rank 0 failed while choosing what to restore: OSError: disk gone"
        assert out["restored"] == 1, f"rank {rank} restored {out['restored']}: ranks must fall back together"


def test_a_group_that_serves_no_cpu_gets_its_flags_on_the_gpu(tmp_path: Path) -> None:
    """The defect: the file checkpointer all-reduced a CPU tensor, which an NCCL-only group refuses."""
    [out] = run_ranks(tmp_path, "cuda:gloo", world=1)
    assert out["device"] == "cuda"


def test_checkpoint_modules_run_collectives_only_through_the_helpers() -> None:
    """One place decides the device: no other checkpoint module calls a torch collective itself."""
    package = Path(checkpoint_package.__file__).parent
    call = re.compile(r"\bdist\.(all_reduce|broadcast|broadcast_object_list|all_gather\w*|reduce\w*|gather\w*|scatter\w*)\(")
    offenders = [f"{path.name}: {match.group(0)}" for path in sorted(package.glob("*.py")) if path.name != "collectives.py"
                 for match in call.finditer(path.read_text())]
    assert offenders == []
