"""Read a YAML/JSON file into a pydantic model; turn every failure into one line.

The message always names the file, the field, the bad value and what would be
valid, because the person reading it has only that line to fix their file.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from unbroken.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


def read_mapping(path: Path) -> dict[str, Any]:
    """Parse ``path`` as YAML (a superset of JSON) and require a mapping at the top."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {_one_line(str(exc))}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of fields at the top level, got {type(data).__name__}")
    return data


def load_model(path: Path, model: type[M], *, context: dict[str, Any] | None = None) -> M:
    """Load and validate ``path`` as ``model``; raise :class:`ConfigError` on any problem."""
    data = read_mapping(path)
    return validate_mapping(data, model, source=str(path), context=context)


def validate_mapping(data: dict[str, Any], model: type[M], *, source: str, context: dict[str, Any] | None = None) -> M:
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {describe_validation_error(exc, model)}") from None


def describe_validation_error(exc: ValidationError, model: type[BaseModel]) -> str:
    """Render pydantic's errors as ``field: value 'x' is invalid: why`` joined by '; '."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            parts.append(f"{loc}: unknown field{_suggestion(err['loc'], model)}")
        elif err["type"] == "missing":
            parts.append(f"{loc}: required field is missing")
        elif not err["loc"]:  # a whole-file rule: its message names the field itself
            parts.append(err["msg"].removeprefix("Value error, "))
        else:
            msg = err["msg"].removeprefix("Value error, ")
            parts.append(f"{loc}: {_show(err.get('input'))} is invalid: {msg}")
    return "; ".join(parts)


def _suggestion(loc: tuple[Any, ...], model: type[BaseModel]) -> str:
    """'did you mean X?' from the known field names at that level of the model."""
    names = _field_names_at(model, loc[:-1])
    close = difflib.get_close_matches(str(loc[-1]), names, n=1)
    valid = f" (valid: {', '.join(sorted(names))})" if names else ""
    return f"; did you mean '{close[0]}'?" if close else valid


def _field_names_at(model: type[BaseModel], path: tuple[Any, ...]) -> list[str]:
    current: Any = model
    for part in path:
        if isinstance(part, int):
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return []
        field = current.model_fields.get(str(part)) or next(
            (f for f in current.model_fields.values() if f.alias == part), None
        )
        if field is None:
            return []
        current = _inner_model(field.annotation)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return [f.alias or n for n, f in current.model_fields.items()]
    return []


def _inner_model(annotation: Any) -> Any:
    """The BaseModel inside ``list[Model]``, ``Model | None`` and the like."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def _show(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _one_line(text: str) -> str:
    return " ".join(text.split())
