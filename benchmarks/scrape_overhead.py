"""What a 1 s scrape of every /metrics endpoint costs the training loop: steps/s with and without.

One 3-node local cluster; the same 2-node x 2-rank MLP job (no simulated compute: the loop
runs as fast as the CPU lets it, so anything stealing CPU shows) runs ``--trials`` times
without a scraper and as often with one, interleaved (off, on, off, on, ...) so drift on the
machine hits both alike. The scraper does what Prometheus does with ``scrape_interval: 1s``:
one GET of ``/metrics`` per endpoint listed by ``unbroken cluster status`` every second
(the controller, which derives its metrics from the store on every scrape, and each agent).

steps/s of a trial: the slowest worker's steps between its first and last progress report,
over that time (startup and rendezvous excluded).

    .venv/bin/python benchmarks/scrape_overhead.py [--trials 4] [--steps 600] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from unbroken.controller import jobs
from unbroken.cli.cluster import metrics_targets
from unbroken.config.cluster import ClusterConfig
from unbroken.config.job import JobSpec
from unbroken.plumbing.layout import ClusterLayout
from unbroken.runtime import Runtime, local_cluster
from unbroken.plumbing.waiting import wait_until

SCRAPE_INTERVAL = 1.0


@dataclass
class Scraper:
    """Prometheus' load, without Prometheus: every endpoint, once a second, in a thread."""

    runtime: Runtime
    scrapes: int = 0
    failures: int = 0
    seconds: list[float] = field(default_factory=list)
    bytes: list[int] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._loop, daemon=True)
        thread.start()
        return thread

    def _loop(self) -> None:
        addresses = [t["targets"][0] for t in metrics_targets(self.runtime)]
        while not self.stopping.wait(SCRAPE_INTERVAL):
            for address in addresses:
                started = time.perf_counter()
                try:
                    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
                        self.bytes.append(len(reply.read()))
                except OSError:
                    self.failures += 1
                    continue
                self.seconds.append(time.perf_counter() - started)
                self.scrapes += 1


@dataclass
class Trial:
    scraped: bool
    steps_per_second: float
    scrapes: int = 0
    scrape_ms_median: float | None = None
    scrape_bytes_median: int | None = None


def run_trial(runtime: Runtime, name: str, steps: int, scraped: bool) -> Trial:
    spec = JobSpec.model_validate({
        "name": name, "nodes": 2, "procs_per_node": 2,
        "command": ["-m", "unbroken.workloads.mlp", "--steps", str(steps), "--checkpoint-every", "50", "--step-time", "0"],
        "checkpoint": {"memory": {"keep": 2, "replicas": 1}},
    })
    scraper = Scraper(runtime)
    thread = scraper.start() if scraped else None
    try:
        jobs.submit(runtime.cluster, spec, note="benchmarks/scrape_overhead.py")
        job = wait_until(lambda: (j := runtime.cluster.get_job(name)).phase.is_terminal and j, 600, f"job {name} to end", interval=0.5)
    finally:
        scraper.stopping.set()
        if thread is not None:
            thread.join()
    if job.phase.value != "Succeeded" or job.attempt != 0:
        raise SystemExit(f"trial {name} ended {job.phase.value} after {job.attempt} restarts: {job.reason}")
    rates = []
    for worker in runtime.backend.observe_attempt(name, 0):
        if None in (worker.first_step, worker.first_progress_at, worker.last_step, worker.last_progress_at):
            raise SystemExit(f"trial {name}: worker on {worker.node} reported no progress")
        rates.append((worker.last_step - worker.first_step) / (worker.last_progress_at - worker.first_progress_at))  # type: ignore[operator]
    return Trial(scraped, round(min(rates), 1), scraper.scrapes,
                 round(statistics.median(scraper.seconds) * 1000, 2) if scraper.seconds else None,
                 int(statistics.median(scraper.bytes)) if scraper.bytes else None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=4, help="trials per mode (default 4)")
    parser.add_argument("--steps", type=int, default=600, help="steps per trial (default 600)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="unbroken-bench-scrape-") as tmp:
        layout = ClusterLayout.at(Path(tmp) / "cluster")
        runtime, _ = local_cluster.up(layout, ClusterConfig.with_nodes(3, name="bench"))
        trials: list[Trial] = []
        try:
            local_cluster.wait_ready(runtime, 120)
            for index in range(args.trials * 2):
                scraped = index % 2 == 1
                trial = run_trial(runtime, f"trial-{index}", args.steps, scraped)
                trials.append(trial)
                print(f"trial {index}: scrape {'on ' if scraped else 'off'}  {trial.steps_per_second:8.1f} steps/s"
                      + (f"  ({trial.scrapes} scrapes, median {trial.scrape_ms_median} ms, {trial.scrape_bytes_median} bytes)"
                         if scraped else ""), flush=True)
            endpoints = len(metrics_targets(runtime))
        finally:
            local_cluster.down(layout)

    off = [t.steps_per_second for t in trials if not t.scraped]
    on = [t.steps_per_second for t in trials if t.scraped]
    if args.json:
        print(json.dumps({"endpoints": endpoints, "trials": [asdict(t) for t in trials]}, indent=2))
        return 0
    spread = (max(off) - min(off)) / statistics.median(off)
    print(f"\n2 nodes x 2 ranks, MLP without simulated compute, {args.steps} steps a trial, {args.trials} trials per mode; "
          f"{endpoints} endpoints scraped every {SCRAPE_INTERVAL:g} s when on")
    print("| scrape | steps/s (median) | min | max | ratio to no scrape |")
    print("|---|---:|---:|---:|---:|")
    for label, values in (("none", off), (f"every endpoint, {SCRAPE_INTERVAL:g} s", on)):
        print(f"| {label} | {statistics.median(values):.1f} | {min(values):.1f} | {max(values):.1f} | "
              f"{statistics.median(values) / statistics.median(off):.3f} |")
    print(f"\nspread of the unscraped trials (max-min over median): {spread:.1%}; a difference below it is noise")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
