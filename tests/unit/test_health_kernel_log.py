"""node-problem-detector rule files, the Xid table, fault decisions and the file source."""

from __future__ import annotations

import fnmatch
import json
import os
import termios
import tomllib
from pathlib import Path

import pytest

from unbroken.config.health import FaultAction, HealthSettings
from unbroken.config.loading import validate_mapping
from unbroken.errors import ConfigError
from unbroken.health import faults
from unbroken.health.xid_lines import sxid_line, xid_line
from unbroken.health.kernel_log import rules
from unbroken.health.kernel_log.sources import FileSource, KmsgSource
from unbroken.health.kernel_log.sxid import SXidTable
from unbroken.health.kernel_log.watch import KernelLogWatch
from unbroken.health.kernel_log.xid import XidTable, recovery_actions
from unbroken.health.monitor import finding_result
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


EKS_FATAL_XIDS = (46, 48, 54, 62, 63, 64, 74, 79, 95, 109, 110, 119, 120, 136, 140, 142, 143, 151, 155, 156, 158)
"""The EKS node monitoring agent's fatal Xids (its node health issues table)."""
EKS_DELIBERATE_EXCEPTIONS = {63: FaultAction.NONE}
"""Where unbroken does not act as on a fatal Xid, and what it does instead (xid.yaml says why on the entry):
63 records a successful row remap; the pending remap and a failed one are caught elsewhere."""


def test_every_eks_fatal_xid_has_an_explicit_entry_that_acts():
    table = XidTable()
    for code in EKS_FATAL_XIDS:
        assert code in table.entries, f"Xid {code} is fatal to EKS but falls to the table's default"
        action = table.lookup(code).action
        if code in EKS_DELIBERATE_EXCEPTIONS:
            assert action is EKS_DELIBERATE_EXCEPTIONS[code], code
        else:
            assert action in (FaultAction.REBOOT, FaultAction.REPLACE), f"Xid {code}: {action}"
    assert table.lookup(46).name == "GPU stopped processing" and table.lookup(110).name == "Security fault error"


PCI = "PCI:0000:b9:00"


@pytest.mark.parametrize(("text", "action", "named"), [
    ("GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)", FaultAction.REBOOT, "Node Reboot Required"),
    ("GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)", FaultAction.REBOOT, "GPU Reset Required"),
    ("GPU recovery action changed from 0x0 (None) to 0x3 (Drain P2P)", FaultAction.REBOOT, "Drain P2P"),
    ("GPU recovery action changed from 0x3 (Drain P2P) to 0x4 (Drain and Reset)", FaultAction.REBOOT, "Drain and Reset"),
    ("GPU recovery action changed from 0x2 (Node Reboot Required) to 0x0 (None)", FaultAction.NONE, "None"),
    # the words alone, spelled loosely; the hex alone
    ("GPU recovery action changed from None to (gpu  reset)", FaultAction.REBOOT, "GPU Reset Required"),
    ("GPU recovery action changed from 0x0 to 0x2.", FaultAction.REBOOT, "Node Reboot Required"),
    ("GPU Recovery Action changed from 0x0 (None) to NODE REBOOT REQUIRED", FaultAction.REBOOT, "Node Reboot Required"),
])
def test_xid_154_the_recovery_action_in_the_line_decides(text, action, named):
    line = f"[Mon Nov 10 12:00:00 2025] NVRM: Xid ({PCI}): 154, {text}"
    found = KernelLogWatch(HealthSettings(), []).push(line)
    assert [(f.check, f.action) for f in found] == [("kernel_log.xid", action)]
    assert found[0].reason == f"Xid 154 (GPU recovery action changed) on {PCI}: {named}"
    assert found[0].metrics["recovery_action"] == named


def test_xid_154_recovery_actions_map_to_unbroken_actions():
    mapped = {code: (a.name, a.action) for code, a in recovery_actions().items()}
    assert mapped == {0: ("None", FaultAction.NONE), 1: ("GPU Reset Required", FaultAction.REBOOT),
                      2: ("Node Reboot Required", FaultAction.REBOOT), 3: ("Drain P2P", FaultAction.REBOOT),
                      4: ("Drain and Reset", FaultAction.REBOOT)}


@pytest.mark.parametrize("text", [
    "GPU recovery action changed from 0x0 (None) to 0x9 (Something New)",
    "GPU recovery action changed",
    "pid=0, unreadable",
])
def test_xid_154_unreadable_falls_back_to_its_table_entry_and_says_so(text):
    event = XidTable().parse(f"NVRM: Xid ({PCI}): 154, {text}")
    assert event is not None and event.recovery is None
    assert event.action is FaultAction.REBOOT is XidTable().lookup(154).action
    assert event.reason.startswith(f"Xid 154 (GPU recovery action changed) on {PCI}: recovery action not recognised in ")
    assert event.reason.endswith("acting on the Xid table's entry for 154")


def test_xid_154_a_cluster_override_wins_over_the_line():
    table = XidTable(HealthSettings(XidActions={154: FaultAction.NONE}))
    event = table.parse(f"NVRM: Xid ({PCI}): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)")
    assert event is not None and event.action is FaultAction.NONE and event.reason.endswith(": Node Reboot Required")
    # other codes are untouched by the 154 logic
    assert XidTable().parse(f"NVRM: Xid ({PCI}): 79, GPU recovery action changed to 0x0 (None)").action is FaultAction.REPLACE


def test_chaos_xid_154_writes_a_line_that_asks_for_a_reboot():
    line = xid_line(154)
    assert "NVRM: Xid (PCI:0000:b9:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)" in line
    found = KernelLogWatch(HealthSettings(), []).push(line)
    assert [(f.action, f.metrics["recovery_action_code"]) for f in found] == [(FaultAction.REBOOT, 2)]
    assert finding_result("node-1", found[0]).reason == "Xid154"


def test_sxid_lines_parse_with_their_own_table():
    watch = KernelLogWatch(HealthSettings(), [])
    fatal = watch.push("[131453.740743] nvidia-nvswitch3: SXid (PCI:0000:08:00.0): 20034, Fatal, Link 30 LTSSM Fault Up")
    assert [(f.check, f.action) for f in fatal] == [("kernel_log.sxid", FaultAction.REBOOT)]
    assert fatal[0].reason == "SXid 20034 (LTSSM Fault Up) on nvidia-nvswitch3 (PCI:0000:08:00.0): Fatal"
    metrics = fatal[0].metrics
    assert (metrics["sxid"], metrics["pci"], metrics["severity"], metrics["switch"]) == (20034, "PCI:0000:08:00.0", "Fatal",
                                                                                      "nvidia-nvswitch3")
    assert metrics["decided_by"] == "table" and metrics["detail"] == "Fatal, Link 30 LTSSM Fault Up"
    assert finding_result("node-1", fatal[0]).reason == "SXid20034"
    replay = watch.push(sxid_line(20001, "Non-fatal", "Link 04 TX replay error", switch="nvidia-nvswitch0"))
    assert [(f.action, f.metrics["sxid_name"], f.metrics["switch"]) for f in replay] == [
        (FaultAction.NONE, "TX replay error", "nvidia-nvswitch0")]
    # the verdict-less lines the driver writes after a headline are part of the same SXid: no second finding
    assert watch.push("nvidia-nvswitch3: SXid (PCI:0000:08:00.0): 20034, Severity 1 Engine instance 30 Sub-engine instance 00") == []
    assert watch.push("nvidia-nvswitch3: SXid (PCI:0000:08:00.0): 20034, Data {0x00000000, 0x00000001}") == []
    assert SXidTable().parse("NVRM: Xid (PCI:0000:b9:00): 79, pid=0, GPU has fallen off the bus.") is None


@pytest.mark.parametrize(("line", "action", "decided_by"), [
    ("nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 29999, Fatal, Link 7 something new", FaultAction.REBOOT, "severity"),
    ("nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 29999, Non-fatal, Link 7 something new", FaultAction.NONE, "severity"),
    ("nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 29999, non-fatal, Link 7 something new", FaultAction.NONE, "severity"),
    ("nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 29999, Link 7 something new", FaultAction.NONE, "default"),
])
def test_an_sxid_the_table_does_not_know_follows_the_severity_word(line, action, decided_by):
    event = SXidTable().parse(line)
    assert event is not None and (event.entry.name, event.action, event.decided_by) == ("not in the SXid table", action, decided_by)


def test_sxid_table_is_overridable_and_validated():
    table = SXidTable(HealthSettings(SXidActions={20034: FaultAction.REPLACE, 29999: FaultAction.REBOOT}))
    assert table.decide(20034, "Fatal")[0].name == "LTSSM Fault Up"
    assert table.parse(sxid_line(20034)).action is FaultAction.REPLACE
    assert table.parse(sxid_line(29999, "Non-fatal", "Link 1 x")).action is FaultAction.REBOOT
    settings = validate_mapping({"SXidActions": {12028: "None"}}, HealthSettings, source="cluster.yaml")
    assert settings.SXidActions == {12028: FaultAction.NONE}
    with pytest.raises(ConfigError, match="cluster.yaml: SXidActions.20034: 'Explode' is invalid"):
        validate_mapping({"SXidActions": {20034: "Explode"}}, HealthSettings, source="cluster.yaml")
    with pytest.raises(ConfigError, match="SXidActions.LTSSM"):
        validate_mapping({"SXidActions": {"LTSSM": "Reboot"}}, HealthSettings, source="cluster.yaml")


def test_the_shipped_tables_are_package_data():
    root = Path(__file__).parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["unbroken"]
    shipped = sorted(p.relative_to(root / "src" / "unbroken").as_posix() for p in (root / "src/unbroken/health/data").iterdir())
    assert "health/data/sxid.yaml" in shipped
    assert [p for p in shipped if not any(fnmatch.fnmatch(p, g) for g in globs)] == []


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


def test_kmsg_source_reads_a_record_a_read_from_a_device_that_cannot_seek():
    """A character device that passes kernel records on without the ring buffer (a pseudo-terminal here: what the
    real-node tests bind over each node's /dev/kmsg) cannot seek to "now"; it is read from where it was opened."""
    writer, terminal = os.openpty()
    attributes = termios.tcgetattr(terminal)
    attributes[3] &= ~termios.ECHO
    termios.tcsetattr(terminal, termios.TCSANOW, attributes)
    source = KmsgSource(os.ttyname(terminal))
    try:
        assert source.read() == []
        os.write(writer, b"3,1,100,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.\n"
                         b"6,2,200,-;eth0: link up\n")
        assert source.read() == ["NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.", "eth0: link up"]
    finally:
        source.close()
        os.close(writer)
        os.close(terminal)
