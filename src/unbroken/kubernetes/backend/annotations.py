"""A workload's ``unbroken.dev/*`` annotations: what they switch on, validated.

HyperPod's pair, under unbroken's prefix::

    unbroken.dev/enable-job-auto-resume: "true"
    unbroken.dev/job-max-retry-count: "3"
    unbroken.dev/hang-timeout-seconds: "300"          # optional
    unbroken.dev/require-deep-health-passed: "true"   # optional, default false
    unbroken.dev/startup-timeout-seconds: "600"       # optional: no first step this long after the container started
    unbroken.dev/checkpoint-tiers: '{"memory": {"every_steps": 10, "replicas": 1}}'   # optional: the job's TierPolicy
    unbroken.dev/spare-pods: "1"                      # optional: pods under `unbroken run --spare-pods 1`

A job without ``enable-job-auto-resume: "true"`` is not unbroken's: it is never
read further, never patched, never restarted. A bad value is an
:class:`AnnotationError` naming the annotation, the value and what is valid;
the operator turns it into a Warning Event and leaves the job alone.

Both directions live here, side by side: ``write`` (a JobSpec as annotations, what ``unbroken k8s
render`` and ``job start`` put on a workload), ``parse`` (annotations as ``AutoResume``) and
``job_spec`` (``AutoResume`` and the workload's size as the JobSpec the reconcilers read); a
round-trip test holds them together (tests/unit/test_job_annotations.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import ValidationError

from unbroken.config.checkpoint import TierPolicy
from unbroken.config.job import STARTUP_TIMEOUT_FALLBACK_S, STRAGGLER_RESTART_COST_S, JobSpec, ResilienceSpec, RestartPolicy, StragglerPolicy
from unbroken.errors import ConfigError
from unbroken.kubernetes.backend import names

NO_STARTUP_TIMEOUT = 10.0 ** 9
"""A job without ``startup-timeout-seconds`` is never timed out before its first step (its ranks may not report progress)."""
_TRUE = {"true", "True", "TRUE", "1", "yes"}
_FALSE = {"false", "False", "FALSE", "0", "no"}
MAX_RETRY_LIMIT = 1000


class AnnotationError(ConfigError):
    """One or more ``unbroken.dev/*`` annotations of a job do not parse."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class AutoResume:
    max_retry: int
    hang_timeout: float | None = None
    """None: set from the ranks' step times (ranks without ``unbroken.init()`` report none: no hang detection)."""
    straggler_policy: StragglerPolicy = StragglerPolicy.REPORT
    straggler_restart_cost: float = STRAGGLER_RESTART_COST_S
    require_deep_health_passed: bool = False
    startup_timeout: float | None = None
    """None: a rank that never reports its first step is not timed out (only its exit is seen).
    Counted from the container's start, so an image pull does not use it up."""
    checkpoint_tiers: TierPolicy | None = None
    """The tiered checkpoint the ranks use (their ``UNBROKEN_CHECKPOINT_TIERS``); the node agents
    keep the memory tier's replicas and drains by it. None: the job checkpoints to files only."""
    spare_pods: int = 0
    """Of the job's pods, how many stand by under ``unbroken run --spare-pods`` to take a lost pod's place."""


def write(spec: JobSpec, *, deep_health: bool, spare_pods: int) -> dict[str, str]:
    """``spec``'s resilience as annotations (the inverse of ``parse``). ``spare_pods``: pods past the job's size
    standing by under ``unbroken run``; an elastic job's come from its elasticPolicy instead (pass 0)."""
    resilience = spec.resilience
    annotations = {
        names.AUTO_RESUME: "true" if resilience.auto_resume else "false",
        names.MAX_RETRY: str(resilience.max_retry),
        names.STARTUP_TIMEOUT: f"{resilience.startup_timeout or STARTUP_TIMEOUT_FALLBACK_S:g}",
        names.REQUIRE_DEEP_HEALTH: "true" if deep_health else "false",
    }
    if "straggler_policy" in resilience.model_fields_set:
        annotations[names.STRAGGLER_POLICY] = resilience.straggler_policy.value
    if "straggler_restart_cost" in resilience.model_fields_set:
        annotations[names.STRAGGLER_RESTART_COST] = f"{resilience.straggler_restart_cost:g}"
    if resilience.hang_timeout is not None:  # unset: the operator sets it from the job's step times
        annotations[names.HANG_TIMEOUT] = f"{resilience.hang_timeout:g}"
    if (tiers := tiers_json(spec)) is not None:
        annotations[names.CHECKPOINT_TIERS] = tiers
    if spare_pods:
        annotations[names.SPARE_PODS] = str(spare_pods)
    return annotations


def tiers_json(spec: JobSpec) -> str | None:
    """The job's tier policy as the annotation and the ranks' env carry it; None without tiers."""
    tiers = spec.checkpoint.tiers
    return None if tiers is None else tiers.model_dump_json(exclude_none=True)


def job_spec(settings: AutoResume, *, name: str, command: str, pods: int, procs_per_node: int,
             fewest_pods: int | None) -> JobSpec:
    """The JobSpec the reconcilers read for a workload that opted in with ``settings``, of ``pods`` pods
    (``fewest_pods``: an elastic job's minimum; pods above it, or else the spare pods, may be lost in place)."""
    losable = pods - fewest_pods if fewest_pods is not None else settings.spare_pods
    return JobSpec.model_validate({
        "name": name,
        "nodes": pods,
        "procs_per_node": procs_per_node,
        "command": [command],
        "resilience": ResilienceSpec(
            auto_resume=True, max_retry=settings.max_retry, restart_policy=RestartPolicy.ON_FAILURE,
            hang_timeout=settings.hang_timeout,
            startup_timeout=settings.startup_timeout or NO_STARTUP_TIMEOUT,
            require_deep_health_passed=settings.require_deep_health_passed, straggler_policy=settings.straggler_policy,
            straggler_restart_cost=settings.straggler_restart_cost,
            node_losses_in_place=min(max(0, losable), pods - 1),
        ).model_dump(),
        "checkpoint": ({} if settings.checkpoint_tiers is None else
                       settings.checkpoint_tiers.model_dump(exclude_none=True)),
    }, context={"trusted": True})


def managed(annotations: Mapping[str, str] | None) -> bool:
    """The job asked for unbroken (whatever else its annotations say)."""
    return (annotations or {}).get(names.AUTO_RESUME, "").strip() in _TRUE


def parse(annotations: Mapping[str, str] | None) -> AutoResume | None:
    """None for a job that did not opt in; AnnotationError for one that did, badly."""
    annotations = annotations or {}
    switch = annotations.get(names.AUTO_RESUME)
    if switch is None:
        return None
    problems: list[str] = []
    if switch.strip() not in _TRUE | _FALSE:
        problems.append(f'annotation {names.AUTO_RESUME}: "{switch}" is not a boolean (valid: "true" or "false")')
    elif switch.strip() in _FALSE:
        return None
    max_retry = _integer(annotations, names.MAX_RETRY, default=3, low=0, high=MAX_RETRY_LIMIT, problems=problems)
    hang = _number(annotations, names.HANG_TIMEOUT, problems=problems)
    startup = _number(annotations, names.STARTUP_TIMEOUT, problems=problems)
    deep = annotations.get(names.REQUIRE_DEEP_HEALTH, "false").strip()
    if deep not in _TRUE | _FALSE:
        problems.append(f'annotation {names.REQUIRE_DEEP_HEALTH}: "{deep}" is not a boolean (valid: "true" or "false")')
    tiers = _tiers(annotations, problems=problems)
    spare_pods = _integer(annotations, names.SPARE_PODS, default=0, low=0, high=MAX_RETRY_LIMIT, problems=problems)
    restart_cost = _number(annotations, names.STRAGGLER_RESTART_COST, problems=problems)
    stragglers = annotations.get(names.STRAGGLER_POLICY, StragglerPolicy.REPORT.value).strip()
    if stragglers not in {p.value for p in StragglerPolicy}:
        problems.append(f'annotation {names.STRAGGLER_POLICY}: "{stragglers}" is not a straggler policy '
                        f'(valid: {", ".join(p.value for p in StragglerPolicy)})')
    if problems:
        raise AnnotationError(problems)
    return AutoResume(max_retry=max_retry, hang_timeout=hang, require_deep_health_passed=deep in _TRUE,
                      startup_timeout=startup, checkpoint_tiers=tiers, straggler_policy=StragglerPolicy(stragglers),
                      straggler_restart_cost=restart_cost or STRAGGLER_RESTART_COST_S, spare_pods=spare_pods)


def _tiers(annotations: Mapping[str, str], *, problems: list[str]) -> TierPolicy | None:
    raw = annotations.get(names.CHECKPOINT_TIERS)
    if raw is None:
        return None
    try:
        return TierPolicy.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the value"
        problems.append(f'annotation {names.CHECKPOINT_TIERS}: "{raw}" is not a tier policy ({where}: {first["msg"]}; valid: '
                        'JSON like {"memory": {"every_steps": 10, "keep": 2, "replicas": 1}, "persistent": {"uri": "s3://bucket/prefix"}})')
        return None


def _integer(annotations: Mapping[str, str], key: str, *, default: int, low: int, high: int, problems: list[str]) -> int:
    raw = annotations.get(key)
    if raw is None:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        problems.append(f'annotation {key}: "{raw}" is not a whole number (valid: {low} to {high})')
        return default
    if not low <= value <= high:
        problems.append(f'annotation {key}: "{raw}" is out of range (valid: {low} to {high})')
    return value


def _number(annotations: Mapping[str, str], key: str, *, problems: list[str]) -> float | None:
    raw = annotations.get(key)
    if raw is None:
        return None
    try:
        value = float(raw.strip())
    except ValueError:
        problems.append(f'annotation {key}: "{raw}" is not a number of seconds (valid: a number > 0, e.g. "300")')
        return None
    if not value > 0:
        problems.append(f'annotation {key}: "{raw}" must be > 0 seconds')
    return value
