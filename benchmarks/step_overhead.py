"""What step timing costs a training step: ``ctx.section`` and ``ctx.progress`` on the rank, the agent's fold.

One process, the real pieces: a ``Context`` whose sender sends real datagrams to a
real ``AgentReceiver`` socket, and the agent's real ``ProgressBook`` folding what
arrives (its step clock included). Side by side, per step:

* ``bare``: the loop's own cost (nothing reported: plain torchrun);
* ``progress``: ``ctx.progress(step, loss=...)`` only (unbroken before sections);
* ``progress + 4 sections``: four ``with ctx.section(...)`` blocks and the progress.

The rank's extra cost is compared with a step of ``--step-ms`` (default 50 ms,
the goodput benchmark's; real steps are longer, so the share only shrinks). The
agent's cost per message is measured on the same messages.

    .venv/bin/python benchmarks/step_overhead.py [--steps 20000] [--step-ms 50] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from unbroken.agent.progress import ProgressBook
from unbroken.rank.channel import AgentReceiver, RankSender
from unbroken.checkpoint.rank.file import FileCheckpointer
from unbroken.train import Context

SECTIONS = ("data", "forward", "backward", "optimizer")


def context(sender: RankSender, directory: Path) -> Context:
    return Context(rank=0, world_size=1, local_rank=0, job="bench", node="node-1", attempt=0,
                   checkpoint=FileCheckpointer(directory, rank=0, world_size=1), _sender=sender)


def per_step_us(run, steps: int, repeats: int = 5) -> float:
    """The median over ``repeats`` runs of ``steps`` steps, in microseconds per step."""
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        run(steps)
        samples.append((time.perf_counter() - started) / steps * 1e6)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--step-ms", type=float, default=50.0, help="the step the overhead is a share of")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="unbroken-overhead-") as tmp:
        socket_path = Path(tmp) / "agent.sock"
        receiver = AgentReceiver(socket_path)
        book = ProgressBook()
        ctx = context(RankSender(socket_path), Path(tmp) / "ckpt")
        folded: list[float] = []

        def drain() -> None:
            messages = receiver.drain()
            if messages:
                started = time.perf_counter()
                book.apply(messages)
                folded.append((time.perf_counter() - started) / len(messages) * 1e6)

        def bare(steps: int) -> None:
            for step in range(steps):
                _ = step * 2

        def progress_only(steps: int) -> None:
            for step in range(steps):
                ctx.progress(step, loss=0.5)
                if step % 500 == 0:
                    drain()

        def with_sections(steps: int) -> None:
            for step in range(steps):
                for name in SECTIONS:
                    with ctx.section(name):
                        pass
                ctx.progress(step, loss=0.5)
                if step % 500 == 0:
                    drain()

        rows = {}
        for label, run in (("bare", bare), ("progress", progress_only), ("progress + 4 sections", with_sections)):
            folded.clear()
            rows[label] = {"rank_us": round(per_step_us(run, args.steps), 2),
                           "agent_us_per_message": round(statistics.median(folded), 2) if folded else None}
        receiver.close()
    step_us = args.step_ms * 1000
    base = rows["bare"]["rank_us"]
    results = [{"case": label, **row, "rank_share_of_step": round((row["rank_us"] - base) / step_us, 6)} for label, row in rows.items()]
    if args.json:
        print(json.dumps({"step_ms": args.step_ms, "pid": os.getpid(), "results": results}))
        return 0
    print(f"| per step | rank (us) | agent fold (us / message) | rank's extra share of a {args.step_ms:g} ms step |")
    print("|---|---|---|---|")
    for r in results:
        agent = "-" if r["agent_us_per_message"] is None else r["agent_us_per_message"]
        print(f"| {r['case']} | {r['rank_us']} | {agent} | {r['rank_share_of_step']:.4%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
