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
  word per tensor and one per rank; the tensors of up to a block (most of a
  model's, by count) packed and summed together in a few kernels. An odd weight times any single changed bit
  (``±2**k``, ``k < 64``) is never ``0 mod 2**64``: one flipped bit anywhere
  always changes the rank's word.
- **One small collective**: an all-reduce (MAX) of eight int64 over the
  replica group: the word's two 32-bit halves, the tensor count and the byte
  count, and the same four negated; the replicas agree iff every maximum is
  minus the matching negated maximum (the maximum is the minimum). 64 bytes
  whatever the group's size, in a collective that runs as a tree at scale,
  and in the background: started at a due step's ``progress``, judged at the
  next one (``ReplicaWatch``), so no rank waits there for its slowest replica.
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

import functools
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


_WORD = 8
PACKED_BYTES = fingerprint.BLOCK_BYTES
"""Tensors of up to one block are summed together: their bytes packed into one buffer (one copy, a few kernels in all)
and summed per tensor with one ``index_add_``, where each on its own costs a handful of kernels. A model's state has
hundreds of them (biases, norms, Adam's step counters); on a GPU their launches, not their bytes, would be the check's
cost."""


def tensor_words(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One int64 per tensor (wrapping mod 2**64). A tensor of up to ``PACKED_BYTES``: the sum of its bytes read as
    little-endian 8-byte words, zero-padded to a whole word. A larger one: its block sums (fingerprint.py) folded
    with odd weights. Either way one flipped bit changes its word."""
    words = torch.zeros(len(tensors), dtype=torch.int64, device=device)
    packed: dict[torch.device, list[int]] = {}
    for index, tensor in enumerate(tensors):
        if tensor.numel() * tensor.element_size() <= PACKED_BYTES:
            packed.setdefault(tensor.device, []).append(index)
        else:
            sums = fingerprint.of_tensor(tensor)
            words[index] = (sums * _odd_weights(sums.numel(), sums.device)).sum().to(device)
    for where, indices in packed.items():
        words.index_copy_(0, _on_device(tuple(indices), device), _packed_words([tensors[i] for i in indices], where).to(device))
    return words


@functools.lru_cache(maxsize=32)
def _on_device(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, made once per state's structure. Made at every check it would
    cost a synchronous copy from the host: on a GPU the host waiting for every kernel queued before the check (the
    training step's), which is what the deferred verdict is there to avoid."""
    return torch.tensor(values, dtype=torch.int64, device=device)


def _packed_words(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    zeros = torch.zeros(_WORD, dtype=torch.uint8, device=device)
    pieces: list[torch.Tensor] = []
    lengths: list[int] = []
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        raw = flat.view(torch.uint8)
        pad = -raw.numel() % _WORD
        pieces.append(raw)
        if pad:
            pieces.append(zeros[:pad])
        lengths.append((raw.numel() + pad) // _WORD)
    data = torch.cat(pieces).view(torch.int64)
    return torch.zeros(len(tensors), dtype=torch.int64, device=device).index_add_(0, _segments(tuple(lengths), device), data)



@functools.lru_cache(maxsize=16)
def _segments(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Each packed word's tensor index: the same for every check of the same state, so made once."""
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)


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
    """Compare ``state``'s fingerprint across ``group`` (default: the whole world) and wait for the verdict. A
    collective: every rank of the group must call it at the same step with the same structure of state."""
    return InFlight.start(step, state, group).verdict()


@dataclass
class InFlight:
    """A comparison whose all-reduce is on its way: the fingerprint was taken at ``step`` (so the state may change
    now), the verdict is read later (``verdict``), when the all-reduce has long finished, so that the ranks' check
    costs only the fingerprint, not a wait for the slowest replica."""

    step: int
    group: Any
    names: list[str]
    words: torch.Tensor
    mine: torch.Tensor
    extremes: torch.Tensor
    work: Any
    host: torch.Tensor | None = None
    """On a GPU: a pinned copy of the result, read once ``copied`` has happened, so that reading it waits for the
    GPU only up to the all-reduce, not for everything queued after it."""
    copied: Any = None

    @classmethod
    def start(cls, step: int, state: dict[str, Any], group: Any = None) -> InFlight:
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
        mine = torch.cat([torch.stack([word & 0xFFFFFFFF, (word >> 32) & 0xFFFFFFFF]), _on_device((len(tensors), total), device)])
        extremes = torch.cat([mine, -mine])
        work = dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group, async_op=True)
        flight = cls(step, group, [name for name, _ in named], words, mine, extremes, work)
        if device.type == "cuda":
            work.wait()  # the current stream waits for the all-reduce; the host does not
            flight.host = torch.empty_like(extremes, device="cpu").pin_memory()
            flight.host.copy_(extremes, non_blocking=True)
            flight.copied = torch.cuda.Event()
            flight.copied.record()
        return flight

    def verdict(self) -> Verdict:
        """Wait for the all-reduce and judge. Collective when the replicas disagree (the vote's all-gathers): every
        rank of the group must call it at the same point."""
        import torch.distributed as dist

        if self.host is not None:
            self.copied.synchronize()
            extremes = self.host
        else:
            self.work.wait()
            extremes = self.extremes
        if torch.equal(extremes[:4], -extremes[4:]):
            return Verdict(self.step, True)
        size = dist.get_world_size(self.group)
        gathered = [torch.empty_like(self.mine) for _ in range(size)]
        dist.all_gather(gathered, self.mine, group=self.group)
        summary = [tuple(int(v) for v in g.tolist()) for g in gathered]
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else list(range(size))
        suspects, majority = vote(summary, ranks)
        return Verdict(self.step, False, suspects, majority, _first_differing(self.names, self.words, summary, self.group, size))


def _first_differing(names: list[str], words: torch.Tensor, summary: list[tuple[int, ...]], group: Any,
                     size: int) -> str | None:
    """The first tensor whose words differ across the group; None where the structures differ (no common index)."""
    import torch.distributed as dist

    if len({s[2] for s in summary}) != 1:
        return None  # a different number of tensors: the structures differ, a script error rather than a flipped bit
    gathered = [torch.empty_like(words) for _ in range(size)]
    dist.all_gather(gathered, words, group=group)
    table = torch.stack(gathered).cpu()
    differs = (table != table[0]).any(dim=0).nonzero()
    return names[int(differs[0])] if differs.numel() else None


@dataclass
class ReplicaWatch:
    """What ``ctx.watch_replicas`` set up: the state to compare, where, how often, and the last step agreed on.

    A check starts at a due step's ``progress`` (``start``: the fingerprint, the all-reduce sent) and is judged at
    the next ``progress`` (``collect``), a step later, by when the all-reduce has finished in the background: the
    rank pays for reading its state, not for waiting on its slowest replica. What was saved in between is after
    the last agreed step, so a disagreement keeps it from any restore all the same."""

    state: Callable[[], dict[str, Any]]
    every_steps: int
    group: Any = None
    agreed_step: int = -1
    """The last step the replicas agreed on: a restored step counts as agreed; -1 until the first check of an attempt
    that restored nothing (a disagreement then leaves nothing this attempt saved trusted)."""
    checks: int = 0
    last_checked: int | None = None
    in_flight: InFlight | None = None

    def due(self, step: int) -> bool:
        """Every ``every_steps``-th step, once (a script may report the last step twice: in its loop and on its way out)."""
        return step % self.every_steps == 0 and step != self.last_checked

    def start(self, step: int) -> None:
        """Fingerprint the state now and send the all-reduce; ``collect`` judges it."""
        self.in_flight = InFlight.start(step, self.state(), self.group)
        self.last_checked = step

    def collect(self) -> Verdict | None:
        """The verdict of the check in flight, if one is (waiting for its all-reduce). Every rank of the group calls
        it at the same point: a disagreement's vote is collective."""
        flight, self.in_flight = self.in_flight, None
        if flight is None:
            return None
        verdict = flight.verdict()
        self.checks += 1
        if verdict.agreed:
            self.agreed_step = verdict.step
        return verdict

    def check(self, step: int) -> Verdict:
        """Start and judge at once, waiting for the all-reduce (the tests' synchronous form; ``ctx`` starts at one
        ``progress`` and collects at the next)."""
        self.start(step)
        verdict = self.collect()
        assert verdict is not None
        return verdict
