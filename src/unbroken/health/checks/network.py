"""RDMA/EFA devices the profile expects: present (``/sys/class/infiniband``, ``fi_info -p efa``) and ports ACTIVE."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from unbroken.health.checks.findings import Findings
from unbroken.health.context import CheckContext
from unbroken.health.result import FaultAction, Outcome, skip

SYSFS = Path("/sys/class/infiniband")


def port_states(root: Path = SYSFS) -> dict[str, str]:
    """``{"mlx5_0/1": "4: ACTIVE", ...}`` for every RDMA port the kernel shows."""
    states: dict[str, str] = {}
    if not root.is_dir():
        return states
    for device in sorted(root.iterdir()):
        for port in sorted((device / "ports").glob("*")):
            try:
                states[f"{device.name}/{port.name}"] = (port / "state").read_text().strip()
            except OSError:
                states[f"{device.name}/{port.name}"] = "unreadable"
    return states


def efa_domains() -> int | None:
    """EFA domains libfabric sees, or None where ``fi_info`` is not installed."""
    if shutil.which("fi_info") is None:
        return None
    result = subprocess.run(["fi_info", "-p", "efa", "-t", "FI_EP_RDM"], capture_output=True, text=True, timeout=20)
    return sum(1 for line in result.stdout.splitlines() if line.strip().startswith("domain:"))


def rdma(ctx: CheckContext, root: Path = SYSFS) -> Outcome:
    expected = ctx.profile.RdmaDevices
    if expected == 0:
        return skip(f"profile {ctx.instance_type} expects no RDMA devices")
    states = port_states(root)
    devices = sorted({key.split("/")[0] for key in states})
    found = Findings(f"{len(devices)} RDMA devices, all ports ACTIVE", {"expected": expected, "devices": devices, "ports": states})
    if len(devices) < expected:
        found.fail(f"{len(devices)} RDMA devices under {root}, profile {ctx.instance_type} expects {expected}",
                   "RdmaDevicesMissing", FaultAction.REPLACE)
    down = [key for key, state in states.items() if "ACTIVE" not in state]
    if down:
        found.fail(f"RDMA ports not ACTIVE: {', '.join(f'{k} ({states[k]})' for k in down)}", "RdmaLinkDown", FaultAction.REBOOT)
    if ctx.profile.RdmaKind == "efa":
        domains = efa_domains()
        found.metrics["efa_domains"] = domains
        if domains is not None and domains < expected:
            found.fail(f"fi_info -p efa shows {domains} EFA domains, expected {expected}", "EfaMissing", FaultAction.REPLACE)
    return found.outcome()
