"""Records to SQLite rows and back (``state/sqlite.py``): enums as their values, booleans as 0/1,
tuples and step timings as JSON; and the small SQL builders the store's methods share."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from enum import StrEnum
from typing import Any, TypeVar, get_type_hints

from unbroken.state.records import Divergence, RankInfo, StepTiming

R = TypeVar("R")


def update(conn: sqlite3.Connection, table: str, key: str, value: Any, changes: dict[str, Any]) -> None:
    if not changes:
        return
    encoded = {k: encode_value(v) for k, v in changes.items()}
    assignments = ", ".join(f"{quote(c)} = ?" for c in encoded)
    conn.execute(f"UPDATE {table} SET {assignments} WHERE {key} = ?", (*encoded.values(), value))


def where(**equal: Any) -> tuple[str, list[Any]]:
    """``col = ?`` for every argument that is not None, ANDed, with its parameters."""
    given = {k: encode_value(v) for k, v in equal.items() if v is not None}
    return " AND ".join(f"{quote(k)} = ?" for k in given), list(given.values())


def quote(column: str) -> str:
    return f'"{column}"'


def encode_value(value: Any) -> Any:
    if isinstance(value, StrEnum):
        return value.value
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (StepTiming, Divergence)):
        return json.dumps(value.to_json(), separators=(",", ":"))
    if isinstance(value, tuple):
        return json.dumps([dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value])  # type: ignore[arg-type]
    return value


def encode(record: Any) -> dict[str, Any]:
    return {f.name: encode_value(getattr(record, f.name)) for f in dataclasses.fields(record)}


_HINTS: dict[type, dict[str, Any]] = {}


def decode(cls: type[R], row: sqlite3.Row) -> R:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = get_type_hints(cls)
    values: dict[str, Any] = {}
    for name in row.keys():
        raw = row[name]
        hint = hints[name]
        if raw is None:
            values[name] = None
        elif isinstance(hint, type) and issubclass(hint, StrEnum):
            values[name] = hint(raw)
        elif hint is bool:
            values[name] = bool(raw)
        elif name == "ranks":
            values[name] = tuple(RankInfo(**r) for r in json.loads(raw))
        elif name == "nodes":
            values[name] = tuple(json.loads(raw))
        elif name == "step_timing":
            values[name] = StepTiming.from_json(json.loads(raw))
        elif name == "divergence":
            values[name] = Divergence.from_json(json.loads(raw))
        else:
            values[name] = raw
    return cls(**values)
