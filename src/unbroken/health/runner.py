"""Run checks so that no check can hang its caller.

Each check runs in a child process (``python -m unbroken.health.child``) in its
own session; past its timeout the whole process tree is SIGKILLed and the
result is ``Fail`` with reason ``Timeout``. Why a process and not a thread:
the hangs that matter happen inside C code (an NVML call on a GPU that fell off
the bus, a CUDA kernel that never returns, a write to a dead NFS server) where
a Python thread can be neither interrupted nor reclaimed and may hold the GIL
or a driver lock the agent needs; a killed process gives everything back, and a
crash (segfault in a driver library) stays out of the agent. The price is
interpreter start-up (~0.1 s, plus ~1.5 s where a check imports torch), paid
only on join and every ``MonitorIntervalSeconds``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from unbroken.plumbing import procs
from unbroken.health.catalogue import CheckSpec, timeout_for
from unbroken.health.context import CheckContext
from unbroken.health.result import TIMEOUT, CheckResult, FaultAction, Status, Suite

RESULT_MARK = "@@unbroken-check-result@@ "
"""Prefix of the child's result line: checks and libraries may print anything else."""


def run_check(spec: CheckSpec, ctx: CheckContext, suite: Suite | None = None, timeout: float | None = None) -> CheckResult:
    """Run ``spec`` in a child process; never takes longer than its timeout (+ ~1 s to reap)."""
    limit = timeout if timeout is not None else timeout_for(spec, ctx.settings)
    suite = suite or min(spec.suites)
    request = json.dumps({"target": spec.target, "context": json.loads(ctx.to_json())})
    started = time.monotonic()
    child = subprocess.Popen(
        [sys.executable, "-m", "unbroken.health.child"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        out, err = child.communicate(request, timeout=limit)
    except subprocess.TimeoutExpired:
        procs.kill_now(procs.tree(child.pid))
        child.communicate()
        took = time.monotonic() - started
        return CheckResult(spec.id, suite, Status.FAIL, f"did not finish within its timeout of {limit:g} s; killed",
                           TIMEOUT, {"timeout_s": limit}, FaultAction.REPLACE, ctx.node, duration_s=round(took, 3))
    took = round(time.monotonic() - started, 3)
    line = next((ln for ln in reversed(out.splitlines()) if ln.startswith(RESULT_MARK)), None)
    if line is None:
        tail = " ".join(err.strip().splitlines()[-1:]) or f"exit code {child.returncode}"
        return CheckResult(spec.id, suite, Status.FAIL, f"check crashed before reporting: {tail}", "Crashed",
                           {"exit_code": child.returncode}, FaultAction.REPLACE, ctx.node, duration_s=took)
    data = json.loads(line[len(RESULT_MARK):])
    return CheckResult(
        spec.id, suite, Status(data["status"]), data["message"], data.get("reason", ""), data.get("metrics") or {},
        FaultAction(data.get("action", FaultAction.REPLACE.value)), ctx.node,
        tuple(data.get("faulty_nodes") or ()), took,
    )


def run_suite(specs: list[CheckSpec], ctx: CheckContext, suite: Suite) -> list[CheckResult]:
    """Every check of the suite, in catalogue order, each under its own timeout."""
    return [run_check(spec, ctx, suite) for spec in specs]


def alive_children() -> int:
    """Check processes still running under this process (tests assert none leak)."""
    return sum(1 for p in procs.tree(os.getpid())[1:] if "unbroken.health.child" in " ".join(p.cmdline()))
