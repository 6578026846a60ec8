"""A real S3 endpoint for tests: moto's server on loopback, in its own process.

moto serves the S3 REST API over HTTP, so s3fs/botocore talk to it exactly as they
would to AWS (requests, multipart, errors). Port 0 lets the OS pick a free port; the
server prints the one it got, which is read back from its log.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from processes import stop_process

_RUNNING = re.compile(r"Running on (http://127\.0\.0\.1:\d+)")

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class MotoServer:
    endpoint: str
    proc: subprocess.Popen[bytes]
    log: Path

    def pause(self) -> None:
        """SIGSTOP: connections are still accepted by the kernel, no request is answered."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)


def _command() -> list[str]:
    script = Path(sys.executable).with_name("moto_server")
    if script.exists():
        return [str(script)]
    found = shutil.which("moto_server")
    return [found] if found else [sys.executable, "-m", "moto.server"]


def _answers(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(endpoint + "/moto-api/", timeout=1):
            return True
    except urllib.error.HTTPError:
        return True  # any HTTP answer means it is serving
    except OSError:
        return False


@contextmanager
def moto_server(log_dir: Path, timeout: float = 30.0) -> Iterator[MotoServer]:
    """Start ``moto_server`` on 127.0.0.1 (OS-chosen port); stop it (and only it) on exit."""
    log = log_dir / "moto.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*_command(), "-H", "127.0.0.1", "-p", "0"], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        endpoint = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"moto_server exited {proc.returncode}:\n{log.read_text(errors='replace')}")
            if endpoint is None:
                match = _RUNNING.search(log.read_text(errors="replace"))
                endpoint = match.group(1) if match else None
            if endpoint is not None and _answers(endpoint):
                break
            time.sleep(0.05)  # polling a process we started for readiness; nothing to wait on instead
        else:
            raise AssertionError(f"moto_server did not answer within {timeout:g} s:\n{log.read_text(errors='replace')}")
        yield MotoServer(endpoint, proc, log)
    finally:
        stop_process(proc)


def empty_and_delete_bucket(client: object, bucket: str) -> None:
    """S3 refuses to delete a bucket that still holds objects."""
    paginator = client.get_paginator("list_objects_v2")  # type: ignore[attr-defined]
    for page in paginator.paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys})  # type: ignore[attr-defined]
    client.delete_bucket(Bucket=bucket)  # type: ignore[attr-defined]
