"""node-problem-detector's system-log-monitor rule format, loaded unchanged.

The fields are NPD's own (``plugin``, ``pluginConfig``, ``logPath``,
``lookback``, ``bufferSize``, ``source``, ``conditions``, ``rules`` with
``type temporary|permanent``, ``condition``, ``reason``, ``pattern``), so an
existing NPD file works as it is. Matching follows NPD's log buffer: the
last ``bufferSize`` lines joined by newlines, and a rule fires when its pattern
matches up to the end of the buffer (NPD appends ``\\z``; a pattern may span
lines). Patterns are Go RE2 syntax; the subset NPD files use (and POSIX
classes like ``[[:digit:]]``) means the same in Python's ``re``.
"""

from __future__ import annotations

import json
import re
from collections import deque
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from unbroken.config.loading import describe_validation_error
from unbroken.errors import ConfigError


class _Npd(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class NpdCondition(_Npd):
    type: str
    reason: str
    message: str = ""


class NpdRule(_Npd):
    type: Literal["temporary", "permanent"]
    condition: str = ""
    reason: str
    pattern: str
    patternGeneratedMessageSuffix: str = ""

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(translate(pattern))
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None
        return pattern


class NpdMonitorConfig(_Npd):
    plugin: str = "kmsg"
    pluginConfig: dict[str, str] = Field(default_factory=dict)
    skipList: list[str] = Field(default_factory=list)
    logPath: str = ""
    lookback: str = ""
    delay: str = ""
    bufferSize: int = Field(default=10, ge=1)
    source: str = ""
    metricsReporting: bool | None = None
    conditions: list[NpdCondition] = Field(default_factory=list)
    rules: list[NpdRule] = Field(default_factory=list)


_POSIX = {"[:alpha:]": "a-zA-Z", "[:digit:]": "0-9", "[:alnum:]": "a-zA-Z0-9", "[:space:]": r"\s", "[:upper:]": "A-Z",
          "[:lower:]": "a-z", "[:xdigit:]": "0-9A-Fa-f", "[:word:]": r"\w", "[:punct:]": r"!-/:-@\[-`{-~"}


def translate(pattern: str) -> str:
    """A Go RE2 pattern as Python ``re`` reads it (POSIX bracket classes)."""
    for posix, python in _POSIX.items():
        pattern = pattern.replace(posix, python)
    return pattern


def load(path: Path) -> NpdMonitorConfig:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read node-problem-detector rules: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno}") from None
    return parse(data, str(path))


def parse(data: object, source: str) -> NpdMonitorConfig:
    try:
        return NpdMonitorConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {describe_validation_error(exc, NpdMonitorConfig)}") from None


def shipped() -> NpdMonitorConfig:
    text = resources.files("unbroken.health").joinpath("data/kernel-monitor.json").read_text()
    return parse(json.loads(text), "unbroken/health/data/kernel-monitor.json")


@dataclass(frozen=True)
class RuleMatch:
    rule: NpdRule
    source: str
    text: str
    """The matched log text (one or more lines)."""

    @property
    def permanent(self) -> bool:
        return self.rule.type == "permanent"


class RuleMatcher:
    """NPD's log buffer for one rule file: push lines, get the rules that fire."""

    def __init__(self, config: NpdMonitorConfig) -> None:
        self.config = config
        self.buffer: deque[str] = deque(maxlen=config.bufferSize)
        self.compiled = [(rule, re.compile(translate(rule.pattern) + r"\Z")) for rule in config.rules]

    def push(self, line: str) -> list[RuleMatch]:
        if any(skip in line for skip in self.config.skipList):
            return []
        self.buffer.append(line)
        joined = "\n".join(self.buffer)
        matches = []
        for rule, regex in self.compiled:
            found = regex.search(joined)
            if found:
                matches.append(RuleMatch(rule, self.config.source, found.group(0)))
        return matches
