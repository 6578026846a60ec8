"""Every component's log lines are JSON objects a log shipper reads without a pattern."""

from __future__ import annotations

import json
import subprocess
import sys

CODE = """
import logging
from pathlib import Path
from unbroken.plumbing import logs
logs.setup(component="agent", node="node-1")
log = logging.getLogger("unbroken.test")
log.warning("drain of step %d failed", 40, extra={"job": "mlp", "attempt": 2, "path": Path("/x")})
try:
    raise OSError("disk gone")
except OSError:
    log.exception("pass failed", extra={"node": "node-2"})
"""


def test_log_lines_are_json_with_level_time_component_context_and_traceback():
    result = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True)
    first, second = (json.loads(line) for line in result.stdout.splitlines())
    assert {k: first[k] for k in ("level", "msg", "component", "node", "job", "attempt", "path")} == {
        "level": "warning", "msg": "drain of step 40 failed", "component": "agent", "node": "node-1", "job": "mlp",
        "attempt": 2, "path": "/x"}
    assert first["ts"].endswith("+00:00"), "timestamps are UTC with their offset"
    assert second["level"] == "error" and second["node"] == "node-2", "a record's own context wins over the process's"
    assert "OSError: disk gone" in second["exc"] and second["exc"].startswith("Traceback")
