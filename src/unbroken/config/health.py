"""Health settings of a cluster file (``Health:``) and the instance profiles.

Profiles (expected GPU count, throughput floors, busbw floor, RDMA devices) ship
as data in ``config/data/profiles.yaml``; the cluster file may override any
field of a shipped profile or add a new instance type. The Xid table is
configuration too (``health/data/xid.yaml``), overridable per cluster with
``XidActions``; so is the NVSwitch SXid table (``health/data/sxid.yaml``, ``SXidActions``).
"""

from __future__ import annotations

import difflib
from enum import StrEnum
from functools import cache
from importlib import resources
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field


class FaultAction(StrEnum):
    """What a failure asks of the node; ordered from mild to severe."""

    NONE = "None"
    """Event and job restart only (application-level faults: Xid 13, 31, 43...)."""
    REBOOT = "Reboot"
    """A GPU reset / node reboot clears it: -> UnschedulablePendingReboot."""
    REPLACE = "Replace"
    """Hardware that a reboot does not fix: -> UnschedulablePendingReplacement."""

    @property
    def severity(self) -> int:
        return {FaultAction.NONE: 0, FaultAction.REBOOT: 1, FaultAction.REPLACE: 2}[self]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Profile(_Strict):
    """What a healthy instance of one type measures at least."""

    Description: str = ""
    Accelerator: Literal["gpu", "cpu"] = "cpu"
    """gpu: device checks need NVML and the GPUs; stress runs on GPU in bf16."""
    GpuCount: int = Field(default=0, ge=0, le=64)
    MatmulFloor: float = Field(gt=0)
    """Dense matmul throughput floor: TFLOP/s in bf16 on GPU profiles, GFLOP/s in fp32
    on CPU profiles (the units people quote for each). Set well under the peak:
    the check catches a sick device, not a 5 % spread between healthy ones."""
    MemoryBandwidthFloorGBps: float = Field(gt=0)
    """Device (HBM) or host (DRAM) copy bandwidth floor, GB/s (1e9 bytes)."""
    BusBwFloorGBps: float = Field(gt=0)
    """All-reduce busbw floor at the largest size of the join sweep, GB/s, as nccl-tests reports it."""
    RdmaDevices: int = Field(default=0, ge=0)
    """RDMA/EFA devices the instance must show; 0: none expected (the check skips)."""
    RdmaKind: Literal["efa", "infiniband"] | None = None
    MaxGpuTemperatureC: float = 87.0
    """Above this a GPU throttles (H100/A100 slowdown thresholds sit near 87-90 C)."""


class ProfileOverride(_Strict):
    """Any subset of a profile's fields, laid over the shipped profile of that name."""

    Description: str | None = None
    Accelerator: Literal["gpu", "cpu"] | None = None
    GpuCount: int | None = Field(default=None, ge=0, le=64)
    MatmulFloor: float | None = Field(default=None, gt=0)
    MemoryBandwidthFloorGBps: float | None = Field(default=None, gt=0)
    BusBwFloorGBps: float | None = Field(default=None, gt=0)
    RdmaDevices: int | None = Field(default=None, ge=0)
    RdmaKind: Literal["efa", "infiniband"] | None = None
    MaxGpuTemperatureC: float | None = None


class KernelLogSource(StrEnum):
    FILE = "File"
    """The local backend's per-node file ``<dir>/nodes/<node>/kmsg.log`` (what chaos xid appends to)."""
    KMSG = "Kmsg"
    """``/dev/kmsg`` (root): the kernel ring buffer itself, as node-problem-detector reads it."""
    JOURNALD = "Journald"
    """``journalctl -k -f``: kernel messages through systemd's journal."""


class CustomCheck(_Strict):
    """A site's own check, run like the shipped ones: in a child process, under a hard timeout."""

    Id: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]*$")
    Suites: list[Literal["InstanceStress", "InstanceConnectivity", "Continuous"]] = Field(min_length=1)
    Target: str = Field(pattern=r"^[^:]+:[A-Za-z_][A-Za-z0-9_]*$")
    """``package.module:function`` or ``/path/to/file.py:function``; the function takes a
    CheckContext and returns an Outcome (see ``unbroken.health.result``)."""
    TimeoutSeconds: float = Field(default=60.0, gt=0)
    Description: str = ""


class HealthSettings(_Strict):
    """The cluster file's ``Health:`` section; every field has a working default."""

    Profiles: dict[str, ProfileOverride] = Field(default_factory=dict)
    """Override fields of shipped profiles, or define new instance types (then every required field)."""
    XidActions: dict[int, FaultAction] = Field(default_factory=dict)
    """Xid code -> None | Reboot | Replace, over the shipped table (NVIDIA's Xid catalogue).
    For Xid 154 an entry here wins over the recovery action named in the line."""
    SXidActions: dict[int, FaultAction] = Field(default_factory=dict)
    """NVSwitch SXid code -> None | Reboot | Replace, over the shipped table (the Fabric Manager
    guide's SXid list). A code in neither follows the line's severity word: ``Fatal`` is Reboot,
    because a fatal NVSwitch error is recovered by resetting the switch and its GPUs, which on a
    bare node means a reboot; ``Non-fatal`` is an event, because the switch corrected it or only
    throughput suffers, and taking the node out for that would cost more than it saves."""
    ConditionActions: dict[str, FaultAction] = Field(default_factory=dict)
    """NPD condition type -> action for ``permanent`` rules (default Reboot: a deadlocked
    kernel or a read-only root filesystem is what a reboot is for). ``temporary`` rules
    only raise an event, as in node-problem-detector."""
    KernelLogSource: KernelLogSource = KernelLogSource.FILE
    RuleFiles: list[str] = Field(default_factory=list)
    """Extra node-problem-detector rule files (their JSON format, unchanged); permanent rules take the node out."""
    MonitorIntervalSeconds: float = Field(default=30.0, gt=0)
    """How often Continuous checks re-run on a Schedulable node. Kernel-log rules
    are not polled on this clock: they fire within a fraction of a second."""
    CustomChecks: list[CustomCheck] = Field(default_factory=list)
    CheckTimeouts: dict[str, float] = Field(default_factory=dict)
    """Per-check timeout overrides in seconds, by catalogue id."""
    StorageFreeFloorGiB: float = Field(default=1.0, ge=0)
    """The storage check fails below this much free space on the checkpoint filesystem."""
    CollectiveRetries: int = Field(default=1, ge=0, le=5)
    """A collective sweep below its floor is re-run this many times before it fails:
    one slow run on a shared network is noise, two in a row is a link."""


@cache
def shipped_profiles() -> dict[str, Profile]:
    text = resources.files("unbroken.config").joinpath("data/profiles.yaml").read_text()
    data: dict[str, Any] = yaml.safe_load(text)
    return {name: Profile.model_validate(fields) for name, fields in data.items()}


def profile_names(settings: HealthSettings) -> list[str]:
    return sorted({*shipped_profiles(), *settings.Profiles})


def resolve_profile(settings: HealthSettings, instance_type: str) -> Profile:
    """The shipped profile with the cluster's overrides laid over it; ValueError if unknown.

    HyperPod spells instance types ``ml.p5.48xlarge``: the ``ml.`` prefix is
    ignored so that its cluster files load unchanged.
    """
    bare = instance_type.removeprefix("ml.")
    shipped = shipped_profiles().get(bare)
    override = settings.Profiles.get(instance_type) or settings.Profiles.get(bare)
    if shipped is None and override is None:
        known = profile_names(settings)
        close = difflib.get_close_matches(instance_type, known, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ValueError(f"no health profile for instance type '{instance_type}'; {hint}known: {', '.join(known)} "
                         "(or define it under Health.Profiles)")
    fields = shipped.model_dump() if shipped else {}
    if override is not None:
        fields.update(override.model_dump(exclude_none=True))
    return Profile.model_validate(fields)
