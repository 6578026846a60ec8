"""Structured logs: one JSON object per line, ``{"level","ts","component",...,"msg"}``.

Agents and the controller write to files under the cluster directory; anything
that parses JSON lines (jq, Loki, CloudWatch, Fluent Bit) reads them without a
pattern. The encoding (extra fields, exceptions, values JSON does not know) is
python-json-logger's; this module only names the fields.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from pythonjsonlogger.json import JsonFormatter as _LibraryFormatter


class JsonFormatter(_LibraryFormatter):
    """``level`` in lower case (``"error"``), ``ts`` in UTC, the message as ``msg``, a traceback as ``exc``."""

    def __init__(self, **static: Any) -> None:
        super().__init__("{levelname}{message}", style="{", static_fields=static, timestamp="ts",
                         rename_fields={"levelname": "level", "message": "msg", "exc_info": "exc"})

    def add_fields(self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]) -> None:
        super().add_fields(log_data, record, message_dict)
        log_data["level"] = record.levelname.lower()


def setup(**static: Any) -> None:
    """Route the root logger to stdout as JSON lines, tagged with ``static`` fields."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonFormatter(**static))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
