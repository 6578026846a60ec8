"""Pure: kernel-log lines in, findings out (Xid table, NVSwitch SXid table, every NPD rule file)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from unbroken.config.health import FaultAction, HealthSettings
from unbroken.health.kernel_log import rules
from unbroken.health.kernel_log.sxid import SXidTable
from unbroken.health.kernel_log.xid import RECOVERY_ACTION_CHANGED, XidTable


@dataclass(frozen=True)
class Finding:
    check: str
    """``kernel_log.xid``, ``kernel_log.sxid`` or ``kernel_log.<rule reason>``."""
    action: FaultAction
    reason: str
    """For ``fault-reason``: ``Xid 79 (GPU has fallen off the bus) on PCI:0000:b9:00``."""
    line: str
    metrics: dict[str, object]


class KernelLogWatch:
    def __init__(self, settings: HealthSettings, rule_files: list[rules.NpdMonitorConfig] | None = None) -> None:
        self.settings = settings
        self.xids = XidTable(settings)
        self.sxids = SXidTable(settings)
        configs = rule_files if rule_files is not None else [rules.shipped(), *(rules.load(Path(p)) for p in settings.RuleFiles)]
        self.matchers = [rules.RuleMatcher(c) for c in configs]

    def push(self, line: str) -> list[Finding]:
        found: list[Finding] = []
        xid = self.xids.parse(line)
        if xid is not None:
            metrics: dict[str, object] = {"xid": xid.code, "pci": xid.pci, "xid_name": xid.entry.name, "detail": xid.detail}
            if xid.code == RECOVERY_ACTION_CHANGED:
                metrics["recovery_action"] = xid.recovery.name if xid.recovery else None
                metrics["recovery_action_code"] = xid.recovery.code if xid.recovery else None
            found.append(Finding("kernel_log.xid", xid.action, xid.reason, line, metrics))
        sxid = self.sxids.parse(line)
        if sxid is not None:
            found.append(Finding("kernel_log.sxid", sxid.action, sxid.reason, line,
                                 {"sxid": sxid.code, "pci": sxid.pci, "switch": sxid.switch, "severity": sxid.severity,
                                  "sxid_name": sxid.entry.name, "decided_by": sxid.decided_by, "detail": sxid.detail}))
        for matcher in self.matchers:
            for match in matcher.push(line):
                rule = match.rule
                if match.permanent:
                    action = self.settings.ConditionActions.get(rule.condition, FaultAction.REBOOT)
                    reason = f"{rule.condition}: {rule.reason}: {match.text.splitlines()[-1][:200]}"
                else:
                    action, reason = FaultAction.NONE, f"{rule.reason}: {match.text.splitlines()[-1][:200]}"
                found.append(Finding(f"kernel_log.{rule.reason}", action, reason, line,
                                     {"rule_type": rule.type, "condition": rule.condition or None, "source": match.source}))
        return found
