"""Silent data corruption: how soon a flipped bit is caught, what checking costs, and whether the rollback is exact.

Side by side in one run, on gloo over CPU processes (what a GPU cannot do here: compute wrong on its own; the
flip, ``rank/bit_flip.py``, stands for its wrong result):

* **detection**: one bit flipped in one rank's parameters, optimizer state or gradient (after the all-reduce),
  in a DDP job of 3 ranks (the shipped MLP; ``--watch-replicas`` every ``EVERY`` steps, saves every ``EVERY``)
  and in an HSDP job (FSDP2, ``replicate`` 2 x ``shard`` 2, ``workloads/hsdp.py``). ``detect_steps``: steps
  from the one the flip landed in to the check that saw it (null: never); ``named``: the suspects it named.
  ``baseline (no agreement)``: the same DDP flip without ``watch_replicas``: nothing sees it.
* **rollback**: the DDP job is started again on the same checkpoint folder (the file tier quarantined what it
  saved after the last agreed step) and runs to the end; ``bit_identical``: every rank's final parameters
  equal those of a run nobody corrupted (the MLP is deterministic). The baseline's do only where the flip
  never reached a parameter (a low bit of Adam's first moment can decay away before it does).
* **overhead**: the MLP padded to 100 ms steps with and without a check every ``EVERY`` steps, in
  interleaved trials (``overhead_pct``: the median of their differences in mean step time), and the check itself timed in a 3-rank group for the
  MLP's state and a 256 MiB one (``check_ms``: what a rank pays, the fingerprint and the all-reduce's start at one step, the verdict
  at the next; ``overhead_at_100ms_pct``: it over ``EVERY`` 100 ms steps); beside it the previous design's, which waited for
  the all-reduce at once (the note's "waited").
* **false positives**: healthy DDP and HSDP runs checking every step for ``--healthy-minutes`` each, beside a
  process that keeps a core busy; every check that disagreed is a false positive.

    .venv/bin/python benchmarks/sdc.py [--json] [--quick] [--healthy-minutes 20] [--cases detection,overhead,false-positives]

``--quick`` (a few minutes): one healthy minute each. Plain torchrun starts each attempt (its own restarts do not
come back here: a restarted gloo group fails to connect on this machine, with or without unbroken).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import free_port  # noqa: E402

EVERY = 10
STEPS = 80
FLIP_AFTER = 23
"""The flip lands in step 24's optimizer step; the check at step 30 can see it: ``detect_steps`` 6 at best."""
DETECTED = re.compile(r"silent data corruption: replicas disagree at step (\d+)")
SUSPECTS = re.compile(r"rank (\d+) differs from the majority|ranks ([\d, ]+) are suspects")
HOG = "import time\nwhile True:\n    pass\n"


@dataclass
class Result:
    case: str
    layout: str
    target: str | None
    detect_steps: int | None = None
    named: list[int] | None = None
    bit_identical: bool | None = None
    false_positives: int | None = None
    checks: int | None = None
    minutes: float | None = None
    overhead_pct: float | None = None
    check_ms: float | None = None
    overhead_at_100ms_pct: float | None = None
    note: str = ""


def torchrun_command(nprocs: int, module: str, args: list[str]) -> list[str]:
    """Plain torchrun, one node, no restarts of its own (each attempt is a new one)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nprocs),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--max-restarts", "0", "-m", module, *args]


def rank_env(work: Path) -> dict[str, str]:
    env = {**os.environ, "UNBROKEN_CHECKPOINT_DIR": str(work / "ckpt"), "OMP_NUM_THREADS": "1"}
    env.pop("UNBROKEN_CHAOS_CORRUPT", None)
    return env


def torchrun(work: Path, nprocs: int, module: str, args: list[str], *, request: dict | None = None, timeout: float = 600) -> tuple[int, str]:
    """One attempt under plain torchrun; returns its exit code and its output."""
    env = rank_env(work)
    if request is not None:
        path = work / "chaos-corrupt.json"
        path.with_suffix(".done").unlink(missing_ok=True)
        path.write_text(json.dumps(request))
        env["UNBROKEN_CHAOS_CORRUPT"] = str(path)
    done = subprocess.run(torchrun_command(nprocs, module, args), env=env, capture_output=True, text=True, timeout=timeout, cwd=work)
    return done.returncode, done.stdout + done.stderr


def flipped_step(work: Path) -> int | None:
    try:
        return int(json.loads((work / "chaos-corrupt.done").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return None


def detection(output: str, flipped_after: int | None) -> tuple[int | None, list[int] | None]:
    found = DETECTED.search(output)
    if found is None or flipped_after is None:
        return None, None
    named = SUSPECTS.search(output[found.start():])
    ranks = None if named is None else [int(r) for r in (named.group(1) or named.group(2)).replace(" ", "").split(",")]
    return int(found.group(1)) - (flipped_after + 1), ranks


def mlp_args(work: Path, *, watch: bool, steps: int = STEPS, step_time: float = 0.0) -> list[str]:
    args = ["--steps", str(steps), "--checkpoint-every", str(EVERY), "--step-time", str(step_time),
            "--output", str(work / "final-{rank}.pt")]
    return args + (["--watch-replicas", str(EVERY)] if watch else [])


def same_parameters(clean: Path, work: Path) -> bool:
    """Every rank's final parameters are the clean run's rank 0's, bit for bit."""
    import torch

    reference = torch.load(clean / "final-0.pt")
    finals = sorted(work.glob("final-*.pt"))
    if len(finals) != 3:
        return False
    for path in finals:
        mine = torch.load(path)
        if mine.keys() != reference.keys() or not all(torch.equal(mine[k], reference[k]) for k in mine):
            return False
    return True


def ddp_case(root: Path, target: str, clean: Path, *, watch: bool) -> Result:
    """``bit_identical``: every rank's final parameters equal the clean run's."""
    work = root / f"ddp-{target}-{'watched' if watch else 'baseline'}"
    work.mkdir()
    request = {"rank": 2, "step": FLIP_AFTER, "target": target}
    code, output = torchrun(work, 3, "unbroken.workloads.mlp", mlp_args(work, watch=watch), request=request)
    after = flipped_step(work)
    steps, named = detection(output, after)
    case = "unbroken (replica agreement)" if watch else "baseline (no agreement)"
    if after is None:
        return Result(case, "DDP x3", target, note=f"the flip never happened (exit {code})")
    if watch:
        if code == 0:
            return Result(case, "DDP x3", target, None, None, note="not detected: the job ran to the end")
        code, output = torchrun(work, 3, "unbroken.workloads.mlp", mlp_args(work, watch=watch))  # the restart, from the agreed step
        if code != 0:
            return Result(case, "DDP x3", target, steps, named, note=f"the restart failed (exit {code}): {output[-300:]}")
    identical = same_parameters(clean, work)
    return Result(case, "DDP x3", target, steps, named, identical)


def hsdp_case(root: Path, target: str) -> Result:
    work = root / f"hsdp-{target}"
    work.mkdir()
    code, output = torchrun(work, 4, "unbroken.workloads.hsdp", ["--steps", str(STEPS), "--watch-replicas", str(EVERY)],
                            request={"rank": 3, "step": FLIP_AFTER, "target": target})
    steps, named = detection(output, flipped_step(work))
    return Result("unbroken (replica agreement)", "HSDP 2x2", target, steps, named,
                  note="" if code else "not detected: the job ran to the end")


def overhead(root: Path, steps: int, trials: int) -> Result:
    """Mean step time at 100 ms steps, with and without a check every EVERY steps, in interleaved trials (the order
    alternating), the median of the trials' differences; and the check timed alone."""
    differences, means = [], {False: [], True: []}
    for trial in range(trials):
        mean = {}
        for watch in ((False, True) if trial % 2 == 0 else (True, False)):
            work = root / f"overhead-{trial}-{watch}"
            work.mkdir()
            code, output = torchrun(work, 3, "unbroken.workloads.mlp", mlp_args(work, watch=watch, steps=steps, step_time=0.1))
            if code != 0:
                return Result("overhead", "DDP x3", None, note=f"run failed (exit {code})")
            mean[watch] = _mean_step_seconds(output)
            means[watch].append(mean[watch])
        differences.append(100 * (mean[True] - mean[False]) / mean[False])
    timed = _time_checks(root)
    return Result("overhead", "DDP x3", None, overhead_pct=round(statistics.median(differences), 2), check_ms=timed["mlp"],
                  overhead_at_100ms_pct=round(100 * timed["mlp"] / 1000 / (EVERY * 0.1), 3),
                  note=f"{trials} interleaved trials of {steps} steps: {', '.join(f'{d:+.2f}' for d in differences)} %; mean step "
                       f"{statistics.median(means[False]) * 1000:.1f} ms without, {statistics.median(means[True]) * 1000:.1f} ms "
                       f"with; waiting for the verdict at once (the previous design): {timed['mlp waited']:.2f} ms; a 256 MiB "
                       f"state's check: {timed['256MiB']:.1f} ms ({timed['256MiB waited']:.1f} ms waited)")


def _mean_step_seconds(output: str) -> float:
    """From rank 0's 'first step' mark and its 'done' line's timestamp: wall time over the steps after the first."""
    first = re.search(r'"msg": "rank 0: first step (\d+) at ([\d.]+)"', output)
    done = re.search(r'"msg": "done: (\d+) steps.*?"ts": "([^"]+)"', output)
    if first is None or done is None:
        return 0.0
    from datetime import datetime

    ended = datetime.fromisoformat(done.group(2)).timestamp()
    return (ended - float(first.group(2))) / (int(done.group(1)) - int(first.group(1)))


CHECK_TIMER = r'''
import json, sys, time, statistics
import torch, torch.distributed as dist
from unbroken.checkpoint.rank.agreement import InFlight, compare
from unbroken.workloads.mlp import build_model
rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
model = build_model(1234)
optimizer = torch.optim.AdamW(model.parameters())
model(torch.randn(4, model[0].in_features)).sum().backward()
optimizer.step()
states = {"mlp": {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
          "256MiB": {"big": torch.randn(64 * 2**20)}}
out = {}
for name, state in states.items():
    waited, paid = [], []
    for i in range(15):
        dist.barrier()
        started = time.perf_counter()
        compare(i, state)  # fingerprint, all-reduce and wait for it: what the rank paid before the verdict was deferred
        waited.append(time.perf_counter() - started)
        dist.barrier()
        started = time.perf_counter()
        flight = InFlight.start(i, state)  # what a rank pays at a due step's progress
        paid.append(time.perf_counter() - started)
        dist.barrier()  # a step's worth of collectives later (on the same group: after the all-reduce)
        started = time.perf_counter()
        flight.verdict()  # and at the next one
        paid[-1] += time.perf_counter() - started
    out[name] = statistics.median(paid[3:]) * 1000
    out[name + " waited"] = statistics.median(waited[3:]) * 1000
if rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
dist.barrier()
dist.destroy_process_group()
'''


def _time_checks(root: Path) -> dict[str, float]:
    script = root / "check_timer.py"
    script.write_text(CHECK_TIMER)
    store = root / "check-store"
    children = [subprocess.Popen([sys.executable, str(script), str(r), "3", str(store)], stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"}) for r in range(3)]
    outputs = [c.communicate(timeout=300)[0] for c in children]
    line = next(line for line in outputs[0].splitlines() if line.startswith("RESULT "))
    return {k: round(v, 2) for k, v in json.loads(line[7:]).items()}


def false_positives(root: Path, layout: str, minutes: float) -> Result:
    code: int | None
    """A healthy run checking every step for ``minutes`` beside a core hog: every disagreement is a false positive."""
    work = root / f"healthy-{layout}"
    work.mkdir()
    hog = subprocess.Popen([sys.executable, "-c", HOG])
    try:
        if layout == "DDP x3":
            steps = 10**7  # bounded by the timeout below: the MLP has no --seconds
            code, output = _run_for(work, 3, "unbroken.workloads.mlp", ["--steps", str(steps), "--checkpoint-every", str(10**6),
                                                                         "--watch-replicas", "1"], minutes)
        else:
            code, output = torchrun(work, 4, "unbroken.workloads.hsdp", ["--seconds", str(minutes * 60), "--watch-replicas", "1"],
                                    timeout=minutes * 60 + 300)
    finally:
        hog.kill()
        hog.wait()
    disagreements = len(set(DETECTED.findall(output)))
    checks = re.search(r"done: \d+ steps, (\d+) checks", output)
    return Result("false positives", layout, None, false_positives=disagreements, minutes=minutes,
                  checks=int(checks.group(1)) if checks else None, note="" if disagreements or code in (0, None) else f"exit {code}")


def _run_for(work: Path, nprocs: int, module: str, args: list[str], minutes: float) -> tuple[int | None, str]:
    """torchrun for ``minutes`` then SIGTERM (the MLP counts steps, not time); its checks are counted from the log.
    The exit code is None when it ran the whole time (and was stopped)."""
    log = work / "log.txt"
    with open(log, "w") as out:
        child = subprocess.Popen(torchrun_command(nprocs, module, args), env=rank_env(work), stdout=out, stderr=subprocess.STDOUT,
                                 cwd=work)
        deadline = time.monotonic() + minutes * 60
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(1.0)  # a fixed-length run, not synchronisation: nothing is waited for but the clock
        stopped = child.poll() is None
        if stopped:
            child.terminate()
        code = child.wait(timeout=120)
    output = log.read_text()
    last = re.findall(r'"step": (\d+)', output)
    steps = int(last[-1]) if last else 0
    return (None if stopped else code), output + f"\ndone: {steps} steps, {steps} checks\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help='print {"results": [...]} instead of the table')
    parser.add_argument("--quick", action="store_true", help="a few minutes: one healthy minute per layout")
    parser.add_argument("--healthy-minutes", type=float, default=20.0, help="length of each false-positive run")
    parser.add_argument("--cases", default="detection,overhead,false-positives",
                        help="which parts to run (comma-separated: detection, overhead, false-positives)")
    args = parser.parse_args()
    minutes = 1.0 if args.quick else args.healthy_minutes
    cases = set(args.cases.split(","))
    unknown = cases - {"detection", "overhead", "false-positives"}
    if unknown:
        parser.error(f"--cases: unknown {', '.join(sorted(unknown))} (valid: detection, overhead, false-positives)")
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="unbroken-sdc-") as tmp:
        root = Path(tmp)
        if "detection" in cases:
            clean = root / "clean"
            clean.mkdir()
            code, output = torchrun(clean, 3, "unbroken.workloads.mlp", mlp_args(clean, watch=True))
            if code != 0:
                print(output[-2000:], file=sys.stderr)
                return 1
            for target in ("params", "optimizer", "gradients"):
                for watch in (True, False):
                    results.append(ddp_case(root, target, clean, watch=watch))
                    print(f"# {results[-1]}", file=sys.stderr, flush=True)
            for target in ("params", "optimizer", "gradients"):
                results.append(hsdp_case(root, target))
                print(f"# {results[-1]}", file=sys.stderr, flush=True)
        if "overhead" in cases:
            results.append(overhead(root, 60 if args.quick else 150, 2 if args.quick else 4))
            print(f"# {results[-1]}", file=sys.stderr, flush=True)
        if "false-positives" in cases:
            for layout in ("DDP x3", "HSDP 2x2"):
                results.append(false_positives(root, layout, minutes))
                print(f"# {results[-1]}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"every_steps": EVERY, "flip_after_step": FLIP_AFTER, "results": [asdict(r) for r in results]}, indent=1))
        return 0
    print("| case | layout | flipped | detect (steps) | named | bit-identical after rollback | false positives | overhead | note |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        over = "" if r.overhead_pct is None else f"{r.overhead_pct:+.2f} % (check {r.check_ms} ms: {r.overhead_at_100ms_pct} % at 100 ms steps)"
        fp = "" if r.false_positives is None else f"{r.false_positives} in {r.checks} checks, {r.minutes:g} min"
        print(f"| {r.case} | {r.layout} | {r.target or ''} | {'' if r.case in ('overhead', 'false positives') else r.detect_steps} | "
              f"{r.named or ''} | {'' if r.bit_identical is None else r.bit_identical} | {fp} | {over} | {r.note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
