"""The straggler rule (controller/stragglers.py ``StragglerWatch``) replayed on scores recorded on this machine.

``benchmarks/straggler.py --quick --trace FILE`` records every node score the controller computed, in order: a
2-node job of ~100 ms steps whose node is slowed 1.5x after a minute (``replace``: 3 nodes, one spare; ``report``),
and five minutes of a healthy job beside a process that keeps a core busy. The rule is replayed pass by pass, as
the controller's loop feeds it (the job's step: the oldest node's last report). A healthy node is never named; a
slowed one is, and how soon is held to what the rule does now.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

from unbroken.controller import stragglers

TRACES = Path(__file__).resolve().parents[1] / "fixtures" / "straggler-traces"
THRESHOLD = 0.75
"""``resilience.straggler_threshold``'s default."""
CEILING_STEPS = 120
"""What the rule does on these traces, with room: not the goal (30 steps), which these scores cannot meet without
naming healthy nodes (docs/benchmarks.md, "Stragglers")."""


@dataclass
class Run:
    name: str
    scores: list[tuple[int, str, float, int, int]]
    """(attempt, node, score, the node's own last step, rank 0's step when it was seen), in order."""
    slowed: str | None = None
    slowed_step: int | None = None


def runs() -> list[Run]:
    out: dict[str, Run] = {}
    for path in sorted(TRACES.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            run = out.setdefault(f"{path.stem}: {record['run']}", Run(f"{path.stem}: {record['run']}", []))
            if "slowed" in record:
                run.slowed, run.slowed_step = record["slowed"], record["step"]
            else:
                run.scores.append((record["attempt"], record["node"], record["score"], record["reported_step"], record["step"]))
    return list(out.values())


def replay(run: Run) -> list[tuple[int, stragglers.Change]]:
    """The rule's changes, each with rank 0's step when the controller would have made it (what the benchmark
    counts in: the reports the rule reads are up to a renewal old)."""
    watch = stragglers.StragglerWatch()
    latest: dict[int, dict[str, stragglers.NodeScore]] = defaultdict(dict)
    out = []
    for attempt, node, score, step, now in run.scores:
        latest[attempt][node] = stragglers.NodeScore(node, score, 0, None, reported_step=step)
        nodes = latest[attempt]
        job_step = min(s.reported_step for s in nodes.values() if s.reported_step is not None)
        out.extend((now, change) for change in watch.observe("bench", attempt, job_step, dict(nodes), THRESHOLD))
    return out


RUNS = runs()


def test_there_are_traces_of_both_kinds() -> None:
    assert [r for r in RUNS if r.slowed] and [r for r in RUNS if not r.slowed], [r.name for r in RUNS]


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.name)
def test_a_healthy_node_is_never_named(run: Run) -> None:
    """Every node of the healthy run, and of the slowed runs the healthy node and the slowed one before its slowdown."""
    false = [(step, change.node, change.score.score) for step, change in replay(run) if change.straggler
             and (change.node != run.slowed or run.slowed_step is None or step < run.slowed_step)]
    assert false == []


@pytest.mark.parametrize("run", [r for r in RUNS if r.slowed], ids=lambda r: r.name)
def test_a_node_slowed_1_5x_is_named(run: Run) -> None:
    assert run.slowed_step is not None
    named = [step - run.slowed_step for step, change in replay(run) if change.straggler and change.node == run.slowed
             and step >= run.slowed_step]
    assert named and named[0] <= CEILING_STEPS, f"{run.name}: named {named[:1] or 'never'} steps after the slowdown"
