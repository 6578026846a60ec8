"""``collective.allreduce``: the sweep across the checked nodes, judged against the profile's busbw floor.

The figure compared with the floor is the busbw of the largest size, from the
fastest iteration of the better of out-of-place and in-place: small sizes
measure latency, a slow link caps every iteration of both columns, and ranks
that share busy cores lose some iterations, not all. A run below the floor is retried
(``Health.CollectiveRetries``) before it counts. When it still fails, the
pairwise results name the slow node: the node all of whose pairs are slow
while some other pair is fast. With two nodes that cannot be told apart, and
both are named.

One rank (a node with one GPU, checked alone) has no link between ranks to
measure: nccl-tests' bus factor 2(n-1)/n is 0, and so is its busbw. Such a
node passes on what one rank can show: the collective library starts on the
device and every element of every result is exact; its algbw (the device's own
reduction copy) is reported, not judged. Wrong elements fail the check at any
size of world (``WrongResult``): a collective that computes wrong numbers is
worse than a slow one.
"""

from __future__ import annotations

from typing import Any

from unbroken.health.collective import launch
from unbroken.health.collective.sweep import Row, parse_size, sizes
from unbroken.health.context import CheckContext, Peer
from unbroken.health.result import FaultAction, Outcome, Status

DEFAULT_BEGIN, DEFAULT_END, DEFAULT_FACTOR = "64K", "1M", 4
"""The join sweep: three sizes up to 1 MiB, bandwidth-bound on loopback and veth
links (~0.5-1 GB/s with gloo here) and a few seconds in all on a 100 Mbit link, where
a slow node must be found, retried and blamed pairwise."""


def figure(rows: list[dict[str, Any]]) -> float:
    """busbw of the largest all-reduce size: fastest iteration, better of out-of-place and in-place."""
    biggest = max((r for r in rows if r["op"] == "all_reduce"), key=lambda r: r["size"])
    return Row(**biggest).best_busbw


def plan_for(ctx: CheckContext, world_nodes: int) -> dict[str, Any]:
    p = ctx.params
    ranks = world_nodes * procs_per_node(ctx, world_nodes)
    return {
        "backend": "nccl" if ctx.profile.Accelerator == "gpu" else "gloo",
        "ops": list(p.get("ops", ["all_reduce"])),
        "sizes": sizes(parse_size(str(p.get("begin", DEFAULT_BEGIN))), parse_size(str(p.get("end", DEFAULT_END))),
                       int(p.get("factor", DEFAULT_FACTOR)), ranks),
        "iters": int(p.get("iters", 3)), "warmup": int(p.get("warmup", 1)), "repeat": int(p.get("repeat", 1)),
        "floor": ctx.profile.BusBwFloorGBps, "retries": ctx.settings.CollectiveRetries,
    }


def procs_per_node(ctx: CheckContext, nodes: int) -> int:
    if ctx.profile.Accelerator == "gpu":
        return max(1, ctx.profile.GpuCount)
    return 1 if nodes > 1 else 2  # one node alone: two ranks over its loopback


def wrong_elements(report: dict[str, Any]) -> int:
    """Elements that differed from the exact expected value, over every row of every attempt."""
    return sum(int(row["out_wrong"]) + int(row["in_wrong"])
               for run in report["runs"] for attempt in run["attempts"] for row in attempt["rows"])


def judge(report: dict[str, Any], floor: float, nodes: list[str]) -> Outcome:
    runs = report["runs"]
    wrong = wrong_elements(report)
    if wrong:
        return Outcome(Status.FAIL, f"all-reduce across {', '.join(nodes)} returned {wrong} wrong elements (results are exact "
                       "integers in float32: any difference is a fault, not rounding)", "WrongResult",
                       {"wrong": wrong, "nodes": nodes, "world": report["world"]}, FaultAction.REPLACE, tuple(nodes))
    if report["world"] == 1:
        biggest = max((r for r in runs[-1]["attempts"][-1]["rows"] if r["op"] == "all_reduce"), key=lambda r: r["size"])
        algbw = Row(**biggest).best_algbw
        return Outcome(Status.PASS, f"one rank: no link to measure (busbw is 0 by definition); the all-reduce ran on it with "
                       f"exact results, algbw {algbw:.3g} GB/s", "",
                       {"algbw": round(algbw, 4), "unit": "GB/s", "nodes": nodes, "world": 1, "busbw_judged": False},
                       FaultAction.NONE)
    verdicts = [figure(run["attempts"][-1]["rows"]) for run in runs]
    failed_runs = [i for i, busbw in enumerate(verdicts) if busbw < floor]
    metrics: dict[str, Any] = {
        "busbw": round(verdicts[-1], 4), "floor": floor, "unit": "GB/s", "nodes": nodes, "world": report["world"],
        "runs": len(runs), "runs_failed": len(failed_runs),
        "attempts": [len(run["attempts"]) for run in runs], "per_run_busbw": [round(v, 4) for v in verdicts],
    }
    if not failed_runs:
        return Outcome(Status.PASS, f"all-reduce busbw {verdicts[-1]:.3g} GB/s across {', '.join(nodes)} "
                       f"(floor {floor:g})", "", metrics, FaultAction.NONE)
    pairs = {tuple(p["nodes"]): figure([p["row"]]) for p in report.get("pairs", [])}
    metrics["pairs"] = {"+".join(k): round(v, 4) for k, v in pairs.items()}
    faulty = blame(pairs, floor, nodes)
    worst = min(verdicts[i] for i in failed_runs)
    named = ", ".join(faulty)
    detail = "; ".join(f"{'+'.join(k)} {v:.3g}" for k, v in sorted(pairs.items()))
    message = (f"busbw below threshold: expected >= {floor:g}, measured {worst:.3g} GB/s "
               f"({len(failed_runs)} of {len(runs)} runs, after {metrics['attempts'][failed_runs[0]]} attempts); "
               f"slow node{'s' if len(faulty) > 1 else ''}: {named}" + (f" (pairs: {detail})" if detail else ""))
    return Outcome(Status.FAIL, message, "BelowThreshold", metrics, FaultAction.REPLACE, tuple(faulty))


def blame(pairs: dict[tuple[str, ...], float], floor: float, nodes: list[str]) -> list[str]:
    """Nodes whose every tested pair is slow while some pair is fast; else every node (no way to tell)."""
    if not pairs or all(v < floor for v in pairs.values()):
        return list(nodes)
    return [n for n in nodes if all(v < floor for k, v in pairs.items() if n in k)
            and any(n in k for k in pairs)] or list(nodes)


def allreduce(ctx: CheckContext) -> Outcome:
    """The sweep across ``ctx.peers`` (this node first). With ``params["share"]`` (the index of this
    node in the peers: a pod of the Kubernetes Indexed Job) only this node's ranks are started here,
    at ``params["port"]``; the share with rank 0 judges, the others report their part done."""
    peers = ctx.peers or (Peer(ctx.node, "127.0.0.1"),)
    plan = plan_for(ctx, len(peers))
    share = ctx.params.get("share")
    report = launch.run_sweep(peers, plan, procs_per_node=procs_per_node(ctx, len(peers)),
                              timeout=float(ctx.params.get("timeout_s", 200)),
                              share=int(share) if share is not None else None,
                              port=int(ctx.params["port"]) if "port" in ctx.params else None)
    if report is None:
        return Outcome(Status.PASS, f"ran {ctx.node}'s ranks of the sweep across {', '.join(p.name for p in peers)}; "
                       f"{peers[0].name} judges it", "", {"nodes": [p.name for p in peers]}, FaultAction.NONE)
    outcome = judge(report, ctx.profile.BusBwFloorGBps, [p.name for p in peers])
    outcome.metrics["sizes"] = plan["sizes"]
    outcome.metrics["report"] = report if ctx.params.get("include_report") else None
    return outcome