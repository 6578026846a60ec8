"""The memory tier's CUDA calls behind one narrow seam, and the process's record of pinned ranges.

A device-to-host copy runs at the PCIe link's speed (~55 GB/s on an H100) only
into page-locked memory; the memory tier's slots are shared-memory mappings, so
it registers them with ``cudaHostRegister``. CUDA's rules for that, which an
H100 taught us the hard way:

- A range may be registered once. Registering a range that overlaps a
  registered one fails with 712 (``cudaErrorHostMemoryAlreadyRegistered``).
- A registration pins the pages that were mapped when it was made and outlives
  the mapping: a slot re-mapped at the same address without
  ``cudaHostUnregister`` first gets 712, and the driver's copies into that
  address still land in the *old* pages, so the new mapping holds stale bytes
  that a checksum of the mapping calls good. Unregister before unmapping.
- Every call returns a ``cudaError``; 0 is success. Nothing else tells.

:class:`PinnedMemory` keeps those rules for the whole process (one record of
what is registered, every return code checked, never a second registration of
a range); :class:`CudaRuntime` is the seam, a handful of calls, so that the
CPU tests run the same code against a stand-in that enforces the rules
(tests/cuda_rules.py). No torch import at module level: the node agent imports
the memory tier and must start fast.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

log = logging.getLogger("unbroken.checkpoint.node.cuda_host")

SUCCESS = 0
HOST_MEMORY_ALREADY_REGISTERED = 712
HOST_MEMORY_NOT_REGISTERED = 713
ERROR_NAMES = {1: "cudaErrorInvalidValue", 2: "cudaErrorMemoryAllocation", 712: "cudaErrorHostMemoryAlreadyRegistered",
               713: "cudaErrorHostMemoryNotRegistered", 801: "cudaErrorNotSupported"}


def error_name(code: int) -> str:
    return f"{code} ({ERROR_NAMES.get(code, 'cudaError')})"


def address_of(view: Any) -> int:
    """The address of a writable buffer (an ``mmap``): what ``cudaHostRegister`` takes.
    The ctypes object is dropped at once, so the buffer can still be closed."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class CudaRuntime(Protocol):
    """The CUDA calls the memory tier makes, and nothing else."""

    def is_device(self, tensor: torch.Tensor) -> bool:
        """The tensor lives on the device: its bytes reach a slot by a device-to-host copy."""

    def host_register(self, view: Any, size: int) -> int:
        """``cudaHostRegister`` of the first ``size`` bytes of ``view`` (a mapping); a ``cudaError``."""

    def host_unregister(self, view: Any) -> int:
        """``cudaHostUnregister`` of the range registered at ``view``'s address; a ``cudaError``."""

    def copy_to_host(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        """Queue ``source``'s bytes into ``destination`` (host memory) on the current copy stream."""

    def copy_to_device(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        """Queue ``source``'s bytes (pinned host memory) into ``destination`` (device memory) on the current stream."""

    def pinned_buffer(self, nbytes: int) -> torch.Tensor:
        """Page-locked host memory the runtime allocated itself (``cudaHostAlloc``): a bounce buffer."""

    def marker(self) -> Any:
        """A marker after the work queued so far on the caller's current stream (for a save: the values it must see)."""

    def wait(self, marker: Any) -> None:
        """Until the work before ``marker`` is done (a pinned buffer it read may be written again)."""

    @contextmanager
    def copy_stream(self, ready: Any) -> Iterator[None]:
        """Queue what runs inside on the copy stream, after ``ready``."""
        yield

    def synchronize(self) -> None:
        """Until everything queued on the copy stream is done."""


@dataclass
class PinnedMemory:
    """What this process has registered with CUDA, by start address, and the one place that registers.

    ``pin`` never registers a range that overlaps a recorded one (CUDA would answer 712 and the
    copies would go to another mapping's pages); ``unpin`` is called before a pinned mapping is
    closed or re-mapped. A failed call is logged once per kind of failure and answered with
    False: the memory tier then copies through a bounce buffer, slower but exact.
    """

    runtime: CudaRuntime
    ranges: dict[int, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _said: set[str] = field(default_factory=set)

    def pin(self, view: Any, size: int) -> bool:
        if size <= 0:
            return False
        address = address_of(view)
        with self._lock:
            clash = next(((start, length) for start, length in self.ranges.items()
                          if start < address + size and address < start + length), None)
            if clash is not None:
                self._say_once("overlap", f"not pinning {size} bytes at {address:#x}: they overlap {clash[1]} bytes pinned at "
                                          f"{clash[0]:#x} (CUDA would refuse with 712); copying through a bounce buffer")
                return False
            code = int(self.runtime.host_register(view, size))
            if code != SUCCESS:
                self._say_once(f"register-{code}", f"cudaHostRegister of {size / 2**20:.1f} MiB failed: {error_name(code)}; "
                                                   "saves of that slot copy through a bounce buffer")
                return False
            self.ranges[address] = size
            return True

    def unpin(self, view: Any) -> None:
        """Unregister the range pinned at ``view``'s address; call it before the mapping is closed."""
        address = address_of(view)
        with self._lock:
            if self.ranges.pop(address, None) is None:
                return
            code = int(self.runtime.host_unregister(view))
        if code != SUCCESS:
            # The range is forgotten either way: its mapping is about to go, and keeping it recorded would
            # refuse every later mapping at that address.
            self._say_once(f"unregister-{code}", f"cudaHostUnregister at {address:#x} failed: {error_name(code)}")

    def pinned(self, view: Any, size: int) -> bool:
        """The whole of ``view``'s first ``size`` bytes lies in one range pinned here."""
        address = address_of(view)
        with self._lock:
            return any(start <= address and address + size <= start + length for start, length in self.ranges.items())

    @property
    def pinned_bytes(self) -> int:
        with self._lock:
            return sum(self.ranges.values())

    def _say_once(self, kind: str, message: str) -> None:
        if kind not in self._said:
            self._said.add(kind)
            log.warning(message)
            print(f"unbroken: memory tier: {message}", flush=True)


class _Cuda:
    """The real runtime: torch's bindings of ``cudart``, a copy stream per device.

    Made on the rank's training thread (the first device tensor saved or restored), it keeps that
    thread's device and makes it current around every call from another thread: a background thread
    starts on device 0, and a CUDA call there would make a context on GPU 0 for every rank of the node.
    """

    def __init__(self) -> None:
        import torch

        self._device = torch.cuda.current_device()
        self._streams: dict[int, Any] = {}
        self._local = threading.local()

    def is_device(self, tensor: torch.Tensor) -> bool:
        return bool(tensor.is_cuda)

    def host_register(self, view: Any, size: int) -> int:
        import torch

        with torch.cuda.device(self._device):
            return int(torch.cuda.cudart().cudaHostRegister(address_of(view), size, 0))

    def host_unregister(self, view: Any) -> int:
        import torch

        with torch.cuda.device(self._device):
            return int(torch.cuda.cudart().cudaHostUnregister(address_of(view)))

    def copy_to_host(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        destination.copy_(source, non_blocking=True)

    def copy_to_device(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        destination.copy_(source, non_blocking=True)

    def pinned_buffer(self, nbytes: int) -> torch.Tensor:
        import torch

        with torch.cuda.device(self._device):
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def marker(self) -> Any:
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return (event, torch.cuda.current_device())

    def wait(self, marker: Any) -> None:
        import torch

        event, device = marker
        with torch.cuda.device(device):
            event.synchronize()

    @contextmanager
    def copy_stream(self, ready: Any) -> Iterator[None]:
        import torch

        event, device = ready
        with torch.cuda.device(device):
            stream = self._streams.get(device)
            if stream is None:
                # the highest priority there is: its few kernels (fingerprints) go ahead of the training's queued ones
                stream = self._streams[device] = torch.cuda.Stream(device=device, priority=-100)
            stream.wait_event(event)  # the caller's stream had queued the last writes to the tensors
            self._local.stream = stream
            with torch.cuda.stream(stream):
                yield

    def synchronize(self) -> None:
        stream = getattr(self._local, "stream", None)
        if stream is not None:
            stream.synchronize()


_process: PinnedMemory | None = None
_process_lock = threading.Lock()


def process_pinned_memory() -> PinnedMemory:
    """The record of this process's registrations over the real CUDA runtime: one per process, since
    CUDA's registrations are per process (every checkpointer of it, in-process restarts included)."""
    global _process
    with _process_lock:
        if _process is None:
            _process = PinnedMemory(_Cuda())
        return _process
