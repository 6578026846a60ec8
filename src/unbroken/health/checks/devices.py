"""GPU device checks through NVML (``nvidia-ml-py``).

No driver or no GPU: ``Skip`` on a CPU profile, ``Fail`` on a GPU profile with
the reason NVML gave. Every NVML query a driver may not support
(``NotSupported``) is left out of the verdict rather than guessed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from unbroken.health.checks.findings import Findings
from unbroken.health.context import CheckContext
from unbroken.health.kernel_log.xid import recovery_actions
from unbroken.health.result import FaultAction, Outcome, Status, skip

T = TypeVar("T")

RETIRED_PAGES_REPLACE = 60
"""NVIDIA's dynamic page retirement guidance: a board with this many retired pages is RMA'd."""



class NoDevices(Exception):
    pass


@contextmanager
def nvml_session(ctx: CheckContext) -> Iterator[Any]:
    """Yield the pynvml module after nvmlInit; raise NoDevices with NVML's reason otherwise."""
    try:
        import pynvml
    except ImportError as exc:
        raise NoDevices(f"nvidia-ml-py is not installed ({exc})") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NoDevices(f"NVML unavailable: {exc} (is the NVIDIA driver installed and loaded?)") from None
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


def _no_devices(ctx: CheckContext, why: str) -> Outcome:
    expected = ctx.profile.GpuCount
    if ctx.profile.Accelerator == "cpu" or expected == 0:
        return skip(f"no GPU checks on profile {ctx.instance_type} (it expects no GPUs): {why}", "NoGPU")
    return Outcome(Status.FAIL, f"profile {ctx.instance_type} expects {expected} GPUs but {why}", "NoDriver",
                   {"gpus_expected": expected, "gpus_found": 0}, FaultAction.REPLACE)


def _query(call: Callable[..., T], *args: Any) -> T | None:
    """NVML value, or None where this GPU/driver does not support the query."""
    import pynvml

    try:
        return call(*args)
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound, pynvml.NVMLError_InvalidArgument):
        return None


def inventory(ctx: CheckContext) -> Outcome:
    try:
        with nvml_session(ctx) as nvml:
            count = nvml.nvmlDeviceGetCount()
            if count == 0:
                return _no_devices(ctx, "NVML sees no GPU")
            found = Findings(f"{count} GPUs, persistence on, PCIe links at full width", {"gpus_found": count})
            expected = ctx.profile.GpuCount
            found.metrics["gpus_expected"] = expected
            if ctx.profile.Accelerator == "gpu" and count != expected:
                found.fail(f"{count} GPUs visible, profile {ctx.instance_type} expects {expected}", "GpuCountMismatch")
            for i in range(count):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                persistence = _query(nvml.nvmlDeviceGetPersistenceMode, handle)
                if persistence == nvml.NVML_FEATURE_DISABLED:
                    found.warn(f"GPU {i}: persistence mode off (driver reloads between jobs; set it with nvidia-smi -pm 1)",
                               "PersistenceModeOff")
                width, max_width = _query(nvml.nvmlDeviceGetCurrPcieLinkWidth, handle), _query(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle)
                gen, max_gen = _query(nvml.nvmlDeviceGetCurrPcieLinkGeneration, handle), _query(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle)
                found.metrics[f"gpu{i}_pcie"] = {"gen": gen, "max_gen": max_gen, "width": width, "max_width": max_width}
                if width is not None and max_width is not None and width < max_width:
                    found.fail(f"GPU {i}: PCIe link x{width}, capable of x{max_width} (link trained down)",
                               "PcieLinkDegraded", FaultAction.REBOOT)
                if gen is not None and max_gen is not None and gen < max_gen:
                    # An idle GPU lowers its link speed to save power; only width is a fault.
                    found.metrics[f"gpu{i}_pcie"]["note"] = "generation below max (normal at idle)"
            return found.outcome()
    except NoDevices as exc:
        return _no_devices(ctx, str(exc))


def errors(ctx: CheckContext) -> Outcome:
    try:
        with nvml_session(ctx) as nvml:
            count = nvml.nvmlDeviceGetCount()
            if count == 0:
                return _no_devices(ctx, "NVML sees no GPU")
            found = Findings(f"{count} GPUs: no uncorrectable ECC, no row-remap failure, temperatures normal", {})
            for i in range(count):
                _gpu_errors(nvml, i, nvml.nvmlDeviceGetHandleByIndex(i), ctx, found)
            return found.outcome()
    except NoDevices as exc:
        return _no_devices(ctx, str(exc))


def _gpu_errors(nvml: Any, i: int, handle: Any, ctx: CheckContext, found: Findings) -> None:
    metrics: dict[str, Any] = {}
    ecc = _query(nvml.nvmlDeviceGetTotalEccErrors, handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
    metrics["ecc_uncorrected_volatile"] = ecc
    if ecc:
        found.fail(f"GPU {i}: {ecc} uncorrectable ECC errors since the driver loaded", "EccUncorrectable", FaultAction.REBOOT)
    rows = _query(nvml.nvmlDeviceGetRemappedRows, handle)
    if rows is not None:
        corrected, uncorrected, pending, failure = rows
        metrics["remapped_rows"] = {"corrected": corrected, "uncorrected": uncorrected, "pending": bool(pending),
                                    "failure": bool(failure)}
        if failure:
            found.fail(f"GPU {i}: row remapping failed (no spare rows left)", "RowRemapFailure", FaultAction.REPLACE)
        elif pending:
            found.fail(f"GPU {i}: row remapping pending; a GPU reset applies it", "RowRemapPending", FaultAction.REBOOT)
    else:  # pre-Ampere GPUs retire pages instead of remapping rows
        dbe = _query(nvml.nvmlDeviceGetRetiredPages, handle, nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        sbe = _query(nvml.nvmlDeviceGetRetiredPages, handle, nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
        pending_pages = _query(nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
        retired = len(dbe or []) + len(sbe or [])
        metrics["retired_pages"] = retired
        if retired >= RETIRED_PAGES_REPLACE:
            found.fail(f"GPU {i}: {retired} retired pages (>= {RETIRED_PAGES_REPLACE})", "RetiredPages", FaultAction.REPLACE)
        elif pending_pages == nvml.NVML_FEATURE_ENABLED:
            found.fail(f"GPU {i}: page retirement pending; a GPU reset applies it", "RetiredPagesPending", FaultAction.REBOOT)
    temperature = _query(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
    metrics["temperature_c"] = temperature
    if temperature is not None and temperature > ctx.profile.MaxGpuTemperatureC:
        found.warn(f"GPU {i}: {temperature} C, above {ctx.profile.MaxGpuTemperatureC:g} C", "HighTemperature")
    # The newer name first; the older one only where the bindings predate it (getattr's default would be looked up either way).
    clock_reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    reasons = _query(clock_reasons, handle)
    if reasons is not None:
        metrics["throttle_reasons"] = hex(reasons)
        named = {0x8: "hardware slowdown", 0x40: "hardware thermal slowdown", 0x80: "hardware power brake", 0x20: "software thermal slowdown"}
        active = [name for bit, name in named.items() if reasons & bit]
        if active:
            found.warn(f"GPU {i}: clocks throttled: {', '.join(active)}", "Throttled")
    code = _recovery_action(nvml, handle)
    # One table decides, for this field and for Xid 154 lines alike (health/data/xid.yaml, RecoveryActions).
    action = recovery_actions().get(code) if code is not None else None
    metrics["recovery_action"] = action.name if action else code
    if action is not None and action.action is not FaultAction.NONE:
        found.fail(f"GPU {i}: the driver asks for {action.name}", "DriverRecoveryAction", action.action)
    found.metrics[f"gpu{i}"] = metrics


def _recovery_action(nvml: Any, handle: Any) -> int | None:
    """NVML's GPU recovery action field (R575+ drivers); None where the driver lacks it."""
    field_id = getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
    if field_id is None:
        return None
    values = _query(nvml.nvmlDeviceGetFieldValues, handle, [field_id])
    if not values or values[0].nvmlReturn != nvml.NVML_SUCCESS:
        return None
    return int(values[0].value.uiVal)
