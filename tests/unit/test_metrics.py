"""Metrics without a running cluster: the cluster collector over a real store, the agent's own
counters, the GPU collector's names, and the fault kinds every restart is labelled with.
The scrape by a real Prometheus is in tests/integration/test_observability.py."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from unbroken.controller import jobs
from unbroken.agent.progress import ProgressBook
from unbroken.rank.channel import MessageKind, RankMessage
from unbroken.config.cluster import ClusterConfig
from unbroken.config.job import JobSpec
from unbroken.controller.fault_kinds import FaultKind, classify
from unbroken.controller.metrics import ClusterCollector, fault_reason_code
from unbroken.health.gpu_metrics import GpuCollector
from unbroken.plumbing.layout import ClusterLayout
from unbroken.plumbing.metrics import AgentMetrics
from unbroken.runtime import Runtime, create_local
from unbroken.state.phases import DeepHealthStatus, JobPhase, NodeState, WorkerPhase
from unbroken.state.records import EventType, Node
from unbroken.state.updates import JobUpdate, NodeUpdate, WorkerUpdate


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, as Prometheus would parse the text."""
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(scraped: dict, name: str, **labels: str) -> float | None:
    return scraped.get((name, tuple(sorted(labels.items()))))


# -- the kinds a restart is counted under -----------------------------------------------


@pytest.mark.parametrize("reason, kind", [
    ("worker on node-2: rank 3 (local rank 1) exited with signal 9 (SIGKILL); restart 1 of 3", FaultKind.WORKER_KILLED),
    ("worker on node-1: rank 0 (local rank 0) exited with code 3; restart 1 of 1", FaultKind.WORKER_ERROR),
    ("worker on node-1: rank 0 (local rank 0) exited with code 1: RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1",
     FaultKind.PEER_LOST),
    ("hang: no progress from a rank on node-1 for 5.2 s (hang_timeout 5 s, last step 40); restart 1 of 3", FaultKind.HANG),
    ("hang: no rank on node-1 reported progress within startup_timeout 600 s", FaultKind.STARTUP_TIMEOUT),
    ("node node-2 is UnschedulablePendingReplacement: heartbeat lost: last seen 4.1 s ago", FaultKind.NODE_LOST),
    ("worker on node-2 lost with its node (Retired)", FaultKind.NODE_LOST),
    ("node node-3 is UnschedulablePendingReplacement: Xid 79 (GPU has fallen off the bus) on PCI:0000:b9:00", FaultKind.NODE_FAULT),
    ("node node-2 is UnschedulablePendingReplacement: straggler in job train: rank 1 scores 0.5; expected loss ...",
     FaultKind.STRAGGLER),
    ("worker on node-1: cannot start torchrun in /gone: No such file or directory", FaultKind.LAUNCH_FAILED),
    ("something nobody wrote", FaultKind.OTHER),
])
def test_every_restart_reason_the_decisions_write_has_its_kind(reason: str, kind: FaultKind) -> None:
    assert classify(reason) is kind


@pytest.mark.parametrize("message, code", [
    ("Xid 79 (GPU has fallen off the bus) on PCI:0000:b9:00 -> UnschedulablePendingReplacement", "Xid79"),
    ("SXid 20034 (LTSSM fault) on PCI:0000:05:00.0 -> UnschedulablePendingReboot", "SXid20034"),
    ("heartbeat lost: last seen 4.1 s ago (NodeLostAfterSeconds 4) -> UnschedulablePendingReplacement", "HeartbeatLost"),
    ("collective.allreduce: busbw below threshold -> UnschedulablePendingReplacement", "collective.allreduce"),
    ("replacement requested by operator", "Operator"),
])
def test_node_fault_reasons_become_bounded_codes(message: str, code: str) -> None:
    assert fault_reason_code(message) == code


# -- the cluster collector: derived from the store --------------------------------------


@pytest.fixture
def runtime(tmp_path: Path) -> Runtime:
    return create_local(ClusterLayout.at(tmp_path / "cluster"), ClusterConfig.with_nodes(2))


def collector_registry(runtime: Runtime) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(ClusterCollector(runtime.cluster, runtime.backend, runtime.catalog, runtime.clock))
    return registry


def test_job_metrics_come_from_the_jobs_events_and_workers(runtime: Runtime) -> None:
    table = runtime.worker_table
    assert table is not None
    now = time.time()
    for name in ("node-1", "node-2"):
        runtime.cluster.add_node(Node(name=name, group="workers", instance_type="cpu-dev", state=NodeState.SCHEDULABLE,
                                      deep_health=DeepHealthStatus.PASSED))
    jobs.submit(runtime.cluster, JobSpec.model_validate({"name": "train", "nodes": 1, "command": ["-m", "x"],
                                                          "resilience": {"auto_resume": True, "max_retry": 3}}))
    job = runtime.cluster.update_job("train", JobUpdate(phase=JobPhase.RUNNING, attempt=0, nodes=("node-1",), started_at=now - 100))
    runtime.backend.launch_attempt(job, 0, [runtime.cluster.get_node("node-1")])
    [w0] = runtime.backend.observe_attempt("train", 0)
    table.update_worker(w0.id, WorkerUpdate(phase=WorkerPhase.RUNNING, first_step=1, first_progress_at=now - 90, last_step=50,
                                            last_progress_at=now - 40, checkpoint_stall_s=1.5))
    runtime.cluster.add_event("Job", "train", "ChaosKillWorker", "SIGKILL to rank 0", type=EventType.WARNING)
    table.update_worker(w0.id, WorkerUpdate(phase=WorkerPhase.FAILED, exit_code=-9, message="rank 0 (local rank 0) exited with signal 9"))
    runtime.cluster.update_job("train", JobUpdate(phase=JobPhase.RESTARTING, reason="x"))
    runtime.cluster.add_event("Job", "train", "JobRestarting", "worker on node-1: rank 0 (local rank 0) exited with signal 9 (SIGKILL); restart 1 of 3",
                              type=EventType.WARNING)
    job = runtime.cluster.update_job("train", JobUpdate(phase=JobPhase.RUNNING, attempt=1, nodes=("node-2",)))
    runtime.backend.launch_attempt(job, 1, [runtime.cluster.get_node("node-2")])
    [w1] = runtime.backend.observe_attempt("train", 1)
    table.update_worker(w1.id, WorkerUpdate(phase=WorkerPhase.RUNNING, restored_step=40, first_step=41, first_progress_at=now - 20,
                                            last_step=60, last_progress_at=now - 1))

    scraped = samples(collector_registry(runtime))

    assert value(scraped, "unbroken_job_restarts_total", job="train", reason="worker_killed") == 1
    assert value(scraped, "unbroken_job_restarts_total", job="train", reason="hang") == 0, "every kind is there from the start"
    assert value(scraped, "unbroken_job_faults_total", job="train", fault_type="worker_killed") == 1
    assert value(scraped, "unbroken_job_retry_budget_remaining", job="train") == 2
    assert value(scraped, "unbroken_job_step", job="train") == 60
    assert value(scraped, "unbroken_job_last_progress_timestamp_seconds", job="train") == pytest.approx(now - 1)
    assert value(scraped, "unbroken_job_phase", job="train", phase="Running") == 1
    assert value(scraped, "unbroken_job_phase", job="train", phase="Pending") == 0
    assert value(scraped, "unbroken_job_badput_seconds_total", job="train", cause="lost_steps") == pytest.approx(10 * 50 / 49)
    assert value(scraped, "unbroken_job_badput_seconds_total", job="train", cause="checkpoint_stall") == 1.5
    assert value(scraped, "unbroken_job_recovery_seconds_count") == 1
    assert value(scraped, "unbroken_job_goodput_seconds_total", job="train") > 0
    assert value(scraped, "unbroken_node_health_status", node="node-1", status="Schedulable") == 1
    assert value(scraped, "unbroken_node_health_status", node="node-1", status="UnschedulablePendingReboot") == 0


def test_a_restart_decided_on_a_lost_peer_is_counted_under_its_cause(runtime: Runtime) -> None:
    jobs.submit(runtime.cluster, JobSpec.model_validate({"name": "p", "nodes": 1, "command": ["-m", "x"]}))
    runtime.cluster.add_event("Job", "p", "JobRestarting", "worker on node-1: rank 0 exited with code 1: RuntimeError: Connection "
                              "closed by peer [127.0.0.1]:4; restart 1 of 3")
    runtime.cluster.add_event("Job", "p", "JobRestartCause", "attempt 0: the failure behind restart 1: worker on node-2: rank 3 "
                              "(local rank 1) exited with signal 9 (SIGKILL)")
    scraped = samples(collector_registry(runtime))
    assert value(scraped, "unbroken_job_restarts_total", job="p", reason="worker_killed") == 1
    assert value(scraped, "unbroken_job_restarts_total", job="p", reason="peer_lost") == 0


def test_node_metrics_come_from_labels_and_fault_events(runtime: Runtime) -> None:
    runtime.cluster.add_node(Node(name="node-1", group="workers", instance_type="cpu-dev", state=NodeState.JOINING,
                                  deep_health=DeepHealthStatus.IN_PROGRESS))
    node = runtime.cluster.update_node("node-1", NodeUpdate(state=NodeState.SCHEDULABLE, deep_health=DeepHealthStatus.PASSED))
    runtime.cluster.update_node("node-1", NodeUpdate(state=NodeState.PENDING_REBOOT), expect_version=node.version)
    runtime.cluster.add_event("Node", "node-1", "RebootRequired", "Xid 48 (Double-bit ECC error) on PCI:0000:b9:00 -> UnschedulablePendingReboot")
    runtime.cluster.add_event("Node", "node-1", "NodeRebooting", "Xid 48")
    scraped = samples(collector_registry(runtime))
    assert value(scraped, "unbroken_node_health_status", node="node-1", status="UnschedulablePendingReboot") == 1
    assert value(scraped, "unbroken_node_health_status", node="node-1", status="Schedulable") == 0
    assert value(scraped, "unbroken_node_deep_health_check_status", node="node-1", status="Passed") == 1
    assert value(scraped, "unbroken_node_faults_total", node="node-1", fault_type="RebootRequired", reason="Xid48") == 1
    assert value(scraped, "unbroken_node_remediations_total", node="node-1", action="reboot") == 1


# -- what an agent counts itself --------------------------------------------------------


def msg(kind: MessageKind, step: int, detail: str, **metrics: float) -> RankMessage:
    return RankMessage(kind=kind, job="j", attempt=0, rank=0, local_rank=0, pid=1, ts=1.0, step=step, metrics=metrics, detail=detail)


def test_rank_saves_and_restores_become_histograms_and_badput_with_bounded_labels() -> None:
    metrics = AgentMetrics()
    book = ProgressBook(metrics)
    book.apply([msg(MessageKind.SAVED, 10, "memory", stall_seconds=0.02, bytes=100.0),
                msg(MessageKind.SAVED, 20, "memory", stall_seconds=0.03, bytes=100.0),
                msg(MessageKind.RESTORED, 20, "replica", seconds=0.5),
                msg(MessageKind.SAVED, 30, "an-attacker-chose-this", stall_seconds=0.01)])
    scraped = samples(metrics.registry)
    assert value(scraped, "unbroken_checkpoint_save_stall_seconds_count", tier="memory") == 2
    assert value(scraped, "unbroken_checkpoint_save_stall_seconds_sum", tier="memory") == pytest.approx(0.05)
    assert value(scraped, "unbroken_checkpoint_restore_seconds_sum", source="replica") == 0.5
    assert value(scraped, "unbroken_checkpoint_save_stall_seconds_count", tier="other") == 1, "unknown words are not labels"
    [report] = book.take_dirty()
    assert report.checkpoint_stall_s == pytest.approx(0.06) and report.restored_step == 20


def test_npd_rule_matches_are_counted_as_node_problem_detector_names_them() -> None:
    metrics = AgentMetrics()
    metrics.problem("OOMKilling")
    metrics.problem("OOMKilling")
    metrics.problem("DockerHung", condition="KernelDeadlock")
    text = generate_latest(metrics.registry).decode()
    assert 'problem_counter{reason="OOMKilling"} 2.0' in text, "NPD's name, without _total"
    assert 'problem_gauge{reason="DockerHung",type="KernelDeadlock"} 1.0' in text


class _OneGpu:
    """Stands in for NVML (the driver's library): one H100 with some readings."""

    NVML_TEMPERATURE_GPU, NVML_VOLATILE_ECC = 0, 0
    NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 1

    def nvmlDeviceGetCount(self):  # noqa: N802 - NVML's names
        return 1

    def nvmlDeviceGetHandleByIndex(self, i):  # noqa: N802
        return i

    def nvmlDeviceGetPciInfo(self, h):  # noqa: N802
        return SimpleNamespace(busId=b"00000000:B9:00.0")

    def nvmlDeviceGetUUID(self, h):  # noqa: N802
        return "GPU-1234"

    def nvmlDeviceGetName(self, h):  # noqa: N802
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetUtilizationRates(self, h):  # noqa: N802
        return SimpleNamespace(gpu=87)

    def nvmlDeviceGetMemoryInfo(self, h):  # noqa: N802
        return SimpleNamespace(used=40 * 2**30, free=40 * 2**30)

    def nvmlDeviceGetTemperature(self, h, sensor):  # noqa: N802
        return 61

    def nvmlDeviceGetPowerUsage(self, h):  # noqa: N802
        return 512_000

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):  # noqa: N802
        return 3 if kind == 0 else 0

    def nvmlDeviceGetRemappedRows(self, h):  # noqa: N802
        raise RuntimeError("NVMLError_NotSupported")


def test_gpu_readings_carry_dcgm_exporters_names_and_labels() -> None:
    registry = CollectorRegistry()
    last_xid = {"PCI:0000:b9:00": 79}  # as the kernel log names the bus
    registry.register(GpuCollector("node-7", last_xid, nvml=_OneGpu()))
    scraped = samples(registry)
    labels = dict(gpu="0", UUID="GPU-1234", device="nvidia0", modelName="NVIDIA H100 80GB HBM3", Hostname="node-7",
                  pci_bus_id="00000000:B9:00.0")
    assert value(scraped, "DCGM_FI_DEV_GPU_UTIL", **labels) == 87
    assert value(scraped, "DCGM_FI_DEV_FB_USED", **labels) == 40 * 1024
    assert value(scraped, "DCGM_FI_DEV_POWER_USAGE", **labels) == 512
    assert value(scraped, "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", **labels) == 3
    assert value(scraped, "DCGM_FI_DEV_XID_ERRORS", **labels) == 79, "the kernel log's Xid, matched to the GPU by its bus"
    assert not [k for k in scraped if k[0] == "DCGM_FI_DEV_ROW_REMAP_FAILURE"], "what the GPU cannot say is absent, not 0"


def test_without_a_driver_there_are_no_gpu_series() -> None:
    registry = CollectorRegistry()
    registry.register(GpuCollector("node-1"))
    assert not [k for k in samples(registry) if k[0].startswith("DCGM_")]
