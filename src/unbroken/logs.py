"""Structured logs: one JSON object per line, ``{"level","ts","component",...,"msg"}``.

Agents and the controller write to files under the cluster directory; anything
that parses JSON lines (jq, Loki, CloudWatch) reads them without a pattern.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone
from typing import Any

_RESERVED = set(vars(logging.makeLogRecord({})))


class JsonFormatter(logging.Formatter):
    def __init__(self, **static: Any) -> None:
        super().__init__()
        self._static = static

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "level": record.levelname.lower(),
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            **self._static,
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _RESERVED and not k.startswith("_")})
        entry["msg"] = record.getMessage()
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup(**static: Any) -> None:
    """Route the root logger to stdout as JSON lines, tagged with ``static`` fields."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonFormatter(**static))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
