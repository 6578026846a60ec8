"""Every check unbroken knows: id, suites, timeout, and the function that runs it.

The catalogue is a table, not a registry that modules fill in as a side effect
of being imported: what runs is visible here. A cluster file may add its own
checks (``Health.CustomChecks``) with the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from unbroken.config.health import HealthSettings
from unbroken.errors import ConfigError, UsageError
from unbroken.health.result import Suite

_STRESS, _CONNECT, _CONT = Suite.INSTANCE_STRESS, Suite.INSTANCE_CONNECTIVITY, Suite.CONTINUOUS


@dataclass(frozen=True)
class CheckSpec:
    id: str
    suites: frozenset[Suite]
    timeout_s: float
    target: str
    """``package.module:function`` or ``/path/to/file.py:function``, run in a child process."""
    description: str


CATALOGUE: tuple[CheckSpec, ...] = (
    CheckSpec("devices.inventory", frozenset({_STRESS, _CONT}), 30.0, "unbroken.health.checks.devices:inventory",
              "NVML: GPU count vs the profile, persistence mode, PCIe link generation and width vs their max"),
    CheckSpec("devices.errors", frozenset({_STRESS, _CONT}), 30.0, "unbroken.health.checks.devices:errors",
              "NVML: uncorrectable ECC, remapped-row failures, retired pages, temperature and throttle reasons, "
              "the driver's recovery action"),
    CheckSpec("stress.matmul", frozenset({_STRESS}), 120.0, "unbroken.health.checks.stress:matmul",
              "dense matmul throughput (GPU: bf16 TFLOP/s, CPU: fp32 GFLOP/s) vs the profile's floor"),
    CheckSpec("stress.membw", frozenset({_STRESS}), 120.0, "unbroken.health.checks.stress:membw",
              "memory copy bandwidth (GPU: HBM, CPU: DRAM) in GB/s vs the profile's floor"),
    CheckSpec("stress.known_answer", frozenset({_STRESS}), 120.0, "unbroken.health.checks.known_answer:known_answer",
              "exact integer matmuls (float32; bf16 inputs with float32 accumulation) on every device vs the exact answer "
              "computed in int64: a device that computes wrong numbers without an error (silent data corruption)"),
    CheckSpec("storage.checkpoint", frozenset({_STRESS, _CONT}), 60.0, "unbroken.health.checks.storage:checkpoint",
              "the checkpoint filesystem: write, fsync, read back, free space floor, write throughput"),
    CheckSpec("network.rdma", frozenset({_CONNECT, _CONT}), 30.0, "unbroken.health.checks.network:rdma",
              "RDMA/EFA devices the profile expects are present and their ports ACTIVE"),
    CheckSpec("collective.allreduce", frozenset({_CONNECT}), 240.0, "unbroken.health.collective.check:allreduce",
              "all-reduce busbw sweep across the checked nodes (NCCL on GPU, gloo on CPU) vs the profile's floor; "
              "names the slow node"),
)


def all_checks(settings: HealthSettings | None = None) -> list[CheckSpec]:
    custom = [
        CheckSpec(c.Id, frozenset(Suite(s) for s in c.Suites), c.TimeoutSeconds, c.Target, c.Description or "custom check")
        for c in (settings.CustomChecks if settings else [])
    ]
    return [*CATALOGUE, *custom]


def get(check_id: str, settings: HealthSettings | None = None) -> CheckSpec:
    for spec in all_checks(settings):
        if spec.id == check_id:
            return spec
    known = ", ".join(s.id for s in all_checks(settings))
    raise UsageError(f"no health check '{check_id}'; known: {known}")


def for_suite(suite: Suite, settings: HealthSettings | None = None) -> list[CheckSpec]:
    return [spec for spec in all_checks(settings) if suite in spec.suites]


def timeout_for(spec: CheckSpec, settings: HealthSettings | None) -> float:
    if settings and spec.id in settings.CheckTimeouts:
        return settings.CheckTimeouts[spec.id]
    return spec.timeout_s


def parse_suite(text: str) -> Suite:
    try:
        return Suite(text)
    except ValueError:
        raise ConfigError(f"unknown suite '{text}'; valid: {', '.join(s.value for s in Suite)}") from None
