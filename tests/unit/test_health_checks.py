"""Checks run for real in child processes: timeouts are enforced, failures are failures, GPUs are asked for."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from unbroken.config.cluster import ClusterConfig
from unbroken.config.health import HealthSettings
from unbroken.config.loading import validate_mapping
from unbroken.errors import ConfigError
from unbroken.health import catalogue, runner
from unbroken.health.catalogue import CheckSpec
from unbroken.health.context import CheckContext
from unbroken.health.result import FaultAction, Status, Suite

HANG = '''
import time
def hang(ctx):
    time.sleep(3600)

def crash(ctx):
    import os
    os._exit(3)

def boom(ctx):
    raise RuntimeError("sensor unreadable")
'''


def ctx_for(tmp_path: Path, instance_type: str = "cpu-dev", **health) -> CheckContext:
    cluster = ClusterConfig.model_validate({"ClusterName": "t", "Health": health,
                                            "InstanceGroups": [{"InstanceGroupName": "g", "InstanceCount": 1, "InstanceType": instance_type}]})
    return CheckContext(node="node-1", instance_type=instance_type, profile=cluster.profile(instance_type), settings=cluster.Health,
                        node_dir=tmp_path, cluster_dir=tmp_path, params={"matmul_n": 256})


def custom(tmp_path: Path, name: str) -> CheckSpec:
    path = tmp_path / "site_checks.py"
    path.write_text(HANG)
    return CheckSpec(f"site.{name}", frozenset({Suite.CONTINUOUS}), 60, f"{path}:{name}", name)


def test_a_hung_check_fails_with_timeout_within_its_timeout_and_leaves_no_process(tmp_path):
    started = time.monotonic()
    result = runner.run_check(custom(tmp_path, "hang"), ctx_for(tmp_path), timeout=1.5)
    took = time.monotonic() - started
    assert (result.status, result.reason) == (Status.FAIL, "Timeout")
    assert "did not finish within its timeout of 1.5 s" in result.message
    assert 1.5 <= took < 3.0, took
    assert runner.alive_children() == 0


def test_crashing_and_raising_checks_fail_instead_of_passing(tmp_path):
    crashed = runner.run_check(custom(tmp_path, "crash"), ctx_for(tmp_path))
    assert (crashed.status, crashed.reason) == (Status.FAIL, "Crashed") and "exit code 3" in crashed.message
    raised = runner.run_check(custom(tmp_path, "boom"), ctx_for(tmp_path))
    assert (raised.status, raised.reason) == (Status.FAIL, "Error")
    assert raised.message == "check raised RuntimeError: sensor unreadable"


def test_device_checks_skip_on_cpu_dev_and_fail_clearly_on_a_gpu_profile(tmp_path):
    pytest.importorskip("pynvml")
    for check in ("devices.inventory", "devices.errors"):
        cpu = runner.run_check(catalogue.get(check), ctx_for(tmp_path))
        assert cpu.status is Status.SKIP and "expects no GPUs" in cpu.message, cpu
        gpu = runner.run_check(catalogue.get(check), ctx_for(tmp_path, "p5.48xlarge"))
        if gpu.status is Status.PASS:
            pytest.skip("this machine has the 8 GPUs of a p5.48xlarge")
        assert gpu.status is Status.FAIL and gpu.action is FaultAction.REPLACE
        assert gpu.message.startswith("profile p5.48xlarge expects 8 GPUs but"), gpu.message


def test_stress_checks_measure_and_compare_with_the_profile_floor(tmp_path):
    matmul = runner.run_check(catalogue.get("stress.matmul"), ctx_for(tmp_path))
    assert matmul.status is Status.PASS and matmul.metrics["unit"] == "GFLOP/s" and matmul.metrics["min"] > 2
    membw = runner.run_check(catalogue.get("stress.membw"), ctx_for(tmp_path))
    assert membw.status is Status.PASS and membw.metrics["min"] > 0.5
    # a floor no CPU reaches: the same measurement must now fail, naming both numbers
    strict = ctx_for(tmp_path, Profiles={"cpu-dev": {"MatmulFloor": 1e9}})
    slow = runner.run_check(catalogue.get("stress.matmul"), strict)
    assert (slow.status, slow.reason) == (Status.FAIL, "BelowThreshold")
    assert "expected >= 1e+09 GFLOP/s, measured" in slow.message


def test_storage_check_writes_reads_back_and_fails_on_an_unusable_path(tmp_path):
    ok = runner.run_check(catalogue.get("storage.checkpoint"), ctx_for(tmp_path))
    assert ok.status is Status.PASS and ok.metrics["write_MBps"] > 0 and not list((tmp_path / "checkpoints").iterdir())
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    ctx = ctx_for(tmp_path)
    bad = CheckContext(**{**ctx.__dict__, "storage_dir": blocker / "ckpt"})
    failed = runner.run_check(catalogue.get("storage.checkpoint"), bad)
    assert (failed.status, failed.reason) == (Status.FAIL, "NotWritable") and "not writable" in failed.message
    full = runner.run_check(catalogue.get("storage.checkpoint"), ctx_for(tmp_path, StorageFreeFloorGiB=1e9))
    assert (full.status, full.reason, full.action) == (Status.FAIL, "LowFreeSpace", FaultAction.NONE)


def test_rdma_check_skips_without_expectation_and_fails_when_devices_are_missing(tmp_path):
    assert runner.run_check(catalogue.get("network.rdma"), ctx_for(tmp_path)).status is Status.SKIP
    p4d = runner.run_check(catalogue.get("network.rdma"), ctx_for(tmp_path, "p4d.24xlarge"))
    if Path("/sys/class/infiniband").is_dir():
        pytest.skip("this machine has RDMA devices")
    assert p4d.status is Status.FAIL and "profile p4d.24xlarge expects 4" in p4d.message


def test_profiles_ship_as_data_and_the_cluster_file_overrides_them():
    config = ClusterConfig.model_validate({"ClusterName": "t", "InstanceGroups": [
        {"InstanceGroupName": "g", "InstanceCount": 1, "InstanceType": "ml.p5.48xlarge"}],
        "Health": {"Profiles": {"p5.48xlarge": {"BusBwFloorGBps": 120}}}})
    profile = config.profile("ml.p5.48xlarge")
    assert (profile.GpuCount, profile.BusBwFloorGBps, profile.RdmaKind) == (8, 120, "efa")
    assert {"p5.48xlarge", "p4d.24xlarge", "g5.12xlarge", "cpu-dev"} <= set(catalogue_profiles())


def catalogue_profiles() -> list[str]:
    from unbroken.config.health import profile_names

    return profile_names(HealthSettings())


def test_unknown_instance_types_and_incomplete_new_profiles_are_one_line_errors():
    data = {"ClusterName": "t", "InstanceGroups": [{"InstanceGroupName": "g", "InstanceCount": 1, "InstanceType": "p5.48xlarg"}]}
    with pytest.raises(ConfigError) as err:
        validate_mapping(data, ClusterConfig, source="cluster.yaml")
    assert str(err.value).startswith("cluster.yaml: InstanceGroups.0.InstanceType: no health profile for instance type "
                                     "'p5.48xlarg'; did you mean 'p5.48xlarge'?")
    data["InstanceGroups"][0]["InstanceType"] = "my-box"
    data["Health"] = {"Profiles": {"my-box": {"GpuCount": 2}}}
    with pytest.raises(ConfigError, match="MatmulFloor"):
        validate_mapping(data, ClusterConfig, source="cluster.yaml")
    data["Health"] = {"Profiles": {"my-box": {"MatmulFloor": 5, "MemoryBandwidthFloorGBps": 1, "BusBwFloorGBps": 0.1}},
                      "XidActions": {79: "Reboot"}}
    assert validate_mapping(data, ClusterConfig, source="cluster.yaml").profile("my-box").MatmulFloor == 5
    data["Health"] = {"XidActions": {79: "Explode"}}
    with pytest.raises(ConfigError, match="Health.XidActions.79: 'Explode' is invalid"):
        validate_mapping(data, ClusterConfig, source="cluster.yaml")


class _HealthyNvml:
    """Stands in for NVML (the driver's library, not ours): one healthy GPU whose recovery action field
    says what the test sets. Only the calls the device check makes."""

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, NVML_TEMPERATURE_GPU, NVML_SUCCESS = 1, 0, 0, 0
    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 263

    def __init__(self, recovery_action: int) -> None:
        self.recovery_action = recovery_action

    def nvmlDeviceGetTotalEccErrors(self, *args):  # noqa: N802 - NVML's names
        return 0

    def nvmlDeviceGetRemappedRows(self, handle):  # noqa: N802
        return (0, 0, 0, 0)

    def nvmlDeviceGetTemperature(self, *args):  # noqa: N802
        return 40

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):  # noqa: N802
        return 0

    def nvmlDeviceGetFieldValues(self, handle, fields):  # noqa: N802
        from types import SimpleNamespace

        return [SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(uiVal=self.recovery_action))]


@pytest.mark.parametrize("code, status, action", [
    (0, "Pass", "None"), (1, "Fail", "Reboot"), (2, "Fail", "Reboot"), (3, "Fail", "Reboot"), (4, "Fail", "Reboot"),
])
def test_the_drivers_recovery_action_field_and_an_xid_154_line_are_judged_by_one_table(tmp_path, code, status, action):
    from unbroken.config.health import FaultAction
    from unbroken.health.checks.devices import _gpu_errors
    from unbroken.health.checks.findings import Findings
    from unbroken.health.kernel_log.xid import XidTable

    found = Findings("ok")
    _gpu_errors(_HealthyNvml(code), 0, object(), ctx_for(tmp_path, "p5.48xlarge"), found)
    outcome = found.outcome()
    assert (outcome.status.value, outcome.action.value) == (status, action if status == "Fail" else "None")
    names = {0: "None", 1: "GPU Reset Required", 2: "Node Reboot Required", 3: "Drain P2P", 4: "Drain and Reset"}
    line = f"NVRM: Xid (PCI:0000:b9:00): 154, GPU recovery action changed from 0x0 (None) to 0x{code} ({names[code]})"
    event = XidTable().parse(line)
    assert event is not None and event.action is FaultAction(action), "the kernel-log path agrees"
