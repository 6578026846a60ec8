"""A real Prometheus (Debian's ``prometheus``) for the tests: scrapes every second, finds its
targets in the file_sd file the test has ``unbroken cluster status --targets-file`` write."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from unbroken.plumbing.waiting import wait_until
from processes import stop_process


class PromQLError(Exception):
    """Prometheus refused the expression (it did not parse, or could not be evaluated)."""


@dataclass
class Prometheus:
    url: str
    targets_file: Path
    process: subprocess.Popen[bytes]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector (or scalar) ``expr`` evaluates to now."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read())
        if body.get("status") != "success":
            raise PromQLError(f"{expr}: {body.get('errorType')}: {body.get('error')}")
        data = body["data"]
        return data["result"] if data["resultType"] in ("vector", "matrix") else [{"metric": {}, "value": data["result"]}]

    def value(self, expr: str) -> float | None:
        """The single value ``expr`` evaluates to, None while it has none."""
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def scraped(self, address: str) -> bool:
        with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=10) as response:
            active = json.loads(response.read())["data"]["activeTargets"]
        return any(t["scrapeUrl"].startswith(f"http://{address}/") and t["health"] == "up" for t in active)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def prometheus_server(workdir: Path) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus")
    assert binary, "Debian's prometheus package is not installed (make test installs it)"
    workdir.mkdir(parents=True, exist_ok=True)
    targets = workdir / "targets.json"
    targets.write_text("[]")
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
        # honor_labels: unbroken's series carry a ``job`` label of their own (the training job's name),
        # which must win over the scrape job's (docs/observability.md says the same to users)
        "scrape_configs": [{"job_name": "unbroken", "honor_labels": True,
                            "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}]}],
    }))
    port = _free_port()
    log = open(workdir / "prometheus.log", "wb")
    process = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
         "--log.level=warn", "--storage.tsdb.retention.time=1h"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    server = Prometheus(f"http://127.0.0.1:{port}", targets, process)

    def ready() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"prometheus exited {process.returncode}: {(workdir / 'prometheus.log').read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{server.url}/-/ready", timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    try:
        wait_until(ready, 60, "prometheus ready")
        yield server
    finally:
        stop_process(process)
        log.close()
