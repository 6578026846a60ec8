"""The node's GPUs as dcgm-exporter shows them: NVML's readings under DCGM's metric names and labels.

So the GPU dashboards people already have (Grafana's DCGM dashboard, the HyperPod
observability add-on's) work against unbroken's agent on nodes without
dcgm-exporter. Where dcgm-exporter runs, turn this off (``Metrics.GpuMetrics: false``).
Without an NVIDIA driver there is nothing to read and no series is exported.

Xid errors are not something NVML reports by polling; the agent sees them in the
kernel log and this collector shows the last one per GPU (``DCGM_FI_DEV_XID_ERRORS``),
as dcgm-exporter does.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterable
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_LABELS = ["gpu", "UUID", "device", "modelName", "Hostname", "pci_bus_id"]
_GAUGES = {
    "DCGM_FI_DEV_GPU_UTIL": "GPU utilization (in %).",
    "DCGM_FI_DEV_FB_USED": "Framebuffer memory used (in MiB).",
    "DCGM_FI_DEV_FB_FREE": "Framebuffer memory free (in MiB).",
    "DCGM_FI_DEV_GPU_TEMP": "GPU temperature (in C).",
    "DCGM_FI_DEV_POWER_USAGE": "Power draw (in W).",
    "DCGM_FI_DEV_XID_ERRORS": "Value of the last XID error encountered.",
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": "Total number of single-bit volatile ECC errors.",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": "Total number of double-bit volatile ECC errors.",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": "Number of remapped rows for correctable errors.",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": "Number of remapped rows for uncorrectable errors.",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": "Whether remapping of rows has failed.",
}


class GpuCollector(Collector):
    def __init__(self, node: str, last_xid: dict[str, int] | None = None, nvml: Any | None = None) -> None:
        self.hostname = node or socket.gethostname()
        self.last_xid = last_xid if last_xid is not None else {}
        """PCI bus id (as the kernel log writes it) -> the last Xid code seen on it (the agent's monitor fills it)."""
        self._nvml = nvml
        self._ready: bool | None = None if nvml is None else True
        self._lock = threading.Lock()

    def collect(self) -> Iterable[Metric]:
        nvml = self._load()
        if nvml is None:
            return
        families = {name: GaugeMetricFamily(name, text, labels=_LABELS) for name, text in _GAUGES.items()}
        with self._lock:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                pci = _text(_read(nvml.nvmlDeviceGetPciInfo, handle, attribute="busId")) or ""
                labels = [str(index), _text(_read(nvml.nvmlDeviceGetUUID, handle)) or "", f"nvidia{index}",
                          _text(_read(nvml.nvmlDeviceGetName, handle)) or "", self.hostname, pci]
                for name, value in self._readings(nvml, handle).items():
                    if value is not None:
                        families[name].add_metric(labels, float(value))
                xids = {_bus(bus): code for bus, code in self.last_xid.items()}
                families["DCGM_FI_DEV_XID_ERRORS"].add_metric(labels, float(xids.get(_bus(pci), 0)))
        yield from families.values()

    def _readings(self, nvml: Any, handle: Any) -> dict[str, float | None]:
        util = _read(nvml.nvmlDeviceGetUtilizationRates, handle, attribute="gpu")
        used = _read(nvml.nvmlDeviceGetMemoryInfo, handle, attribute="used")
        free = _read(nvml.nvmlDeviceGetMemoryInfo, handle, attribute="free")
        power = _read(nvml.nvmlDeviceGetPowerUsage, handle)
        rows = _read(nvml.nvmlDeviceGetRemappedRows, handle)
        ecc = getattr(nvml, "NVML_VOLATILE_ECC", 0)
        return {
            "DCGM_FI_DEV_GPU_UTIL": util,
            "DCGM_FI_DEV_FB_USED": used / 2**20 if used is not None else None,
            "DCGM_FI_DEV_FB_FREE": free / 2**20 if free is not None else None,
            "DCGM_FI_DEV_GPU_TEMP": _read(nvml.nvmlDeviceGetTemperature, handle, getattr(nvml, "NVML_TEMPERATURE_GPU", 0)),
            "DCGM_FI_DEV_POWER_USAGE": power / 1000 if power is not None else None,
            "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": _read(nvml.nvmlDeviceGetTotalEccErrors, handle,
                                                    getattr(nvml, "NVML_MEMORY_ERROR_TYPE_CORRECTED", 0), ecc),
            "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": _read(nvml.nvmlDeviceGetTotalEccErrors, handle,
                                                    getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1), ecc),
            "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": rows[0] if rows else None,
            "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": rows[1] if rows else None,
            "DCGM_FI_DEV_ROW_REMAP_FAILURE": rows[3] if rows else None,
        }

    def _load(self) -> Any | None:
        """NVML, initialised once; None where there is no driver (nothing to export)."""
        if self._ready is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml, self._ready = pynvml, True
            except Exception:  # noqa: BLE001 - no driver, no library, no GPU: the node simply has no GPU series
                self._ready = False
        return self._nvml if self._ready else None


def _read(call: Any, handle: Any, *args: Any, attribute: str | None = None) -> Any:
    """One NVML reading; None where this GPU or driver does not support it."""
    try:
        value = call(handle, *args)
    except Exception:  # noqa: BLE001 - NVMLError_NotSupported and friends: the series is simply absent
        return None
    return getattr(value, attribute) if attribute else value


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def _bus(pci: str) -> str:
    """``PCI:0000:b9:00`` (kernel log) and ``00000000:B9:00.0`` (NVML) name one bus: compare by bus and device."""
    digits = pci.upper().removeprefix("PCI:").split(":")
    return ":".join(part.split(".")[0][-2:] for part in digits[-2:])
