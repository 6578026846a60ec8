"""One deep-check suite inside a Kubernetes Job's pod: ``python -m unbroken.health.pod``.

The operator runs each ``OnStartDeepHealthChecks`` suite of a joining node as a
batch/v1 Job pinned to it (``unbroken.kubernetes.operator.deep_checks``). The pod needs no API
access: the operator hands it everything in the environment, and reads the
verdict back from the pod's termination message:

* ``UNBROKEN_CHECK_SUITE``: ``InstanceStress`` or ``InstanceConnectivity``;
* ``UNBROKEN_CHECK_CONTEXT``: the check context as JSON (node, profile, health
  settings);
* ``UNBROKEN_CHECK_DIR``: the scratch directory on the node (a hostPath mount)
  where stress and storage checks write.

InstanceConnectivity across nodes is one Indexed Job with a pod on each node of
the sweep (the context's ``peers``, the joining node first): each pod starts its
own node's ranks (found by ``NODE_NAME``) and the joining node's pod, which holds
rank 0, judges. Peers only lend their ranks: their pods run the sweep alone.

Each result is logged as one JSON line; the last line of stdout is the verdict,
``VERDICT_MARK`` + JSON ``{"passed", "reason", "fault_type", "blamed", "results"}``, also
written to ``/dev/termination-log`` where the kubelet provides it. The exit code
is 0 when the node passed, 1 when it failed, 2 when the pod was started wrongly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from unbroken.health import catalogue, join, runner
from unbroken.health.context import CheckContext
from unbroken.health.result import CheckResult, Suite

SUITE_ENV = "UNBROKEN_CHECK_SUITE"
CONTEXT_ENV = "UNBROKEN_CHECK_CONTEXT"
DIR_ENV = "UNBROKEN_CHECK_DIR"
VERDICT_MARK = "@@unbroken-verdict@@ "
SWEEP_CHECK = "collective.allreduce"
TERMINATION_LOG = Path("/dev/termination-log")
REASON_LIMIT = 1500
"""Characters of the reason kept: the kubelet keeps at most 4096 bytes (2048 lines' tail) of a termination message."""


def verdict_record(node: str, results: list[CheckResult]) -> dict[str, Any]:
    verdict = join.judge(node, results)
    blamed = sorted({peer for r in results for peer in join.blamed_peers(node, r)})
    return {
        "passed": verdict.passed, "reason": verdict.reason[:REASON_LIMIT], "fault_type": verdict.fault_type,
        "blamed": blamed,
        "results": [{"check": r.check, "status": r.status.value, "duration_s": r.duration_s} for r in results],
    }


def parse_verdict(text: str) -> dict[str, Any] | None:
    """The verdict in a pod's termination message or log tail; None when there is none (the pod died first)."""
    for line in reversed(text.splitlines()):
        if line.startswith(VERDICT_MARK):
            try:
                found = json.loads(line[len(VERDICT_MARK):])
            except ValueError:
                return None
            return found if isinstance(found, dict) and "passed" in found else None
    return None


def main() -> int:
    try:
        suite = Suite(os.environ[SUITE_ENV])
        ctx = CheckContext.from_json(os.environ[CONTEXT_ENV])
    except (KeyError, ValueError) as exc:
        print(f"deep-check pod: {SUITE_ENV} and {CONTEXT_ENV} must be set by the operator: {exc}", file=sys.stderr)
        return 2
    scratch = Path(os.environ.get(DIR_ENV) or ctx.node_dir)
    ctx = dataclasses.replace(ctx, node_dir=scratch, storage_dir=scratch / "storage")
    scratch.mkdir(parents=True, exist_ok=True)
    checks = catalogue.for_suite(suite, ctx.settings)
    if len(ctx.peers) > 1:  # one pod of the cross-node sweep's Indexed Job: which node's share is ours
        here = os.environ.get("NODE_NAME", "")
        shares = [i for i, peer in enumerate(ctx.peers) if peer.name == here]
        if not shares:
            print(f"deep-check pod: NODE_NAME {here!r} is none of the sweep's nodes "
                  f"({', '.join(p.name for p in ctx.peers)})", file=sys.stderr)
            return 2
        ctx = dataclasses.replace(ctx, node=here, params={**ctx.params, "share": shares[0]})
        if shares[0] != 0:  # a peer that passed already: it lends its ranks to the sweep, it is not re-judged
            checks = [c for c in checks if c.id == SWEEP_CHECK]
    results = runner.run_suite(checks, ctx, suite)
    for r in results:
        print(json.dumps({"check": r.check, "status": r.status.value, "reason": r.reason, "message": r.message,
                          "duration_s": r.duration_s, "node": ctx.node}), flush=True)
    record = verdict_record(ctx.node, results)
    line = VERDICT_MARK + json.dumps(record)
    print(line, flush=True)
    try:
        TERMINATION_LOG.write_text(line + "\n")
    except OSError:
        pass  # outside a pod (or a kubelet without the file): the log's last line carries it
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
