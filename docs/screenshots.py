"""Regenerate the dashboard screenshots in docs/img/ (``make screenshots``).

Runs what a user would: a 3-node local cluster, the example MLP job, a kill -9 of one of its
ranks (the job restarts and resumes), an Xid 79 on the spare node (it is replaced), then
``unbroken dashboard``; Debian's Chromium (through Playwright) photographs the overview, the
job page and the faulty node's page. Everything runs in a temporary directory and is torn
down afterwards.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "img"
CHROMIUM = "/usr/bin/chromium"
JOB = "train"


def cli(root: Path, *args: str) -> str:
    env = {**os.environ, "UNBROKEN_DIR": str(root), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "unbroken", *args], env=env, check=True, capture_output=True, text=True).stdout


def wait(what: str, condition: Callable[[], Any], timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := condition():
            return result
        time.sleep(0.5)  # polling a condition, not synchronising on time
    raise SystemExit(f"timed out waiting for {what}")


def job(root: Path) -> dict[str, Any]:
    found = next(j for j in json.loads(cli(root, "job", "list", "-o", "json")) if j["name"] == JOB)
    return {**found, "step": found["step"] or 0}


def main() -> None:
    from playwright.sync_api import sync_playwright

    OUT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="unbroken-screenshots-") as tmp:
        root = Path(tmp) / "cluster"
        spec = Path(tmp) / "job.yaml"
        spec.write_text(json.dumps({
            "name": JOB, "nodes": 2, "procs_per_node": 2,
            "command": ["-m", "unbroken.workloads.mlp", "--steps", "100000", "--checkpoint-every", "20", "--step-time", "0.05"],
            "resilience": {"auto_resume": True, "max_retry": 3},
            "checkpoint": {"memory": {"keep": 2, "replicas": 1}, "persistent": {"uri": f"file://{tmp}/ckpt", "every_steps": 100}},
        }))
        cli(root, "cluster", "up", "--nodes", "3")
        dashboard = None
        try:
            cli(root, "job", "start", "-f", str(spec))
            wait("step 150", lambda: job(root)["step"] >= 150)
            cli(root, "chaos", "kill-worker", JOB)
            wait("the resume", lambda: job(root)["restarts"] == 1 and job(root)["phase"] == "Running" and job(root)["step"] > 200)
            busy = set(job(root)["nodes"])
            spare = next(n["name"] for n in json.loads(cli(root, "node", "list", "-o", "json")) if n["name"] not in busy)
            cli(root, "chaos", "xid", spare, "79")
            wait("step 400", lambda: job(root)["step"] >= 400)

            dashboard = subprocess.Popen([sys.executable, "-m", "unbroken", "dashboard", "--port", "0"], text=True,
                                         stdout=subprocess.PIPE, env={**os.environ, "UNBROKEN_DIR": str(root), "COLUMNS": "400"})
            assert dashboard.stdout is not None
            match = re.search(r"(http://\S+)", dashboard.stdout.readline())
            if not match:
                raise SystemExit("the dashboard printed no URL")
            url = match.group(1).rstrip("/")
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
                page = browser.new_page(viewport={"width": 1280, "height": 1000})
                for path, ready, name in [
                    ("/", "#jobs tr[data-name]", "dashboard-overview.png"),
                    (f"/jobs/{JOB}", "#plot line.marker.resumed", "dashboard-job.png"),
                    (f"/nodes/{spare}", "#facts #health", "dashboard-node.png"),
                ]:
                    page.goto(url + path)
                    page.wait_for_selector(ready, state="attached", timeout=30_000)
                    page.screenshot(path=str(OUT / name))  # the first screenful: what a user sees on opening it
                    print(f"wrote {OUT / name}")
                browser.close()
        finally:
            if dashboard is not None:
                dashboard.terminate()
                dashboard.wait(10)
            cli(root, "cluster", "down")


if __name__ == "__main__":
    main()
