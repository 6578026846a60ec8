"""NVIDIA Xid lines and the table that says what each code does to the node (``data/xid.yaml``).

Most codes mean one thing; Xid 154 does not. Newer drivers log it after another Xid to say
what the GPU now needs ("GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot
Required)"), so the action named in the line decides, not the code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import yaml

from unbroken.config.health import FaultAction, HealthSettings

# NVRM: Xid (PCI:0000:b9:00): 79, pid=..., GPU has fallen off the bus.
XID_LINE = re.compile(r"NVRM: Xid \((?P<pci>PCI:[0-9A-Fa-f:.]+)\): (?P<code>\d+),\s*(?P<detail>.*)")

RECOVERY_ACTION_CHANGED = 154
# "... changed from 0x0 (None) to 0x2 (Node Reboot Required)": everything after "to" is the new action.
_CHANGED_TO = re.compile(r"\bchanged\b.*?\bto\b\s*(?P<to>.+?)\s*\.?\s*$", re.IGNORECASE)
_HEX = re.compile(r"\b0x(?P<hex>[0-9A-Fa-f]+)\b")
_WORDS = re.compile(r"\((?P<words>[^()]*)\)")


@dataclass(frozen=True)
class XidEntry:
    code: int
    name: str
    action: FaultAction


@dataclass(frozen=True)
class RecoveryAction:
    """One value of the driver's GPU recovery action field (NVML ``nvmlDeviceGetGpuRecoveryAction``)."""

    code: int
    name: str
    action: FaultAction
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class XidEvent:
    code: int
    pci: str
    detail: str
    entry: XidEntry
    action: FaultAction
    """What the node gets: the entry's action, or for Xid 154 the recovery action the line names."""
    recovery: RecoveryAction | None = None
    """Xid 154 only: the new recovery action; None where the line could not be read."""
    outcome: str = ""
    """Appended to the reason: for Xid 154 the new recovery action, or why the table entry decided."""

    @property
    def reason(self) -> str:
        head = f"Xid {self.code} ({self.entry.name}) on {self.pci}"
        return f"{head}: {self.outcome}" if self.outcome else head


def _key(text: str) -> str:
    """Case, spacing and punctuation do not matter, nor a trailing "Required": "GPU reset" == "GPU Reset Required"."""
    return re.sub(r"[^a-z0-9]", "", text.lower()).removesuffix("required")


@cache
def _shipped() -> tuple[FaultAction, dict[int, XidEntry], dict[int, RecoveryAction]]:
    data: dict[str, Any] = yaml.safe_load(resources.files("unbroken.health").joinpath("data/xid.yaml").read_text())
    table = {int(code): XidEntry(int(code), e["name"], FaultAction(e["action"])) for code, e in data["Codes"].items()}
    recovery = {int(code): RecoveryAction(int(code), str(e["name"]), FaultAction(e["action"]), tuple(e.get("aliases", ())))
                for code, e in data["RecoveryActions"].items()}
    return FaultAction(data["DefaultAction"]), table, recovery


def recovery_actions() -> dict[int, RecoveryAction]:
    return dict(_shipped()[2])


def parse_recovery_action(detail: str) -> RecoveryAction | None:
    """The new action in an Xid 154 line; None if the text names none that the table knows.

    The hex code decides where the table knows it (the words in parentheses are the driver's
    rendering of the same number); otherwise the words, matched against names and aliases.
    """
    changed = _CHANGED_TO.search(detail)
    if changed is None:
        return None
    to = changed.group("to")
    known = _shipped()[2]
    number = _HEX.search(to)
    if number is not None and int(number.group("hex"), 16) in known:
        return known[int(number.group("hex"), 16)]
    words = _WORDS.search(to)
    text = words.group("words") if words else _HEX.sub("", to)
    wanted = _key(text)
    if not wanted:
        return None
    for action in known.values():
        if wanted in {_key(name) for name in (action.name, *action.aliases)}:
            return action
    return None


class XidTable:
    def __init__(self, settings: HealthSettings | None = None) -> None:
        self.default, shipped, _ = _shipped()
        self.entries = dict(shipped)
        self.overridden = set(settings.XidActions) if settings else set()
        for code, action in (settings.XidActions if settings else {}).items():
            name = shipped[code].name if code in shipped else f"Xid {code}"
            self.entries[code] = XidEntry(code, name, action)

    def lookup(self, code: int) -> XidEntry:
        return self.entries.get(code) or XidEntry(code, "not in the Xid table", self.default)

    def parse(self, line: str) -> XidEvent | None:
        match = XID_LINE.search(line)
        if not match:
            return None
        code, pci, detail = int(match.group("code")), match.group("pci"), match.group("detail").strip()
        entry = self.lookup(code)
        if code != RECOVERY_ACTION_CHANGED:
            return XidEvent(code, pci, detail, entry, entry.action)
        return self._recovery_changed(pci, detail, entry)

    def _recovery_changed(self, pci: str, detail: str, entry: XidEntry) -> XidEvent:
        """Xid 154: the new recovery action decides; a cluster's own ``XidActions[154]`` still wins."""
        recovery = parse_recovery_action(detail)
        if recovery is None:
            outcome = f"recovery action not recognised in {detail[:120]!r}; acting on the Xid table's entry for 154"
            return XidEvent(entry.code, pci, detail, entry, entry.action, None, outcome)
        action = entry.action if entry.code in self.overridden else recovery.action
        return XidEvent(entry.code, pci, detail, entry, action, recovery, recovery.name)
