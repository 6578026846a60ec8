"""The cluster file, modelled on HyperPod's ``create-cluster`` input.

Field names are PascalCase on purpose: a HyperPod cluster JSON (minus the
AWS-only fields it does not need) loads unchanged.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from unbroken.config.health import HealthSettings, Profile, resolve_profile

NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"


class DeepHealthCheck(StrEnum):
    INSTANCE_STRESS = "InstanceStress"
    INSTANCE_CONNECTIVITY = "InstanceConnectivity"


class NodeRecovery(StrEnum):
    AUTOMATIC = "Automatic"
    NONE = "None"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class InstanceGroup(_Strict):
    InstanceGroupName: str = Field(pattern=NAME_PATTERN)
    """Names the group in node listings; DNS-label rules so it can be a k8s label value."""
    InstanceType: str = "cpu-dev"
    """Selects the health profile (issue: health checks). ``cpu-dev`` is this kind of machine."""
    InstanceCount: int = Field(ge=0, le=64)
    """Nodes kept in service; replacements keep the count. 64 is the local backend's sane cap.
    0 on Kubernetes, where the cluster's Nodes are the nodes."""
    OnStartDeepHealthChecks: list[DeepHealthCheck] = Field(default_factory=list)
    """Suites a node must pass on join before it takes work."""


class LocalSettings(_Strict):
    """Timings of the local backend. Defaults favour fast recovery on one machine."""

    HeartbeatIntervalSeconds: float = Field(default=1.0, ge=1.0, le=60)
    """How often an agent renews its node's lease, carrying its ranks' progress. At most once
    a second (the minimum), so that it maps onto a Kubernetes Lease renewal: one write per
    node per second whatever the step rate. Rank progress reaches the controller this often,
    fresh enough for hang timeouts of seconds."""
    NodeLostAfterSeconds: float = Field(default=4.0, gt=0, le=600)
    """A node whose lease is older than this is lost: three missed renewals and a margin,
    so one slow write under load never takes a healthy node out."""
    RebootTimeoutSeconds: float = Field(default=60.0, gt=0)
    """A rebooted node that has not re-registered by then is replaced instead."""
    NetworkNamespaces: bool = False
    """Root only: each node (agent and workers) in its own network namespace behind a
    veth on one bridge, so that 'chaos slow-link' limits a real link."""

    @model_validator(mode="after")
    def _lost_after_heartbeat(self) -> "LocalSettings":
        if self.NodeLostAfterSeconds < 2 * self.HeartbeatIntervalSeconds:
            raise ValueError(
                f"NodeLostAfterSeconds ({self.NodeLostAfterSeconds}) must be at least twice "
                f"HeartbeatIntervalSeconds ({self.HeartbeatIntervalSeconds})"
            )
        return self


class MetricsSettings(_Strict):
    """Where the controller and every agent serve Prometheus metrics (``/metrics``)."""

    Enabled: bool = True
    Host: str = "127.0.0.1"
    """The address they bind. Loopback by default: nothing of the cluster is open to the network
    unless asked (``0.0.0.0`` lets a Prometheus on another machine scrape). A node in its own
    network namespace binds its namespace address."""
    ControllerPort: int = Field(default=0, ge=0, le=65535)
    """0: a free port, chosen at start and listed by ``unbroken cluster status``."""
    AgentBasePort: int = Field(default=0, ge=0, le=65535)
    """node-N serves on AgentBasePort + N (so a fixed scrape config can name them); 0: free ports."""
    GpuMetrics: bool = True
    """NVML's readings under dcgm-exporter's names (DCGM_FI_DEV_*), so existing GPU dashboards
    work. Turn off where dcgm-exporter already runs on the nodes: two exporters of one name clash."""


class Remediator(StrEnum):
    CONDITION = "Condition"
    """Set the node condition UnbrokenHealthy=False, cordon, evict: external repair acts on it."""
    COMMAND = "Command"
    """Also run RemediationCommand + [action, node] (a cloud CLI call that reboots or replaces it)."""
    SELF_REBOOT = "SelfReboot"
    """Reboots: the node's own agent runs SelfRebootCommand. Replacements: as Condition (a machine
    cannot replace itself; external repair acts on the condition)."""


class KubernetesSettings(_Strict):
    """The Kubernetes backend (``unbroken operator``); ignored by local clusters."""

    Remediator: Remediator = Remediator.CONDITION
    RemediationCommand: list[str] = Field(default_factory=list)
    """Run as ``RemediationCommand + [Reboot|Replace, <node>]`` with Remediator Command."""
    SelfRebootCommand: list[str] = Field(
        default_factory=lambda: ["nsenter", "--target", "1", "--mount", "--uts", "--ipc", "--net", "--pid", "--",
                                 "systemctl", "reboot"], min_length=1)
    """With Remediator SelfReboot: what the agent runs to reboot its host. The default enters the
    host's namespaces: the agent needs privilege (deploy/overlays/gpu) and ``hostPID: true``."""
    ForceDeleteGraceSeconds: float = Field(default=30.0, ge=0, le=3600)
    """A job pod on a lost node still Terminating after this long is force-deleted, so its
    workload's controller can create it again elsewhere."""
    StopGraceSeconds: int = Field(default=3, ge=0, le=3600)
    """The grace period of an attempt's pods when unbroken stops the attempt to restart the job:
    SIGTERM, then SIGKILL this much later. The pod's own (30 s unless it says) would hold every
    restart of a hung rank that long: the workload's controller recreates a pod only once its
    name is free. 3 s lets torchrun tear its ranks down, as the local agent allows."""
    DeepCheckImage: str = "ghcr.io/unbroken-dev/unbroken"
    """The image of the deep-check Jobs the operator runs on joining nodes (unbroken's own)."""
    DeepCheckCommand: list[str] = Field(default_factory=lambda: ["python", "-m", "unbroken.health.pod"], min_length=1)
    """What those Jobs' pods run; the suite and the check context come in their environment."""
    DeepCheckStartSeconds: float = Field(default=300.0, ge=10, le=3600)
    """Added to the suite's check timeouts for a deep-check Job's ``activeDeadlineSeconds``:
    time to pull the image and start the pod on a fresh node."""
    LeaseRenewSeconds: float = Field(default=10.0, ge=1.0, le=60)
    """How often each agent writes its Lease ``unbroken-node-<node>`` (duration: four times this).
    The node's heartbeat is a UDP datagram to the operator every ``Local.HeartbeatIntervalSeconds``
    (kubernetes/backend/heartbeats.py); the Lease is the backstop a new leader reads first, at the kubelet's own
    rhythm (0.1 writes per node per second at the default)."""
    HeartbeatPort: int = Field(default=9403, ge=1, le=65535)
    """The UDP port the leading operator hears the agents' heartbeats on (its Pod IP)."""
    ConnectivityPort: int = Field(default=29411, ge=1024, le=65535)
    """The InstanceConnectivity sweep across nodes runs in the host's network (``hostNetwork``: the
    node's own links are what it measures); its rank 0, on the joining node, listens on this port."""

    @model_validator(mode="after")
    def _command_given(self) -> "KubernetesSettings":
        if self.Remediator is Remediator.COMMAND and not self.RemediationCommand:
            raise ValueError("Remediator Command needs RemediationCommand (e.g. [/opt/remediate.sh])")
        return self


class ClusterConfig(_Strict):
    ClusterName: str = Field(pattern=NAME_PATTERN)
    InstanceGroups: list[InstanceGroup] = Field(min_length=1)
    NodeRecovery: NodeRecovery = NodeRecovery.AUTOMATIC
    """Automatic: lost or faulty nodes are rebooted/replaced without an operator."""
    Local: LocalSettings = Field(default_factory=LocalSettings)
    Health: HealthSettings = Field(default_factory=HealthSettings)
    """Profile and Xid-table overrides, kernel-log source, monitor cadence (health checks)."""
    Metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    Kubernetes: KubernetesSettings = Field(default_factory=KubernetesSettings)

    @field_validator("InstanceGroups")
    @classmethod
    def _unique_group_names(cls, groups: list[InstanceGroup]) -> list[InstanceGroup]:
        names = [g.InstanceGroupName for g in groups]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"InstanceGroupName must be unique, repeated: {', '.join(duplicates)}")
        return groups

    @model_validator(mode="after")
    def _known_instance_types(self) -> "ClusterConfig":
        for index, group in enumerate(self.InstanceGroups):
            try:
                resolve_profile(self.Health, group.InstanceType)
            except ValueError as exc:
                raise ValueError(f"InstanceGroups.{index}.InstanceType: {exc}") from None
        return self

    def profile(self, instance_type: str) -> Profile:
        """The health profile of ``instance_type`` with this cluster's overrides."""
        return resolve_profile(self.Health, instance_type)

    @classmethod
    def with_nodes(cls, count: int, name: str = "local") -> "ClusterConfig":
        """The cluster ``cluster up --nodes N`` makes: one cpu-dev group, automatic recovery."""
        return cls(
            ClusterName=name,
            InstanceGroups=[InstanceGroup(InstanceGroupName="workers", InstanceCount=count)],
        )

    def group(self, name: str) -> InstanceGroup:
        return next(g for g in self.InstanceGroups if g.InstanceGroupName == name)

    def group_matching(self, group: str, instance_type: str) -> "InstanceGroup | None":
        """The group a node belongs to: the one it names, else the first of its instance type.
        On Kubernetes a Node names its group by the label ``unbroken.dev/instance-group`` or not at
        all, and its instance type by ``node.kubernetes.io/instance-type``."""
        by_name = [g for g in self.InstanceGroups if g.InstanceGroupName == group]
        by_type = [g for g in self.InstanceGroups if g.InstanceType == instance_type]
        chosen = by_name or by_type
        return chosen[0] if chosen else None
