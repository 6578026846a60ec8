"""NVSwitch SXid lines and their table (``data/sxid.yaml``).

An NVSwitch reports its own errors ("Switch Xids") through the same kernel log. Unlike an Xid,
each line carries the driver's verdict (``Fatal`` / ``Non-fatal``), so a code the table does not
know is still acted on: the severity word decides.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import yaml

from unbroken.config.health import FaultAction, HealthSettings

# nvidia-nvswitch3: SXid (PCI:0000:08:00.0): 20034, Fatal, Link 30 LTSSM Fault Up
SXID_LINE = re.compile(r"(?:(?P<switch>nvidia-nvswitch\d+):\s*)?SXid \((?P<pci>PCI:[0-9A-Fa-f:.]+)\): (?P<code>\d+),\s*(?P<detail>.*)")
_SEVERITY = re.compile(r"^(?P<word>non[- ]?fatal|fatal)\s*(?:,|$)", re.IGNORECASE)
# The driver follows the headline with lines of the same SXid that carry no verdict:
# "20034, Severity 1 Engine instance 30 Sub-engine instance 00" and "20034, Data {0x..., ...}".
_CONTINUATION = re.compile(r"^(?:Severity\s+\d|Data\s*\{)", re.IGNORECASE)


@dataclass(frozen=True)
class SXidEntry:
    code: int
    name: str
    action: FaultAction


@dataclass(frozen=True)
class SXidEvent:
    code: int
    pci: str
    switch: str | None
    """The switch device, ``nvidia-nvswitch3``; None where the line names none."""
    severity: str | None
    """``Fatal`` or ``Non-fatal`` as the driver wrote it (normalised); None where the line has neither."""
    detail: str
    entry: SXidEntry
    action: FaultAction
    decided_by: str
    """``table``, ``severity`` or ``default``: what chose the action (for the event's metrics)."""

    @property
    def reason(self) -> str:
        where = f"{self.switch} ({self.pci})" if self.switch else self.pci
        head = f"SXid {self.code} ({self.entry.name}) on {where}"
        return f"{head}: {self.severity}" if self.severity else head


def _severity(word: str) -> str:
    return "Fatal" if word.lower() == "fatal" else "Non-fatal"


@cache
def _shipped() -> tuple[FaultAction, dict[str, FaultAction], dict[int, SXidEntry]]:
    data: dict[str, Any] = yaml.safe_load(resources.files("unbroken.health").joinpath("data/sxid.yaml").read_text())
    table = {int(code): SXidEntry(int(code), e["name"], FaultAction(e["action"])) for code, e in data["Codes"].items()}
    severity = {_severity(word): FaultAction(action) for word, action in data["SeverityActions"].items()}
    return FaultAction(data["DefaultAction"]), severity, table


class SXidTable:
    def __init__(self, settings: HealthSettings | None = None) -> None:
        self.default, self.by_severity, shipped = _shipped()
        self.entries = dict(shipped)
        for code, action in (settings.SXidActions if settings else {}).items():
            name = shipped[code].name if code in shipped else f"SXid {code}"
            self.entries[code] = SXidEntry(code, name, action)

    def decide(self, code: int, severity: str | None) -> tuple[SXidEntry, FaultAction, str]:
        """The table's entry decides; else the line's severity word; else the default."""
        entry = self.entries.get(code)
        if entry is not None:
            return entry, entry.action, "table"
        unknown = SXidEntry(code, "not in the SXid table", self.default)
        if severity is not None and severity in self.by_severity:
            return unknown, self.by_severity[severity], "severity"
        return unknown, self.default, "default"

    def parse(self, line: str) -> SXidEvent | None:
        """None for a line that is no SXid, and for the verdict-less lines that follow a headline."""
        match = SXID_LINE.search(line)
        if not match:
            return None
        code, detail = int(match.group("code")), match.group("detail").strip()
        word = _SEVERITY.match(detail)
        if word is None and _CONTINUATION.match(detail):
            return None
        severity = _severity(word.group("word")) if word else None
        entry, action, decided_by = self.decide(code, severity)
        return SXidEvent(code, match.group("pci"), match.group("switch"), severity, detail, entry, action, decided_by)
