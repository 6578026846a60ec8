"""node-problem-detector rule files, the Xid table, fault decisions and the file source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unbroken.config.health import FaultAction, HealthSettings
from unbroken.errors import ConfigError
from unbroken.health import faults
from unbroken.health.kernel_log import rules
from unbroken.health.kernel_log.sources import FileSource
from unbroken.health.kernel_log.watch import KernelLogWatch
from unbroken.health.kernel_log.xid import XidTable
from unbroken.state.phases import DeepHealthStatus, NodeState
from unbroken.state.records import Node

FIXTURE = Path(__file__).parent.parent / "fixtures" / "npd-kernel-monitor.json"


def test_npd_rule_file_loads_unchanged_and_fires():
    config = rules.load(FIXTURE)
    assert (config.plugin, config.logPath, config.lookback, config.bufferSize) == ("kmsg", "/dev/kmsg", "5m", 10)
    assert [c.type for c in config.conditions] == ["KernelDeadlock"]
    watch = KernelLogWatch(HealthSettings(), [config])
    assert watch.push("eth0: link up") == []
    oom = watch.push("Killed process 1234 (python) total-vm:1024kB, anon-rss:512kB, file-rss:0kB, shmem-rss:0kB")
    assert [(f.check, f.action) for f in oom] == [("kernel_log.OOMKilling", FaultAction.NONE)]
    hung = watch.push("INFO: task docker:2301 blocked for more than 120 seconds.")
    assert [(f.check, f.action) for f in hung] == [("kernel_log.DockerHung", FaultAction.REBOOT)]
    assert hung[0].reason == "KernelDeadlock: DockerHung: task docker:2301 blocked for more than 120 seconds."
    # the pattern must match up to the end of the buffer: an unrelated line after it does not re-fire
    assert watch.push("eth0: link down") == []


def test_npd_patterns_may_span_lines_like_npd_buffer():
    config = rules.parse({"bufferSize": 3, "rules": [
        {"type": "permanent", "condition": "FrequentUnregisterNetDevice", "reason": "UnregisterNetDevice",
         "pattern": "unregister_netdevice: waiting for \\w+ to become free. Usage count = \\d+\\nsecond line"}]}, "inline")
    matcher = rules.RuleMatcher(config)
    assert matcher.push("unregister_netdevice: waiting for lo to become free. Usage count = 1") == []
    assert [m.rule.reason for m in matcher.push("second line")] == ["UnregisterNetDevice"]


def test_shipped_rules_and_posix_classes():
    watch = KernelLogWatch(HealthSettings(), [rules.shipped()])
    found = watch.push("EXT4-fs (sda1): Remounting filesystem read-only")
    assert [(f.check, f.action) for f in found] == [("kernel_log.FilesystemIsReadOnly", FaultAction.REBOOT)]
    assert rules.translate("[[:digit:]]+") == "[0-9]+"


def test_bad_rule_files_say_what_is_wrong(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rules": [{"type": "sometimes", "reason": "X", "pattern": "x"}]}))
    with pytest.raises(ConfigError, match=r"bad.json: rules.0.type: 'sometimes' is invalid"):
        rules.load(bad)
    bad.write_text(json.dumps({"rules": [{"type": "temporary", "reason": "X", "pattern": "(unclosed"}]}))
    with pytest.raises(ConfigError, match="rules.0.pattern: '\\(unclosed' is invalid: not a valid regular expression"):
        rules.load(bad)
    bad.write_text(json.dumps({"bufferSise": 3}))
    with pytest.raises(ConfigError, match="bufferSise: unknown field; did you mean 'bufferSize'"):
        rules.load(bad)
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        rules.load(bad)


@pytest.mark.parametrize(("code", "action"), [
    (79, FaultAction.REPLACE), (54, FaultAction.REPLACE), (48, FaultAction.REBOOT), (64, FaultAction.REBOOT),
    (74, FaultAction.REBOOT), (95, FaultAction.REBOOT), (119, FaultAction.REBOOT), (120, FaultAction.REBOOT),
    (13, FaultAction.NONE), (31, FaultAction.NONE), (43, FaultAction.NONE), (45, FaultAction.NONE),
    (68, FaultAction.NONE), (94, FaultAction.NONE), (999, FaultAction.NONE),
])
def test_xid_table_follows_the_catalogue(code, action):
    assert XidTable().lookup(code).action is action


def test_xid_lines_parse_and_the_table_is_overridable():
    line = "[Mon Nov 10 12:00:00 2025] NVRM: Xid (PCI:0000:b9:00): 79, pid=0, GPU has fallen off the bus."
    event = XidTable().parse(line)
    assert event is not None and (event.code, event.pci) == (79, "PCI:0000:b9:00")
    assert event.reason == "Xid 79 (GPU has fallen off the bus) on PCI:0000:b9:00"
    table = XidTable(HealthSettings(XidActions={13: FaultAction.REBOOT, 79: FaultAction.REBOOT}))
    assert table.lookup(13).action is FaultAction.REBOOT and table.lookup(79).name == "GPU has fallen off the bus"
    assert XidTable().parse("NVRM: GPU at PCI:0000:b9:00: GPU-1234 fell off") is None


def _node(state=NodeState.SCHEDULABLE, reboots=0) -> Node:
    return Node(name="node-3", group="g", instance_type="cpu-dev", state=state, deep_health=DeepHealthStatus.PASSED, reboots=reboots)


def test_fault_decisions_map_actions_to_pending_states_and_escalate_after_a_reboot():
    replace = faults.decide(_node(), FaultAction.REPLACE, "Xid 79")
    assert (replace.target, replace.fault_type) == (NodeState.PENDING_REPLACEMENT, "FaultyInstance")
    reboot = faults.decide(_node(), FaultAction.REBOOT, "Xid 48")
    assert (reboot.target, reboot.fault_type) == (NodeState.PENDING_REBOOT, "RebootRequired")
    again = faults.decide(_node(reboots=1), FaultAction.REBOOT, "Xid 48")
    assert again.target is NodeState.PENDING_REPLACEMENT and "again after 1 reboot" in again.reason
    assert faults.decide(_node(), FaultAction.NONE, "Xid 13").target is None
    assert faults.decide(_node(NodeState.PENDING_REPLACEMENT), FaultAction.REPLACE, "x").target is None
    assert faults.decide(_node(NodeState.PENDING_REBOOT), FaultAction.REPLACE, "x").target is NodeState.PENDING_REPLACEMENT


def test_file_source_starts_at_now_and_follows_appends_truncation_and_rotation(tmp_path):
    log = tmp_path / "kmsg.log"
    log.write_text("before the agent started\n")
    source = FileSource(log)
    assert source.read() == []
    with open(log, "a") as f:
        f.write("one\ntw")
    assert source.read() == ["one"]
    with open(log, "a") as f:
        f.write("o\n")
    assert source.read() == ["two"]
    log.write_text("")  # truncated
    assert source.read() == []
    with open(log, "a") as f:
        f.write("after truncation\n")
    assert source.read() == ["after truncation"]
    rotated = tmp_path / "kmsg.log.new"
    rotated.write_text("new file\n")
    rotated.replace(log)
    assert source.read() == ["new file"]
