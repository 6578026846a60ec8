"""Replica agreement: catch a rank whose replicated state silently stopped being its replicas'.

Data-parallel replicas (DDP's ranks; the replicate dimension of HSDP) must hold
bit-identical parameters and optimizer state after every optimizer step: each
applies the same all-reduced gradient to the same bytes. A GPU or its memory
that returns a wrong result without an error (silent data corruption) breaks
that, and nothing else notices until a loss curve does. So every
``every_steps`` steps the replicas compare a fingerprint of the state the
script declared replicated (``ctx.watch_replicas``):

- **Fingerprint**: per tensor, the block sums of its bytes
  (``checkpoint/rank/fingerprint.py``: one read, on the tensor's device, the
  same numbers on a GPU and a CPU), folded with odd weights into one 64-bit
  word per tensor and one per rank. An odd weight times any single changed bit
  (``±2**k``, ``k < 64``) is never ``0 mod 2**64``: one flipped bit anywhere
  always changes the rank's word.
- **One small collective**: an all-reduce (MAX) of eight int64 over the
  replica group: the word's two 32-bit halves, the tensor count and the byte
  count, and the same four negated; the replicas agree iff every maximum is
  minus the matching negated maximum (the maximum is the minimum). 64 bytes
  whatever the group's size, in a collective that runs as a tree at scale.
  Only when they differ (rarely), an all-gather of the four numbers votes and
  an all-gather of the per-tensor words names the first tensor that differs.
- **Vote**: a word held by more than half of the group is the agreed one and
  the others' ranks are the suspects; with no strict majority (two replicas,
  or a split) every rank is a suspect and the node's known-answer check
  decides (health/checks/known_answer.py).

What is not replicated must not be declared: per-rank RNG state, a sampler's
per-rank position, a non-replicated FSDP shard (``group`` names the
replicate dimension's group there). The check reads every declared byte
once: ~30 GB/s on one CPU core, ~3 TB/s on an H100.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from unbroken.checkpoint.rank import fingerprint

_FOLD_PRIME = 0x9E3779B97F4A7C15
"""Odd: folding with it keeps every single-bit change visible (see the module's docstring)."""


def tensors_of(state: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``state``'s tensors with dotted paths, in a fixed order (dict keys sorted: every replica walks the same)."""
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state  # a DTensor: this rank's shard
        yield prefix or "state", local.detach()
    elif isinstance(state, dict):
        for key in sorted(state, key=str):
            yield from tensors_of(state[key], f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(state, (list, tuple)):
        for index, item in enumerate(state):
            yield from tensors_of(item, f"{prefix}.{index}" if prefix else str(index))


def _odd_weights(count: int, device: torch.device) -> torch.Tensor:
    return torch.arange(count, dtype=torch.int64, device=device) * 2 + 1


def tensor_words(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One int64 per tensor: its block sums folded with odd weights (wrapping mod 2**64)."""
    words = []
    for tensor in tensors:
        sums = fingerprint.of_tensor(tensor)
        words.append((sums * _odd_weights(sums.numel(), sums.device)).sum().to(device) if sums.numel()
                     else torch.zeros((), dtype=torch.int64, device=device))
    if not words:
        return torch.zeros(0, dtype=torch.int64, device=device)
    return torch.stack(words)


def rank_word(words: torch.Tensor) -> torch.Tensor:
    """The rank's one word: its tensors' words folded with odd weights, and mixed so that swapped tensors show."""
    if words.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=words.device)
    return (words * (_odd_weights(words.numel(), words.device) * _FOLD_PRIME)).sum()


@dataclass(frozen=True)
class Verdict:
    """One comparison of the replicas' fingerprints at one step."""

    step: int
    agreed: bool
    suspects: tuple[int, ...] = ()
    """Global ranks whose state differs from the majority's; every rank of the group when there is no majority."""
    majority: bool = True
    """Whether a strict majority agreed (False: two replicas, or a split; the suspects are all of the group)."""
    tensor: str | None = None
    """The first declared tensor whose fingerprints differ, where one does."""

    def describe(self) -> str:
        if self.agreed:
            return f"replicas agree at step {self.step}"
        who = ", ".join(str(r) for r in self.suspects)
        where = f" in {self.tensor}" if self.tensor else ""
        if self.majority:
            return f"replicas disagree at step {self.step}{where}: rank {who} differs from the majority"
        return f"replicas disagree at step {self.step}{where} with no majority: ranks {who} are suspects"


def vote(words: list[tuple[int, ...]], ranks: list[int]) -> tuple[tuple[int, ...], bool]:
    """The suspects among ``ranks`` (each holding ``words[i]``) and whether a strict majority agreed."""
    counts = Counter(words)
    common, count = counts.most_common(1)[0]
    if count * 2 > len(words):
        return tuple(r for r, w in zip(ranks, words, strict=True) if w != common), True
    return tuple(ranks), False


def compare(step: int, state: dict[str, Any], group: Any = None) -> Verdict:
    """Compare ``state``'s fingerprint across ``group`` (default: the whole world). A collective: every rank
    of the group must call it at the same step with the same structure of state."""
    import torch.distributed as dist

    named = list(tensors_of(state))
    tensors = [t for _, t in named]
    device = tensors[0].device if tensors else torch.device("cpu")
    if device.type == "cuda" and dist.get_backend(group) == "gloo":
        device = torch.device("cpu")
    words = tensor_words(tensors, device)
    total = sum(t.numel() * t.element_size() for t in tensors)
    word = rank_word(words)
    # the word's halves as non-negative int64: negating them never overflows (negating -2**63 would)
    mine = torch.stack([word & 0xFFFFFFFF, (word >> 32) & 0xFFFFFFFF, torch.tensor(len(tensors), device=device),
                        torch.tensor(total, device=device)])
    extremes = torch.cat([mine, -mine])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    if torch.equal(extremes[:4], -extremes[4:]):
        return Verdict(step, True)
    size = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine, group=group)
    summary = [tuple(int(v) for v in g.tolist()) for g in gathered]
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    suspects, majority = vote(summary, ranks)
    return Verdict(step, False, suspects, majority, _first_differing(named, words, summary, group, size))


def _first_differing(named: list[tuple[str, torch.Tensor]], words: torch.Tensor, summary: list[tuple[int, ...]], group: Any,
                     size: int) -> str | None:
    """The first tensor whose words differ across the group; None where the structures differ (no common index)."""
    import torch.distributed as dist

    if len({s[2] for s in summary}) != 1:
        return None  # a different number of tensors: the structures differ, a script error rather than a flipped bit
    gathered = [torch.empty_like(words) for _ in range(size)]
    dist.all_gather(gathered, words, group=group)
    table = torch.stack(gathered).cpu()
    differs = (table != table[0]).any(dim=0).nonzero()
    return named[int(differs[0])][0] if differs.numel() else None


@dataclass
class ReplicaWatch:
    """What ``ctx.watch_replicas`` set up: the state to compare, where, how often, and the last step agreed on."""

    state: Callable[[], dict[str, Any]]
    every_steps: int
    group: Any = None
    agreed_step: int = -1
    """The last step the replicas agreed on: a restored step counts as agreed; -1 until the first check of an attempt
    that restored nothing (a disagreement then leaves nothing this attempt saved trusted)."""
    checks: int = 0
    last_checked: int | None = None

    def due(self, step: int) -> bool:
        """Every ``every_steps``-th step, once (a script may report the last step twice: in its loop and on its way out)."""
        return step % self.every_steps == 0 and step != self.last_checked

    def check(self, step: int) -> Verdict:
        verdict = compare(step, self.state(), self.group)
        self.checks += 1
        self.last_checked = step
        if verdict.agreed:
            self.agreed_step = step
        return verdict
