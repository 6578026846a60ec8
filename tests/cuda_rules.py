"""A stand-in for the CUDA runtime that keeps CUDA's documented rules for registered host memory.

No GPU runs here, so the memory tier's device path runs on CPU tensors that play
device tensors, against this stand-in for the few calls it makes
(``unbroken.checkpoint.node.cuda_host.CudaRuntime``). It is as thin as it can be, and
strict where CUDA is:

- ``cudaHostRegister`` of a range that overlaps a registered one returns 712
  (``cudaErrorHostMemoryAlreadyRegistered``); ``cudaHostUnregister`` of an
  address that is not registered returns 713.
- A registered range holds its pages: the stand-in keeps a buffer export of the
  mapping, so closing (unmapping or re-mapping) a registered ``mmap`` raises
  ``BufferError`` in the code that does it, where real CUDA would go on copying
  into the old pages and the new mapping would hold stale bytes.
- A device-to-host copy into registered memory goes through the registration
  (the DMA engine writes the pages it pinned); into unregistered memory it is
  the runtime's own staged copy. ``corrupt_next`` makes the next copies deliver
  one flipped bit, as a copy gone wrong would: what the tier's read-back must catch;
  ``fail_next`` makes them raise.

By default everything else (streams, events) is a no-op: on a CPU the copy is done
when the call returns. With ``asynchronous=True`` device-to-host copies are queued,
as on a CUDA stream, and land only when the host waits for them: ``wait`` on a
marker (an event) runs the copies queued before it, ``synchronize`` all of them. A
reader that does not wait for a copy sees the bytes that were there before it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from unbroken.checkpoint.node.cuda_host import HOST_MEMORY_ALREADY_REGISTERED, HOST_MEMORY_NOT_REGISTERED, SUCCESS, address_of


@dataclass
class Registration:
    address: int
    size: int
    pages: memoryview
    """The export that pins the mapping: while it lives, the mapping cannot be closed."""
    thread: str


@dataclass
class RuleKeepingCuda:
    registrations: dict[int, Registration] = field(default_factory=dict)
    refused: list[int] = field(default_factory=list)
    """Every error code returned, in order."""
    registered_on: list[str] = field(default_factory=list)
    """The thread of every successful registration."""
    corrupt_next: int = 0
    fail_next: int = 0
    """The next copies to refuse, as a copy on a faulted device does."""
    copies: int = 0
    copies_to_device: int = 0
    asynchronous: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _queued: list[Callable[[], None]] = field(default_factory=list)
    _landed: int = 0
    """How many of ``_queued`` have run."""
    _stream: threading.Lock = field(default_factory=threading.Lock)

    def is_device(self, tensor: torch.Tensor) -> bool:
        return True  # every tensor saved plays a device tensor

    def host_register(self, view: Any, size: int) -> int:
        address = address_of(view)
        with self._lock:
            if any(r.address < address + size and address < r.address + r.size for r in self.registrations.values()):
                self.refused.append(HOST_MEMORY_ALREADY_REGISTERED)
                return HOST_MEMORY_ALREADY_REGISTERED
            self.registrations[address] = Registration(address, size, memoryview(view)[:size], threading.current_thread().name)
            self.registered_on.append(threading.current_thread().name)
        return SUCCESS

    def host_unregister(self, view: Any) -> int:
        address = address_of(view)
        with self._lock:
            registration = self.registrations.pop(address, None)
            if registration is None:
                self.refused.append(HOST_MEMORY_NOT_REGISTERED)
                return HOST_MEMORY_NOT_REGISTERED
            registration.pages.release()
        return SUCCESS

    def copy_to_host(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("CUDA error: an illegal memory access was encountered (the stand-in's fail_next)")
        if not self.asynchronous:
            self._copy_to_host(destination, source)
            return
        with self._stream:
            self._queued.append(lambda: self._copy_to_host(destination, source))

    def _copy_to_host(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        start = destination.data_ptr()
        nbytes = destination.numel() * destination.element_size()
        registration = next((r for r in self.registrations.values() if r.address <= start and start + nbytes <= r.address + r.size), None)
        if registration is not None:  # the DMA engine writes the pinned pages
            pages = torch.frombuffer(registration.pages, dtype=torch.uint8, count=nbytes, offset=start - registration.address)
            pages.view(destination.dtype).view(destination.shape).copy_(source)
        else:
            destination.copy_(source)
        self.copies += 1
        if self.corrupt_next and nbytes >= 8:
            self.corrupt_next -= 1
            flat = destination.reshape(-1).view(torch.uint8)
            flat[nbytes // 2] ^= 0x10

    def copy_to_device(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        destination.copy_(source)
        self.copies_to_device += 1

    def pinned_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def marker(self) -> Any:
        with self._stream:
            return len(self._queued)  # the copies queued before it

    def wait(self, marker: Any) -> None:
        self._land(marker)

    @contextmanager
    def copy_stream(self, ready: Any) -> Iterator[None]:
        yield

    def synchronize(self) -> None:
        self._land(None)

    def _land(self, upto: int | None) -> None:
        """Run the queued copies, in order, up to the marker ``upto`` (None: all)."""
        with self._stream:
            end = len(self._queued) if upto is None else upto
            while self._landed < end:
                self._queued[self._landed]()
                self._landed += 1

    @property
    def pinned_bytes(self) -> int:
        return sum(r.size for r in self.registrations.values())
