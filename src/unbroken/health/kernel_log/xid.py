"""NVIDIA Xid lines and the table that says what each code does to the node (``data/xid.yaml``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

import yaml

from unbroken.config.health import FaultAction, HealthSettings

# NVRM: Xid (PCI:0000:b9:00): 79, pid=..., GPU has fallen off the bus.
XID_LINE = re.compile(r"NVRM: Xid \((?P<pci>PCI:[0-9A-Fa-f:.]+)\): (?P<code>\d+),\s*(?P<detail>.*)")


@dataclass(frozen=True)
class XidEntry:
    code: int
    name: str
    action: FaultAction


@dataclass(frozen=True)
class XidEvent:
    code: int
    pci: str
    detail: str
    entry: XidEntry

    @property
    def reason(self) -> str:
        return f"Xid {self.code} ({self.entry.name}) on {self.pci}"


@cache
def _shipped() -> tuple[FaultAction, dict[int, XidEntry]]:
    data = yaml.safe_load(resources.files("unbroken.health").joinpath("data/xid.yaml").read_text())
    table = {int(code): XidEntry(int(code), e["name"], FaultAction(e["action"])) for code, e in data["Codes"].items()}
    return FaultAction(data["DefaultAction"]), table


class XidTable:
    def __init__(self, settings: HealthSettings | None = None) -> None:
        self.default, shipped = _shipped()
        self.entries = dict(shipped)
        for code, action in (settings.XidActions if settings else {}).items():
            name = shipped[code].name if code in shipped else f"Xid {code}"
            self.entries[code] = XidEntry(code, name, action)

    def lookup(self, code: int) -> XidEntry:
        return self.entries.get(code) or XidEntry(code, "not in the Xid table", self.default)

    def parse(self, line: str) -> XidEvent | None:
        match = XID_LINE.search(line)
        if not match:
            return None
        code = int(match.group("code"))
        return XidEvent(code, match.group("pci"), match.group("detail").strip(), self.lookup(code))
