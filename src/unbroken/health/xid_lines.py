"""Kernel-log lines as the NVIDIA driver writes them, for ``unbroken chaos xid`` and the tests."""

from __future__ import annotations

from datetime import datetime

from unbroken.health.kernel_log.xid import XidTable

_DETAIL = {
    79: "pid=0, GPU has fallen off the bus.",
    48: "pid=2417, DBE (0x1) detected at 0x12d4c0.",
    13: "pid=2417, name=python, Graphics Exception: ESR 0x405840=0x1000000b",
    94: "pid=2417, Contained: CE User Channel (0x9). RST: No, D-RST: No",
    154: "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
}


def xid_line(code: int, pci: str = "PCI:0000:b9:00", detail: str | None = None) -> str:
    """A kernel line as the NVIDIA driver writes it (``dmesg -T`` style timestamp)."""
    stamp = datetime.now().strftime("%a %b %d %H:%M:%S %Y")
    text = detail or _DETAIL.get(code) or f"pid=0, {XidTable().lookup(code).name}"
    return f"[{stamp}] NVRM: Xid ({pci}): {code}, {text}"


def sxid_line(code: int, severity: str = "Fatal", detail: str = "Link 30 LTSSM Fault Up",
              pci: str = "PCI:0000:08:00.0", switch: str = "nvidia-nvswitch3") -> str:
    """An NVSwitch line as the driver writes it: ``nvidia-nvswitch3: SXid (PCI:...): 20034, Fatal, ...``."""
    stamp = datetime.now().strftime("%a %b %d %H:%M:%S %Y")
    return f"[{stamp}] {switch}: SXid ({pci}): {code:05d}, {severity}, {detail}"
