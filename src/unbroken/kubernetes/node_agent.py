"""The node agent on Kubernetes: ``unbroken agent --kubernetes --node $(NODE_NAME)`` (the DaemonSet).

The same parts as the local agent, minus what the kubelet does there: no
worker runner (pods are the kubelet's), no registration (the Node exists). It
sends the leading operator a signed datagram every ``HeartbeatIntervalSeconds``
with the ranks' progress (kubernetes/backend/heartbeats.py: the node's heartbeat; the progress,
every job's latest attempt, is how the operator sees a hang) and renews its Lease
``unbroken-node-<node>`` every ``Kubernetes.LeaseRenewSeconds`` with the same
progress (the backstop a new leader reads first), watches
the kernel log (``/dev/kmsg`` on a real node, ``--kernel-log``) and applies
faults to its own Node through the store (an Xid 79 → labels, taint, condition
in one write), serves ``/metrics``, and with the SelfReboot remediator reboots
its host when the operator asks (``_reboot_if_asked``).

It keeps the node's checkpoint memory tier as the local agent does (the same
:class:`CheckpointService`: replicas to peers, drains to the persistent tier,
the restore catalog for its ranks) over the Kubernetes catalog (ConfigMaps,
kubernetes/backend/catalog.py), with its node's TLS certificate, which the operator issues
it (kubernetes/backend/node_credentials.py: the agent holds no Secret), written beside its socket,
where the training pods find it, and its shard server's address in the file ``checkpoint-endpoint`` there.

It runs the continuous checks (the cluster file's ``Continuous`` suite, every
``Health.MonitorIntervalSeconds`` while its node is Schedulable) as the local
agent does: a failure with a node action takes the node out through the store.
Join checks are not here: deep health check Jobs are the operator's to run.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from unbroken.plumbing import logs, metrics
from unbroken.plumbing.atomic_file import write_bytes_atomically
from unbroken.agent.progress import ProgressBook
from unbroken.rank.channel import AgentReceiver, agent_socket
from unbroken.checkpoint.node import shm
from unbroken.checkpoint.node.service import CheckpointService
from unbroken.config.cluster import Remediator
from unbroken.config.health import KernelLogSource
from unbroken.errors import NotFoundError, StoreUnavailable, UnbrokenError
from unbroken.health.kernel_log.sources import LineSource, open_source
from unbroken.health.monitor import HealthMonitor
from unbroken.health import suspect
from unbroken.kubernetes.backend import heartbeats, names, node_credentials, node_repair, rank_env
from unbroken.checkpoint.node.credentials import Credentials
from unbroken.rank.env import ENDPOINT_FILE
from unbroken.kubernetes.backend.api import RequestRefused
from unbroken.kubernetes.backend.client import api_client
from unbroken.kubernetes.backend.store import KubernetesStore
from unbroken.plumbing.metrics import AgentMetrics
from unbroken.runtime import KubernetesRuntime, open_kubernetes
from unbroken.state.records import EventType, WorkerProgress

log = logging.getLogger("unbroken.kubernetes.node_agent")

RECEIVE_SECONDS = 0.1
SELF_REBOOT_TIMEOUT_SECONDS = 120.0
"""A reboot command returns at once or never (the host goes down with the agent); past this it failed."""
CHECKPOINT_PASS_SECONDS = 0.5
"""The memory tier's reconcile pass (a replica starts within ~0.5 s of a save). It reads watch caches;
locally it is 0.1 s against SQLite."""


def kernel_log_source(spec: str) -> LineSource:
    """``/dev/kmsg``, ``journald``, or a file that lines are appended to."""
    if spec == "/dev/kmsg":
        return open_source(KernelLogSource.KMSG, Path(spec))
    if spec == "journald":
        return open_source(KernelLogSource.JOURNALD, Path(spec))
    return open_source(KernelLogSource.FILE, Path(spec))


class KubernetesAgent:
    def __init__(self, runtime: KubernetesRuntime, node: str, socket_dir: Path, kernel_log: str, *, shard_host: str = "127.0.0.1",
                 shard_port: int = 0) -> None:
        self.runtime = runtime
        self.shard_host = shard_host
        self.shard_port = shard_port
        self.store = runtime.cluster
        self.node = node
        self.socket_dir = socket_dir
        self.kernel_log = kernel_log
        self.metrics = AgentMetrics()
        self.book = ProgressBook(self.metrics)
        self.stopping = threading.Event()
        self.rebooted_from: set[str] = set()
        """Boots this agent ran the SelfReboot command on (once each)."""
        self.suspect = suspect.SuspectWatch(
            lambda: suspect.check(self.store, self._jobs_on, self.runtime.layout, self.runtime.config, self.node), node)
        """The known-answer check, run when the operator suspects this node of silent data corruption. It sees the node
        through the continuous checks' read (every ``Health.MonitorIntervalSeconds``): no API read of its own."""
        self.sender: heartbeats.HeartbeatSender | None = None
        """The heartbeat datagrams' sender, once the operator has given this node its key."""
        self.checkpoints: CheckpointService | None = None
        """The node's memory tier, once it runs."""

    def run(self, metrics_host: str, metrics_port: int | None) -> None:
        self.socket_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        receiver = AgentReceiver(agent_socket(self.socket_dir))
        watch_kernel_log = self.kernel_log != "none"
        if not watch_kernel_log:
            log.warning("the kernel log is not watched (no Xid detection): set UNBROKEN_KERNEL_LOG or --kernel-log "
                        "(deploy/overlays/gpu sets /dev/kmsg)", extra={"node": self.node})
        # The continuous checks run whatever the kernel log: their context is this agent's state
        # directory (the hostPath /var/lib/unbroken), so storage.checkpoint checks the node's own disk,
        # as the deep-check Jobs do. The kernel log is opened here, at "now": a line written after the
        # Lease below says the agent is up is always seen.
        HealthMonitor(self.store, self._jobs_on, self.runtime.layout, self.node, self.runtime.config, self.stopping,
                      self.metrics, source=kernel_log_source(self.kernel_log) if watch_kernel_log else None,
                      kernel_log=watch_kernel_log, on_node=self.suspect.look).start()
        self.store.renew_lease(self.node, at=time.time())
        # The heartbeats and the memory tier wait for this node's credentials from the operator: in threads of
        # their own, so that an agent started before the operator does its health work meanwhile.
        threading.Thread(target=self._with_credentials, name="heartbeats", daemon=True).start()
        endpoint = metrics.serve(self.metrics.registry, metrics_host, metrics_port or 0) if metrics_port is not None else None
        log.info("agent started", extra={"node": self.node, "kernel_log": self.kernel_log, "socket": str(receiver.path),
                                         "metrics": endpoint.address if endpoint else None})
        renew_every = self.runtime.config.Kubernetes.LeaseRenewSeconds
        next_renewal = time.monotonic() + renew_every
        self_reboot = self.runtime.config.Kubernetes.Remediator is Remediator.SELF_REBOOT
        try:
            while not self.stopping.wait(RECEIVE_SECONDS):
                self.book.apply(receiver.drain())
                now = time.monotonic()
                if now >= next_renewal:
                    next_renewal = max(next_renewal + renew_every, now)
                    if renew_lease(self.store, self.node, self.book.current()):
                        try:
                            if self.sender is not None:
                                self.sender.address = self._leader_address()
                            if self_reboot:
                                self._reboot_if_asked()
                        except StoreUnavailable:
                            log.exception("reading the leader's address or a reboot request failed; retrying",
                                          extra={"node": self.node})
        finally:
            receiver.close()
            if self.sender is not None:
                self.sender.send(self.book.current(), leaving=True)  # a rolling update, not a lost node
                self.sender.close()
            if self.checkpoints is not None:
                self.checkpoints.close()
            if endpoint is not None:
                endpoint.close()

    def _with_credentials(self) -> None:
        """Ask the leading operator for this node's credentials (kubernetes/backend/node_credentials.py: its
        certificate, written where the training pods find it, and its heartbeat key), then keep the memory tier and
        beat. Until then the Lease alone vouches for this node (a loss is seen ``LeaseRenewSeconds`` later) and
        the memory tier is off."""
        issued = node_credentials.obtain(self.store.api, lambda: self.store.lease_annotations(names.LEADER_LEASE), self.node,
                                         self.socket_dir / rank_env.CLUSTER_FOLDER, self.stopping)
        if issued is None:
            return
        threading.Thread(target=self._start_checkpoints, args=(issued.tls,), name="checkpoints", daemon=True).start()
        self._beat(issued.heartbeat_key)

    def _beat(self, key: bytes) -> None:
        """A datagram to the leader every ``HeartbeatIntervalSeconds`` until the agent stops (a stall, a paused agent,
        sends one beat after it, not a burst)."""
        sender = heartbeats.HeartbeatSender(key, self.node)
        sender.address = self._leader_address()
        self.sender = sender
        every = self.runtime.config.Local.HeartbeatIntervalSeconds
        sender.send(self.book.current())
        while not self.stopping.wait(every):
            sender.send(self.book.current())

    def _leader_address(self) -> tuple[str, int] | None:
        """Where the leading operator hears heartbeats (the leader Lease's annotation), None if none leads."""
        try:
            annotations = self.store.lease_annotations(names.LEADER_LEASE)
        except NotFoundError:
            return None
        text = annotations.get(heartbeats.ADDRESS_ANNOTATION, "")
        return heartbeats.parse_address(text)

    def _start_checkpoints(self, creds: Credentials) -> None:
        """The memory tier on this node, with the node's certificate; if it cannot start, it stays off (logged) and the
        agent's health work goes on."""
        cluster_dir = self.socket_dir / rank_env.CLUSTER_FOLDER
        # The pass reads the Nodes, the workloads and the job's catalog: from watch caches, not lists (this
        # agent follows no other node's Lease and no pod: kubernetes/backend/watch_cache.py).
        caches = self.store.start_watches(leases=False, pods=False)
        self.runtime.catalog.follow(nodes=caches.nodes)
        try:
            service = CheckpointService(self.runtime.catalog, self.store, self.node, shm.node_root(cluster_dir, self.node),
                                        creds, host=self.shard_host, port=self.shard_port, metrics=self.metrics)
            service.start()
        except UnbrokenError as exc:
            log.error("the checkpoint memory tier is off on this node: %s", exc, extra={"node": self.node})
            return
        assert service.server is not None
        write_bytes_atomically(self.socket_dir / ENDPOINT_FILE, f"{service.server.address}\n".encode())  # ranks read it any time
        self.checkpoints = service
        log.info("checkpoint memory tier up", extra={"node": self.node, "shard_server": service.server.address,
                                                     "root": str(service.root)})
        service.run_passes(self.stopping, CHECKPOINT_PASS_SECONDS)

    def _reboot_if_asked(self) -> None:
        """SelfReboot: run ``Kubernetes.SelfRebootCommand`` once for a reboot asked of the boot this agent runs on.

        The operator names the boot to end (``unbroken.dev/reboot-from-boot-id``): the agent on
        the next boot never runs it, and this agent runs it once per boot (a command that failed
        is not retried: the node stays Rebooting until ``RebootTimeoutSeconds`` makes it a
        replacement; an agent restarted on the same boot tries once more).
        """
        boot = node_repair.read_boot(self.store, self.node)
        if not boot.reboot_due_here or boot.boot_id in self.rebooted_from:
            return
        assert boot.boot_id is not None
        self.rebooted_from.add(boot.boot_id)
        command = self.runtime.config.Kubernetes.SelfRebootCommand
        self.store.add_event("Node", self.node, "NodeSelfRebooting", f"the agent reboots its host: {shlex.join(command)}")
        log.warning("rebooting this node", extra={"node": self.node, "command": command})
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=SELF_REBOOT_TIMEOUT_SECONDS,
                                  env={**os.environ, "UNBROKEN_NODE": self.node, "UNBROKEN_ACTION": "Reboot"})
            failure = None if done.returncode == 0 else f"exited {done.returncode}: {done.stderr.strip()[-500:]}"
        except (OSError, subprocess.TimeoutExpired) as exc:
            failure = str(exc)
        if failure is not None:
            self.store.add_event("Node", self.node, "SelfRebootFailed", f"{shlex.join(command)}: {failure}; the node stays "
                                 "Rebooting until RebootTimeoutSeconds, then it is replaced", type=EventType.WARNING)
            log.error("self reboot failed: %s", failure, extra={"node": self.node})

    def _jobs_on(self, node: str) -> list[str]:
        """Jobs with pods on this node (named in fault Events)."""
        return sorted({w.job for w in self.runtime.backend.active_workers() if w.node == node})


def renew_lease(store: KubernetesStore, node: str, progress: Sequence[WorkerProgress]) -> bool:
    """One renewal of ``node``'s Lease with its ranks' progress; False, logged, if it failed. A failed renewal never
    ends the agent: the next one tries again, and its datagrams vouch for the node meanwhile. A refusal too: an API
    server just restarted answers 403 until its authorizer's caches have loaded, and an agent that exited on that
    (CI saw it, after the 30 s outage of tests/integration/test_kubernetes.py) left its node silent: lost, its job
    restarted. A refusal that lasts is logged at every renewal, naming what to check."""
    try:
        store.renew_lease(node, at=time.time(), progress=progress)
    except StoreUnavailable:
        log.exception("lease renewal failed; retrying", extra={"node": node})
        return False
    except RequestRefused as exc:
        log.warning("lease renewal refused; retrying at the next renewal (right after an API server restart this "
                    "passes; if it lasts, check deploy/'s RBAC for the agent's ServiceAccount): %s", exc,
                    extra={"node": node, "status": exc.status})
        return False
    return True


def _end_the_start(signum: int, _frame: object) -> None:
    # what the default action does for any process but PID 1: end now (SystemExit would wait for the threads the
    # watch caches have started by then)
    os._exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    # First of all: the agent is its container's PID 1, and PID 1 never gets a signal it has no handler for. A SIGTERM
    # while it started (opening its watch caches takes seconds: a rolling update right after a pod began) was lost:
    # the pod ran out its grace period, beating, was SIGKILLed without the "leaving" beat, and its node read as lost
    # while the next agent started (a real node's test, deploy/overlays/gpu applied over a starting install). Until
    # it runs, the agent holds nothing: a SIGTERM ends it at once.
    signal.signal(signal.SIGTERM, _end_the_start)
    parser = argparse.ArgumentParser(prog="unbroken agent", description="the unbroken node agent on Kubernetes (DaemonSet)")
    parser.add_argument("--kubernetes", action="store_true", required=True, help="run against the Kubernetes API")
    parser.add_argument("--node", default=os.environ.get("NODE_NAME"), help="this node's name (downward API: spec.nodeName)")
    parser.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE", "unbroken-system"))
    parser.add_argument("--kubeconfig", type=Path, default=None)
    parser.add_argument("--context", default=None)
    parser.add_argument("--kernel-log", default=os.environ.get("UNBROKEN_KERNEL_LOG", "none"),
                        help="/dev/kmsg, journald, a file, or none (default: $UNBROKEN_KERNEL_LOG, else none: the base "
                             "DaemonSet mounts no kernel log; the gpu overlay sets /dev/kmsg)")
    parser.add_argument("--socket-dir", type=Path,
                        default=Path(os.environ.get("UNBROKEN_AGENT_SOCKET", "/var/run/unbroken/agent.sock")).parent,
                        help="where ranks find the agent's socket (a hostPath the training pods mount)")
    parser.add_argument("--metrics-port", type=int, default=None)
    parser.add_argument("--metrics-host", default="0.0.0.0")
    parser.add_argument("--state-dir", type=Path, default=Path("/var/lib/unbroken"))
    parser.add_argument("--shard-server-host", default=os.environ.get("POD_IP", "127.0.0.1"),
                        help="the address peers reach this node's memory tier on (default: $POD_IP, which the DaemonSet "
                             "sets from status.podIP; with hostNetwork that is the node's IP)")
    parser.add_argument("--shard-server-port", type=int, default=0, help="its port (default: any free one; the DaemonSet uses 9402)")
    args = parser.parse_args(argv)
    logs.setup(component="agent", node=args.node)
    if not args.node:
        log.error("no node name: pass --node or set NODE_NAME (the DaemonSet sets it from spec.nodeName)")
        return 2
    try:
        runtime = open_kubernetes(api_client(args.kubeconfig, args.context), args.namespace, state_dir=args.state_dir)
        agent = KubernetesAgent(runtime, args.node, args.socket_dir, args.kernel_log, shard_host=args.shard_server_host,
                                shard_port=args.shard_server_port)
    except UnbrokenError as exc:
        log.error("cannot start: %s", exc)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: agent.stopping.set())
    agent.run(args.metrics_host, args.metrics_port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
