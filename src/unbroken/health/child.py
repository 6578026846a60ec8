"""The process a check runs in: ``python -m unbroken.health.child`` (see ``runner``).

Reads ``{"target", "context"}`` on stdin, imports and calls the target, and
prints one result line. An exception in the check is a ``Fail`` with the
exception's text, never a silent pass.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unbroken.health.context import CheckContext
from unbroken.health.result import FaultAction, Outcome, Status
from unbroken.health.runner import RESULT_MARK


def load_target(target: str) -> Callable[[CheckContext], Outcome]:
    where, _, name = target.rpartition(":")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(where).stem, where)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {where}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    function: Callable[[CheckContext], Outcome] = getattr(module, name)
    return function


def main() -> int:
    request: dict[str, Any] = json.loads(sys.stdin.read())
    ctx = CheckContext.from_json(json.dumps(request["context"]))
    try:
        outcome = load_target(request["target"])(ctx)
    except Exception as exc:  # noqa: BLE001 - any failure of a check is reported as its result
        outcome = Outcome(Status.FAIL, f"check raised {type(exc).__name__}: {exc}", "Error", {}, FaultAction.REPLACE)
    data = dataclasses.asdict(outcome)
    print(RESULT_MARK + json.dumps(data, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
