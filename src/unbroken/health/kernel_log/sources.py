"""Where kernel messages come from: a file (local nodes), ``/dev/kmsg``, or journald.

Every source starts at *now*: what was logged before this agent started
belongs to the node's previous life (before its reboot) and was acted on then.
``read()`` never blocks; it returns the complete lines that arrived since the
last call.
"""

from __future__ import annotations

import errno
import os
import queue
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Protocol

from unbroken.config.health import KernelLogSource
from unbroken.errors import ConfigError


class LineSource(Protocol):
    name: str

    def read(self) -> list[str]: ...
    def close(self) -> None: ...


class FileSource:
    """Tail a file; survives truncation and replacement (log rotation)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = f"file:{path}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(exist_ok=True)
        self._inode = path.stat().st_ino
        self._offset = path.stat().st_size
        self._partial = b""

    def read(self) -> list[str]:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return []
        if stat.st_ino != self._inode or stat.st_size < self._offset:
            self._inode, self._offset, self._partial = stat.st_ino, 0, b""
        if stat.st_size == self._offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        return [line.decode(errors="replace") for line in lines]

    def close(self) -> None:
        pass


class KmsgSource:
    """``/dev/kmsg``: one record per read, ``pri,seq,ts,flags;message``; needs root."""

    name = "kmsg:/dev/kmsg"

    def __init__(self, path: str = "/dev/kmsg") -> None:
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            raise ConfigError(f"Health.KernelLogSource Kmsg: cannot open {path}: {exc.strerror} (needs root)") from None
        try:
            os.lseek(self._fd, 0, os.SEEK_END)  # the kernel's ring buffer: start at "now", skip its history
        except OSError as exc:
            if exc.errno != errno.ESPIPE:
                raise
            # a device that passes records on without a ring buffer (a relay of the kernel log, the
            # tests' per-node one): it holds no history to skip

    def read(self) -> list[str]:
        lines = []
        while True:
            try:
                record = os.read(self._fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # the ring buffer overwrote records we had not read: go on
                    continue
                raise
            header, _, message = record.decode(errors="replace").partition(";")
            lines.append(message.split("\n", 1)[0])
        return lines

    def close(self) -> None:
        os.close(self._fd)


class JournaldSource:
    """``journalctl -k -f -n 0 -o cat``: kernel messages through the journal."""

    name = "journald:kernel"

    def __init__(self) -> None:
        if shutil.which("journalctl") is None:
            raise ConfigError("Health.KernelLogSource Journald: journalctl is not installed")
        self._process = subprocess.Popen(["journalctl", "-k", "-f", "-n", "0", "-o", "cat"], stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, name="journald", daemon=True).start()

    def _pump(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            self._lines.put(line.rstrip("\n"))

    def read(self) -> list[str]:
        lines = []
        while True:
            try:
                lines.append(self._lines.get_nowait())
            except queue.Empty:
                return lines

    def close(self) -> None:
        self._process.kill()
        self._process.wait()


def open_source(kind: KernelLogSource, file_path: Path) -> LineSource:
    if kind is KernelLogSource.KMSG:
        return KmsgSource()
    if kind is KernelLogSource.JOURNALD:
        return JournaldSource()
    return FileSource(file_path)
