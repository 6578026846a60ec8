"""``unbroken chaos corrupt``'s rank side: flip one bit of this rank's training state, through the rank itself.

Silent data corruption cannot be caused on purpose on a healthy GPU (or a
CPU), so it is injected where it would land: one bit of one tensor the rank
trains, changed in place, with nothing raised. The chaos command writes a
request (a small JSON file); every rank looks for it at each ``progress``
(one ``stat``), whether it watches its replicas or not (a job that does not
is the baseline: nothing notices), and once the rank has reported the request's step it flips the bit in the
next optimizer step:

- ``params``: a parameter, right after the step updated it;
- ``optimizer``: the first tensor of that parameter's optimizer state (Adam's
  ``exp_avg``), right after the step;
- ``gradients``: that parameter's gradient, right before the step uses it
  (after DDP's all-reduce: the replicas' gradients were equal until then).

The parameter is the first of the optimizer's first parameter group; the
element is the one in the middle of the tensor; the bit is counted in the
element's little-endian word (0: the lowest). By default a parameter or an
optimizer state gets bit 3 (float32: a change of about one part in a
million, which no loss curve shows) and a gradient bit 22 (float32: the
mantissa's top bit, up to half the value): a gradient's low bit is mostly
rounded away by the update it feeds, which is then no corruption at all. The rank
writes what it did beside the request (``<request>.done``), which the command
waits for; a request is done once, whatever restarts follow.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

REQUEST_ENV = "UNBROKEN_CHAOS_CORRUPT"
"""A request file's path, for ranks outside an agent (benchmarks, tests); under an agent the node's own file."""
REQUEST_FILE = "chaos-corrupt.json"
DEFAULT_BIT = {"params": 3, "optimizer": 3, "gradients": 22}
"""The bit of the element's word flipped unless the request names one (see the module's docstring)."""


class FlipTarget(StrEnum):
    PARAMS = "params"
    OPTIMIZER = "optimizer"
    GRADIENTS = "gradients"


@dataclass(frozen=True)
class FlipRequest:
    job: str | None
    """The job whose rank acts on it (None: any: a benchmark's plain torchrun, whose run id is random)."""
    rank: int
    step: int
    """The flip lands in the first optimizer step after the rank reported this step."""
    target: FlipTarget
    attempt: int | None = None
    """Only ranks of this attempt act on it (None: any); a restarted rank never flips again."""
    bit: int | None = None
    """The bit of the element's little-endian word (None: ``DEFAULT_BIT`` for the target)."""

    @property
    def word_bit(self) -> int:
        return self.bit if self.bit is not None else DEFAULT_BIT[self.target.value]

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        done_path(path).unlink(missing_ok=True)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps({**asdict(self), "target": self.target.value}))
        os.replace(temporary, path)

    @classmethod
    def read(cls, path: Path) -> FlipRequest | None:
        try:
            raw = json.loads(path.read_text())
            return cls(job=None if raw.get("job") is None else str(raw["job"]), rank=int(raw["rank"]), step=int(raw["step"]), target=FlipTarget(raw["target"]),
                       attempt=None if raw.get("attempt") is None else int(raw["attempt"]),
                       bit=None if raw.get("bit") is None else int(raw["bit"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def done_path(request: Path) -> Path:
    return request.with_suffix(".done")


@dataclass(frozen=True)
class Flipped:
    """What the rank changed, written to ``<request>.done``."""

    job: str
    rank: int
    attempt: int
    step: int
    target: str
    tensor: str
    byte: int
    bit: int
    pid: int


class BitFlipper:
    """A rank's watch for its corrupt request; cheap while there is none (one ``stat`` per ``progress``)."""

    def __init__(self, path: Path | None, *, job: str, rank: int, attempt: int) -> None:
        self.path = path
        self.job, self.rank, self.attempt = job, rank, attempt
        self._seen: float | None = None
        self._pending: FlipRequest | None = None
        """A request for this rank, read, whose step is not reached yet."""
        self._armed: FlipRequest | None = None
        self._hooks: list[Any] = []
        self._last_step: int | None = None

    def after_progress(self, step: int) -> None:
        """Called at each ``progress(step)``: arms the flip once the request's step is reached."""
        self._last_step = step
        if self.path is None or self._armed is not None:
            return
        if self._pending is None:
            self._pending = self._new_request()
        if self._pending is not None and step >= self._pending.step:
            self._arm(self._pending)

    def _new_request(self) -> FlipRequest | None:
        """A request for this rank and attempt written since the last look, not done yet."""
        assert self.path is not None
        try:
            mtime = self.path.stat().st_mtime
        except OSError:
            return None
        if mtime == self._seen:
            return None
        self._seen = mtime
        request = FlipRequest.read(self.path)
        if request is None or (request.job is not None and request.job != self.job) or request.rank != self.rank or done_path(self.path).exists():
            return None
        if request.attempt is not None and request.attempt != self.attempt:
            return None
        return request

    def _arm(self, request: FlipRequest) -> None:
        import torch.optim.optimizer as optimizer_module

        self._armed = request
        if request.target is FlipTarget.GRADIENTS:
            self._hooks.append(optimizer_module.register_optimizer_step_pre_hook(self._before_step))
        else:
            self._hooks.append(optimizer_module.register_optimizer_step_post_hook(self._after_step))

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        parameter = _first_parameter(optimizer)
        if parameter is not None and parameter.grad is not None:
            self._flip(parameter.grad, "grad of the first parameter")

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        parameter = _first_parameter(optimizer)
        if parameter is None:
            return
        assert self._armed is not None
        if self._armed.target is FlipTarget.PARAMS:
            self._flip(parameter.data, "the first parameter")
            return
        state = optimizer.state.get(parameter, {})
        name, tensor = next(((k, v) for k, v in sorted(state.items()) if _floating(v) and v.numel() > 1), (None, None))
        if tensor is not None:
            self._flip(tensor, f"optimizer state {name} of the first parameter")

    def _flip(self, tensor: Any, what: str) -> None:
        import torch

        assert self._armed is not None and self.path is not None
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if hasattr(tensor, "to_local"):
            tensor = tensor.to_local()  # a DTensor (FSDP2): this rank's shard; a view of the whole would be a collective
        flat = tensor.detach().view(-1)
        request, self._armed = self._armed, None
        self._pending = None
        word_bit = min(request.word_bit, flat.element_size() * 8 - 1)
        byte = flat.numel() // 2 * flat.element_size() + word_bit // 8
        with torch.no_grad():
            flat.view(torch.uint8)[byte] ^= 1 << (word_bit % 8)
        done = Flipped(job=self.job, rank=self.rank, attempt=self.attempt, step=self._last_step if self._last_step is not None else -1,
                       target=request.target.value, tensor=what, byte=byte, bit=word_bit % 8, pid=os.getpid())
        done_path(self.path).write_text(json.dumps(asdict(done)))
        print(f"unbroken: chaos corrupt: flipped bit {done.bit} of byte {byte} of {what} on rank {self.rank} "
              f"after step {done.step}", flush=True)


def _first_parameter(optimizer: Any) -> Any:
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if parameter.numel() > 1:
                return parameter
    return None


def _floating(value: Any) -> bool:
    return hasattr(value, "is_floating_point") and value.is_floating_point()


def read_done(request: Path) -> Flipped | None:
    try:
        return Flipped(**json.loads(done_path(request).read_text()))
    except (OSError, ValueError, TypeError):
        return None
