"""Replica agreement (``checkpoint/rank/agreement.py``) and ``chaos corrupt``'s rank side (``rank/bit_flip.py``):
the fingerprints and the vote with real gloo process groups, the flip through real optimizer hooks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import free_port
from unbroken.checkpoint.rank import agreement
from unbroken.rank.bit_flip import BitFlipper, FlipRequest, FlipTarget, read_done

RANKS = r'''
import json, sys
import torch, torch.distributed as dist
from unbroken.checkpoint.rank.agreement import ReplicaWatch
from unbroken.workloads.script import exit_rank

rank, world, store, plan = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 3))
optimizer = torch.optim.Adam(model.parameters())
model(torch.randn(8, 64)).sum().backward()
optimizer.step()
extra = {"per_rank": torch.full((4,), float(rank))} if plan.get("per_rank") else {}
group = dist.new_group(plan["group"]) if plan.get("group") else None
watch = ReplicaWatch(lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict(), **extra}, 10, group)
out = {}
if group is None or rank in plan["group"]:
    out["clean"] = watch.check(10).__dict__
    if rank in plan.get("flip", []):
        flat = model[0].weight.detach().view(-1).view(torch.uint8)
        flat[plan["byte"]] ^= 1 << plan["bit"]
    if plan.get("extra_tensor") and rank == 0:
        model.register_buffer("surprise", torch.zeros(2))
    verdict = watch.check(20)
    out["after"] = {**verdict.__dict__, "describe": verdict.describe()}
    out["agreed_step"] = watch.agreed_step
print("RESULT " + json.dumps(out), flush=True)
dist.barrier()  # nobody tears down while a peer still talks to it
dist.destroy_process_group()
exit_rank(0)  # as a rank ends: torch 2.13's gloo threads now and then abort in the C++ static destructors
'''


def run_ranks(tmp_path: Path, world: int, **plan: object) -> list[dict]:
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    store = tmp_path / f"store-{len(list(tmp_path.glob('store-*')))}"  # a file store is good for one group
    children = [subprocess.Popen([sys.executable, str(script), str(r), str(world), str(store), json.dumps(plan)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    results = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err[-2000:]
        results.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
    return results


@pytest.mark.parametrize("byte, bit", [(0, 0), (4099, 7), (1200 * 4 + 3, 6)])
def test_one_flipped_bit_anywhere_is_outvoted_and_named_with_its_tensor(tmp_path: Path, byte: int, bit: int) -> None:
    results = run_ranks(tmp_path, 3, flip=[2], byte=byte, bit=bit)
    for result in results:
        assert result["clean"]["agreed"] is True
        after = result["after"]
        assert after["agreed"] is False and after["suspects"] == [2] and after["majority"] is True
        assert after["tensor"] == "model.0.weight"
        assert after["describe"] == "replicas disagree at step 20 in model.0.weight: rank 2 differs from the majority"
        assert result["agreed_step"] == 10, "the last agreed step stays the one before the disagreement"


def test_two_replicas_have_no_majority_and_both_are_suspects(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, 2, flip=[1], byte=16, bit=3)
    assert all(r["after"]["suspects"] == [0, 1] and r["after"]["majority"] is False for r in results)
    assert "with no majority: ranks 0, 1 are suspects" in results[0]["after"]["describe"]


def test_replica_groups_compare_only_within_themselves(tmp_path: Path) -> None:
    """HSDP's replicate dimension: ranks 1 and 3 replicate each other; a flip on rank 3 names rank 3's group only,
    by global rank."""
    results = run_ranks(tmp_path, 4, group=[1, 3], flip=[3], byte=8, bit=1)
    assert results[0] == {} and results[2] == {}
    assert results[1]["after"]["suspects"] == [1, 3] and results[3]["after"]["suspects"] == [1, 3]


def test_a_per_rank_tensor_declared_replicated_shows_as_disagreement_and_identical_state_agrees(tmp_path: Path) -> None:
    """What is declared must be replicated: a per-rank tensor is a (script's) disagreement, told the same way."""
    results = run_ranks(tmp_path, 3, per_rank=True)
    assert all(r["clean"]["agreed"] is False and r["clean"]["tensor"] == "per_rank" for r in results)
    clean = run_ranks(tmp_path, 3)
    assert all(r["after"]["agreed"] is True and r["agreed_step"] == 20 for r in clean)


def test_states_of_different_structure_disagree_without_naming_a_tensor(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, 3, extra_tensor=True)
    assert all(r["after"]["agreed"] is False and r["after"]["suspects"] == [0] and r["after"]["tensor"] is None for r in results)


def test_every_single_bit_of_a_tensor_changes_the_rank_word() -> None:
    """The fold's promise, exhaustively over one 8-byte word at three offsets of a 3 MiB tensor (three blocks)."""
    tensor = torch.randn(3 * 2**18)
    base = int(agreement.rank_word(agreement.tensor_words([tensor], torch.device("cpu"))))
    raw = tensor.view(torch.uint8)
    for offset in (0, 2**20 + 4, tensor.numel() * 4 - 8):
        for bit in range(64):
            raw[offset + bit // 8] ^= 1 << (bit % 8)
            changed = int(agreement.rank_word(agreement.tensor_words([tensor], torch.device("cpu"))))
            raw[offset + bit // 8] ^= 1 << (bit % 8)
            assert changed != base, (offset, bit)


def test_every_single_bit_of_small_packed_tensors_changes_the_rank_word() -> None:
    """Tensors of up to a block are summed packed together (zero-padded to whole words): a flipped bit in any of
    them, a ragged one's last bytes included, still changes the word; and their words are each tensor's own."""
    tensors = [torch.randn(7), torch.zeros(0), torch.randn(3, 5).t(), torch.tensor(3.0), torch.randn(2**18)]
    base = int(agreement.rank_word(agreement.tensor_words(tensors, torch.device("cpu"))))
    for index in (0, 3, 4):
        raw = tensors[index].reshape(-1).view(torch.uint8)
        for byte in range(raw.numel() if raw.numel() <= 28 else 8):
            for bit in range(8):
                raw[byte] ^= 1 << bit
                changed = int(agreement.rank_word(agreement.tensor_words(tensors, torch.device("cpu"))))
                raw[byte] ^= 1 << bit
                assert changed != base, (index, byte, bit)
    transposed = tensors[2]  # not contiguous: read in row-major order, as its contiguous copy
    words = agreement.tensor_words(tensors, torch.device("cpu"))
    alone = agreement.tensor_words([transposed.contiguous()], torch.device("cpu"))
    assert int(words[2]) == int(alone[0]) and int(words[1]) == 0


STARTED_THEN_CHANGED = r'''
import json, sys
import torch, torch.distributed as dist
from unbroken.checkpoint.rank.agreement import ReplicaWatch
from unbroken.workloads.script import exit_rank

rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
weight = torch.ones(1000)
watch = ReplicaWatch(lambda: {"weight": weight}, 10)
watch.start(10)
if rank == 2:
    weight.view(torch.uint8)[5] ^= 4  # after the fingerprint: the check at 10 saw the state before it
dist.barrier()
first = watch.collect()
watch.start(20)
second = watch.collect()
print("RESULT " + json.dumps({"first": first.agreed, "second": [second.agreed, list(second.suspects)],
                              "agreed_step": watch.agreed_step, "checks": watch.checks}), flush=True)
dist.barrier()
dist.destroy_process_group()
exit_rank(0)  # as a rank ends: torch 2.13's gloo threads now and then abort in the C++ static destructors
'''


def test_a_check_fingerprints_when_it_starts_and_is_judged_when_collected(tmp_path: Path) -> None:
    """The all-reduce runs in the background between ``start`` (at one progress) and ``collect`` (at the next): the
    state may change meanwhile without touching the verdict, and a change before the next start is seen by it."""
    script = tmp_path / "started.py"
    script.write_text(STARTED_THEN_CHANGED)
    children = [subprocess.Popen([sys.executable, str(script), str(r), "3", str(tmp_path / "store")], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for r in range(3)]
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err[-2000:]
        result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        assert result == {"first": True, "second": [False, [2]], "agreed_step": 10, "checks": 2}


def test_the_last_steps_check_is_judged_before_the_rank_finishes(tmp_path: Path) -> None:
    """A flip caught only by the check at the job's last step: its verdict comes after the last ``progress``, at
    ``finished`` (``ctx.run``), so the job fails instead of ending on corrupted state (real torchrun, gloo, the MLP)."""
    request = tmp_path / "chaos-corrupt.json"
    FlipRequest(job=None, rank=2, step=13, target=FlipTarget.PARAMS).write(request)
    env = {**os.environ, "UNBROKEN_CHAOS_CORRUPT": str(request), "UNBROKEN_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "3", "--rdzv-backend",
               "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--max-restarts", "0", "-m", "unbroken.workloads.mlp",
               "--steps", "20", "--checkpoint-every", "10", "--watch-replicas", "10"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert read_done(request) is not None, output[-3000:]
    assert done.returncode != 0, output[-3000:]
    assert "silent data corruption: replicas disagree at step 20 in model." in output
    assert "rank 2 differs from the majority; last agreed step 10" in output


def test_vote_names_the_minority_or_everyone() -> None:
    assert agreement.vote([(1,), (1,), (2,)], [0, 1, 2]) == ((2,), True)
    assert agreement.vote([(1,), (2,), (3,)], [4, 5, 6]) == ((4, 5, 6), False)
    assert agreement.vote([(1,), (1,), (2,), (2,)], [0, 1, 2, 3]) == ((0, 1, 2, 3), False)


@pytest.mark.parametrize("target, changed", [(FlipTarget.PARAMS, "weight"), (FlipTarget.OPTIMIZER, "exp_avg"),
                                             (FlipTarget.GRADIENTS, "weight")])
def test_the_flip_lands_in_the_optimizer_step_after_the_asked_step_and_changes_one_bit(
        tmp_path: Path, target: FlipTarget, changed: str) -> None:
    torch.manual_seed(1)
    twin_a, twin_b = torch.nn.Linear(50, 40), torch.nn.Linear(50, 40)
    twin_b.load_state_dict(twin_a.state_dict())
    opt_a, opt_b = torch.optim.Adam(twin_a.parameters()), torch.optim.Adam(twin_b.parameters())
    request = tmp_path / "chaos-corrupt.json"
    FlipRequest(job="j", rank=1, step=3, target=target, attempt=0).write(request)
    flipper = BitFlipper(request, job="j", rank=1, attempt=0)
    other = BitFlipper(request, job="j", rank=0, attempt=0)  # another rank: never acts
    inputs = torch.randn(5, 50)
    for step in range(1, 5):  # the flip lands in step 4's optimizer step (after progress(3)); nothing runs after it
        for model, optimizer in ((twin_a, opt_a), (twin_b, opt_b)):
            optimizer.zero_grad()
            model(inputs).sum().backward()
            optimizer.step()
        flipper.after_progress(step)
        other.after_progress(step)
        if step < 3:
            assert read_done(request) is None
    done = read_done(request)
    assert done is not None and done.step == 3 and done.target == target.value and done.rank == 1
    if target is FlipTarget.OPTIMIZER:
        a, b = opt_a.state[twin_a.weight]["exp_avg"], opt_b.state[twin_b.weight]["exp_avg"]
        xor = (a.view(torch.int32) ^ b.view(torch.int32)).view(-1)
        differing = xor.nonzero().view(-1)
        assert differing.tolist() == [a.numel() // 2]  # exactly one element, and in it one bit
        assert int(xor[differing[0]]) == 1 << 3
    elif target is FlipTarget.PARAMS:
        xor = (twin_a.weight.view(torch.int32) ^ twin_b.weight.view(torch.int32)).view(-1)
        assert xor.nonzero().view(-1).tolist() == [twin_a.weight.numel() // 2] and int(xor[twin_a.weight.numel() // 2]) == 1 << 3
    else:
        # a gradient's top mantissa bit: that element's update differs, and only that one
        differs = (twin_a.weight != twin_b.weight).view(-1).nonzero().view(-1).tolist()
        assert differs == [twin_a.weight.numel() // 2], differs
        assert torch.equal(twin_a.bias, twin_b.bias)


def test_a_request_for_another_attempt_or_job_is_ignored_and_a_done_one_never_flips_again(tmp_path: Path) -> None:
    torch.manual_seed(2)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    request = tmp_path / "chaos-corrupt.json"
    FlipRequest(job="j", rank=0, step=0, target=FlipTarget.PARAMS, attempt=1).write(request)
    BitFlipper(request, job="j", rank=0, attempt=0).after_progress(5)
    BitFlipper(request, job="other", rank=0, attempt=1).after_progress(5)
    optimizer.step()
    assert read_done(request) is None
    FlipRequest(job=None, rank=0, step=0, target=FlipTarget.PARAMS).write(request)
    BitFlipper(request, job="any", rank=0, attempt=3).after_progress(0)
    before = model.weight.detach().clone()
    optimizer.step()
    assert read_done(request) is not None and not torch.equal(before, model.weight)
    after = model.weight.detach().clone()
    BitFlipper(request, job="any", rank=0, attempt=4).after_progress(9)  # a restarted rank: the request is done
    optimizer.step()
    assert torch.equal(after, model.weight)


def test_a_check_of_a_state_seen_before_makes_no_tensor_from_host_data(tmp_path: Path) -> None:
    """A tensor made from host data (``torch.tensor(...)`` on a device) is a synchronous copy: on a GPU the host
    waits there for every kernel queued before the check, the training step's, which the deferred verdict exists to
    avoid (on an H100 a check of 1 GiB cost the host 9.7 ms beside a 5 ms step). Each such tensor shows as
    ``aten.lift_fresh``; after the first check of a state, which makes the constants of its structure, none may."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    class FromHostData(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.made = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
            self.made += func is torch.ops.aten.lift_fresh.default
            return func(*args, **(kwargs or {}))

    state = {"small": [torch.randn(1 + 97 * i) for i in range(40)], "large": torch.randn(3 << 18)}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert agreement.InFlight.start(1, state).verdict().agreed
        with FromHostData() as seen:
            flight = agreement.InFlight.start(2, state)
        assert flight.verdict().agreed
        assert seen.made == 0
    finally:
        dist.destroy_process_group()
