"""The process kubelet: what stands in for real kubelets and a container runtime under the real control plane.

No image can be pulled or run on these machines, so pods bound to this kubelet's nodes run as local
processes. Everything else is the real control plane's (cluster.py): the scheduler binds pods, training-
operator and the Job controller make them, the node lifecycle controller notices a dead node, taints it
and evicts its pods. This kubelet does no scheduling and no workload logic::

    with ProcessKubelet(plane.kubeconfig, workdir, plane.ca) as kubelet:
        kubelet.add_node("gpu-a", allocatable={"nvidia.com/gpu": "1"})
        ...                                  # the scheduler binds pods to gpu-a; they run as processes
        kubelet.fail_node("gpu-a")           # power loss: processes die, Lease and status stop

What it does, as a kubelet does it:

* **Nodes**: ``add_node`` registers a Node (Ready, InternalIP 127.0.0.1, capacity 32 cpu / 128Gi / 110
  pods plus the test's, e.g. ``nvidia.com/gpu``; ``taints`` as ``--register-with-taints``) and renews its
  Lease in ``kube-node-lease`` every ``LEASE_RENEW_S``. ``fail_node`` SIGKILLs the node's processes and stops
  its Lease and status writes; ``reboot_node`` kills them and comes back Ready on a new bootID.
* **Pods** bound to a live node: init containers one after another (each must exit 0), then the first
  container (a pod's other containers are reported ``Waiting``: no test needs sidecars); status through
  the ``status`` subresource from real exit codes (signal N -> 128+N); ``restartPolicy`` with a back-off
  of 1 s doubling to 10 s; graceful deletion (SIGTERM, SIGKILL after the grace period, the terminal
  status, then the grace-0 DELETE that confirms it); a pod gone from the API is killed.
* **Logs**: stdout+stderr to ``workdir/logs/<namespace>_<pod>_<container>.log`` (appended across pods of
  that name), served to the API server at ``/containerLogs/...`` over TLS (``kubectl logs`` and
  ``pods/log`` go API server -> kubelet, as on a real node).

How a container differs from a real one (no runtime here):

* Its process runs on this machine with the test's environment and user, ``python`` is the test's
  interpreter (it has torch and unbroken, as a training image would), no cgroups or limits. A process
  carries its pod's uid in ``POD_MARKER``: killing a pod kills every process with it, as a cgroup kill does.
* hostPath volumes live under ``workdir/nodes/<node>/``: a path under a hostPath mount in the command,
  args, env or workingDir is rewritten to it, so each node's ``/var/run/unbroken/agent.sock`` is its own.
  Other volumes are not mounted (pods get no service-account token files).
* Names: every pod shares 127.0.0.1. Each container runs in a mount namespace of its own (root only)
  whose ``/etc/hosts`` is this kubelet's hosts file, which maps every name cluster DNS would answer --
  Services (``name``, ``name.ns``, ``name.ns.svc``, ``name.ns.svc.cluster.local``), pods with a hostname in
  a headless Service's subdomain (JobSet's ``<pod>.<jobset>``), pods' own hostnames -- to 127.0.0.1 (the
  real kubelet also manages each pod's /etc/hosts). ``nslookup`` (training-operator's init container's busybox
  check) is a shim on PATH that asks the same hosts file (``getent hosts``).
"""

from __future__ import annotations

import contextlib
import datetime
import http.server
import json
import logging
import os
import platform
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import traceback
import urllib.parse
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import kubernetes
import psutil
import urllib3
from kubernetes.client.rest import ApiException

from controlplane.pki import KeyPair

log = logging.getLogger("process-kubelet")
Obj = dict[str, Any]

LOOPBACK = "127.0.0.1"
LEASE_RENEW_S = 1.0
NODE_STATUS_S = 10.0
"""How often the kubelet checks its Node's status (the real one's ``nodeStatusUpdateFrequency``): one that
another wrote NotReady (the node lifecycle controller, after an API-server outage longer than its grace
period) is posted Ready again, as the real kubelet's status loop does."""
"""Well inside the control plane's node-monitor grace period (cluster.NODE_GRACE_S)."""
POLL_S = 0.1
GRACE_CAP_S = 30
BACKOFF_FIRST_S, BACKOFF_CAP_S, BACKOFF_RESET_S = 1.0, 10.0, 20.0
LOG_TAIL_BYTES = 2048
CAPACITY = {"cpu": "32", "memory": "128Gi", "pods": "110", "ephemeral-storage": "100Gi"}
POD_MARKER = "UNBROKEN_TEST_KUBELET_POD"
"""In every container's environment: its pod's uid, the stand-in for the pod's cgroup."""
KUBELET_MARKER = "UNBROKEN_TEST_KUBELET"
"""In every container's environment: its kubelet's directory (tests side by side each have their own)."""


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _meta(obj: Obj) -> Obj:
    return obj.get("metadata") or {}


def _spec(obj: Obj) -> Obj:
    return obj.get("spec") or {}


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


_REFERENCE = re.compile(r"\$(\$|\(([A-Za-z_][A-Za-z0-9_.-]*)\))")


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: known names replaced, unknown ones kept, ``$$`` escapes a ``$``."""
    return _REFERENCE.sub(lambda m: "$" if m.group(1) == "$" else env.get(m.group(2), m.group(0)), text)


def _rewrite(value: str, mounts: list[tuple[str, Path]]) -> str:
    for mount_path, host in mounts:
        if value == mount_path or value.startswith(mount_path + "/"):
            return str(host) + value[len(mount_path):]
    return value


def _arch() -> str:
    machine = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def pod_processes(uid: str | None = None, *, kubelet: Path | None = None) -> list[psutil.Process]:
    """The live processes of the pod ``uid`` (None: of any pod of the process kubelet in directory ``kubelet``, or of
    any process kubelet's if None)."""
    found = []
    for process in psutil.process_iter(["environ", "status"]):
        environ = process.info.get("environ") or {}
        marker = environ.get(POD_MARKER)
        if marker is None or process.info.get("status") == psutil.STATUS_ZOMBIE:
            continue
        if (uid is None or marker == uid) and (kubelet is None or environ.get(KUBELET_MARKER) == str(kubelet)):
            found.append(process)
    return found


def _kill_pod_processes(uid: str) -> None:
    for process in pod_processes(uid):
        with contextlib.suppress(psutil.Error):
            process.kill()


class _CannotStart(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class _Node:
    name: str
    failed: bool = False
    boot_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    lease_renewed: float = 0.0
    status_synced: float = 0.0


@dataclass
class _Pod:
    """One pod this kubelet runs: which container runs now (an init container's index, or the main one), its
    process, and the states it reports."""

    namespace: str
    name: str
    uid: str
    node: str
    restart_policy: str
    started_at: str
    init_count: int = 0
    init_done: int = 0
    process: subprocess.Popen[bytes] | None = None
    pid: int | None = None
    run_started_at: str = ""
    run_started_mono: float = 0.0
    log_path: Path | None = None
    log_offset: int = 0
    restart_count: int = 0
    state: Obj = field(default_factory=dict)
    last_state: Obj = field(default_factory=dict)
    init_states: list[Obj] = field(default_factory=list)
    restart_at: float | None = None
    backoff_s: float = 0.0
    done: bool = False
    kill_at: float | None = None
    confirmed: bool = False
    written: Obj | None = None
    logs: dict[str, tuple[Path, int]] = field(default_factory=dict)
    """container name -> (file, offset where this pod's run of it began): what /containerLogs serves."""

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class ProcessKubelet:
    """Kubelets for every node it adds, their container runtime played by local processes (module docstring)."""

    def __init__(self, kubeconfig: Path, workdir: Path, serving: KeyPair) -> None:
        self.workdir = Path(workdir)
        for sub in ("logs", "nodes", "bin"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        self.errors: list[str] = []
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._closed = False
        self.client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        self.core = kubernetes.client.CoreV1Api(self.client)
        self._nodes: dict[str, _Node] = {}
        self._pods: dict[str, _Pod] = {}
        self.hosts_file = self.workdir / "hosts"
        self._hosts_text = ""
        self._write_hosts([], [])
        shim = self.workdir / "bin" / "nslookup"
        shim.write_text('#!/bin/sh\n# busybox nslookup, played by the pod\'s /etc/hosts\ngetent hosts "$1"\n')
        shim.chmod(0o755)
        self._server = self._serve_logs(serving)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._run, name="process-kubelet", daemon=True)
        self._thread.start()

    def __enter__(self) -> ProcessKubelet:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # ---------------------------------------------------------------- nodes

    def node_dir(self, name: str) -> Path:
        """The node's own directory: the root of its hostPath volumes."""
        path = self.workdir / "nodes" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def add_node(self, name: str, *, labels: dict[str, str] | None = None, allocatable: dict[str, str] | None = None,
                 taints: list[Obj] | None = None) -> None:
        node = _Node(name)
        body = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                                      "kubernetes.io/arch": _arch(), **(labels or {})}},
                "spec": {"taints": list(taints)} if taints else {}}
        self.node_dir(name)
        created = self.core.create_node(body, _preload_content=False)
        uid = json.loads(created.data)["metadata"]["uid"]
        resources = {**CAPACITY, **(allocatable or {})}
        self._patch(f"/api/v1/nodes/{name}/status", {"status": {
            "capacity": resources, "allocatable": resources, "conditions": self._conditions("True"),
            "addresses": [{"type": "InternalIP", "address": LOOPBACK}, {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.port}}, "nodeInfo": self._node_info(node)}})
        kubernetes.client.CoordinationV1Api(self.client).create_namespaced_lease("kube-node-lease", {
            "metadata": {"name": name, "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": name, "uid": uid}]},
            "spec": {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": _micro_now()}})
        with self._lock:
            node.lease_renewed = time.monotonic()
            self._nodes[name] = node

    @staticmethod
    def _conditions(ready: str) -> list[Obj]:
        now = _now()
        conditions = [{"type": kind, "status": "False", "reason": reason, "message": reason, "lastHeartbeatTime": now,
                       "lastTransitionTime": now}
                      for kind, reason in (("MemoryPressure", "KubeletHasSufficientMemory"),
                                           ("DiskPressure", "KubeletHasNoDiskPressure"),
                                           ("PIDPressure", "KubeletHasSufficientPID"))]
        return conditions + [{"type": "Ready", "status": ready, "reason": "KubeletReady",
                              "message": "kubelet is posting ready status", "lastHeartbeatTime": now,
                              "lastTransitionTime": now}]

    @staticmethod
    def _node_info(node: _Node) -> Obj:
        node_id = str(uuid.uuid5(uuid.NAMESPACE_DNS, node.name))
        return {"architecture": _arch(), "bootID": node.boot_id, "containerRuntimeVersion": "process://local",
                "kernelVersion": platform.release(), "kubeProxyVersion": "", "kubeletVersion": "v1.35.4-process-kubelet",
                "machineID": node_id.replace("-", ""), "operatingSystem": "linux", "osImage": "the test machine",
                "systemUUID": node_id}

    def fail_node(self, name: str) -> None:
        """The node loses power: its processes die, and its kubelet stops renewing the Lease and writing status.
        The real node lifecycle controller then marks it NotReady, taints it and evicts its pods."""
        with self._lock:
            self._nodes[name].failed = True
            for pod in self._pods.values():
                if pod.node == name:
                    self._kill(pod)
        log.info("node %s failed", name)

    def reboot_node(self, name: str) -> str:
        """The machine reboots: its pods' processes die, its kubelet comes back Ready on a new bootID (returned)."""
        with self._lock:
            node = self._nodes[name]
            for uid in [u for u, p in self._pods.items() if p.node == name]:
                self._kill(self._pods.pop(uid))
            node.failed, node.boot_id = False, str(uuid.uuid4())
            self._patch(f"/api/v1/nodes/{name}/status", {"status": {"conditions": self._conditions("True"),
                                                                    "nodeInfo": self._node_info(node)}})
            self._renew(node)
        log.info("node %s rebooted: bootID %s", name, node.boot_id)
        return node.boot_id

    # ---------------------------------------------------------------- for tests

    def pid_of(self, namespace: str, pod: str) -> int | None:
        """The main process of the pod ``namespace/pod``: of the newest pod of that name, where a pod deleted and
        made again under the same name (a workload's next attempt) still has processes terminating."""
        found = None
        with self._lock:
            for run in self._pods.values():  # in the order the pods were started
                if (run.namespace, run.name) == (namespace, pod) and run.running() and run.init_done >= run.init_count:
                    found = run.pid
        return found

    def log_path(self, namespace: str, pod: str) -> Path:
        found = sorted((self.workdir / "logs").glob(f"{namespace}_{pod}_*.log"))
        if not found:
            raise KeyError(f"no log for pod {namespace}/{pod}")
        return found[-1] if len(found) == 1 else next((p for p in found if "_init-" not in p.name), found[-1])

    def pods_on(self, node: str) -> list[str]:
        """Names of the pods bound to ``node`` (from the API), sorted."""
        pods = self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}").items
        return sorted(p.metadata.name for p in pods)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=30)
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            for pod in self._pods.values():
                self._kill(pod)
        self.client.close()

    # ---------------------------------------------------------------- the loop

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                try:
                    self._reconcile()
                except (urllib3.exceptions.MaxRetryError, urllib3.exceptions.ProtocolError) as exc:
                    # The API server cannot be reached, or went away mid-request (a test stopped it: the
                    # connection is reset): a kubelet retries, as the real one does.
                    log.warning("process kubelet: the API server is unreachable: %s", getattr(exc, "reason", exc))
                except Exception:  # noqa: BLE001 -- a kubelet keeps going; the test sees ``errors``
                    text = traceback.format_exc(limit=-2)
                    log.error("process kubelet: %s", text)
                    if text not in self.errors:
                        self.errors.append(text)
            self._stop.wait(POLL_S)

    def _reconcile(self) -> None:
        live = [n for n in self._nodes.values() if not n.failed]
        for node in live:
            if time.monotonic() - node.lease_renewed >= LEASE_RENEW_S:
                self._renew(node)
            if time.monotonic() - node.status_synced >= NODE_STATUS_S:
                self._sync_status(node)
        services = json.loads(self.core.list_service_for_all_namespaces(_preload_content=False).data)["items"]
        pods = json.loads(self.core.list_pod_for_all_namespaces(_preload_content=False,
                                                                field_selector="spec.nodeName!=").data)["items"]
        self._write_hosts(services, pods)
        present = {_meta(p)["uid"] for p in pods}
        for uid in [u for u in self._pods if u not in present]:
            self._kill(self._pods.pop(uid))  # gone from the API (force-deleted): nothing may keep running
        names = {n.name for n in live}
        for pod in pods:
            if _spec(pod).get("nodeName") in names:
                try:
                    self._sync(pod)
                except ApiException as e:
                    if e.status not in (404, 409):  # races with deletions and other writers: next round
                        raise

    def _sync_status(self, node: _Node) -> None:
        current = json.loads(self.core.read_node_status(node.name, _preload_content=False).data)
        ready = next((c for c in current.get("status", {}).get("conditions") or [] if c.get("type") == "Ready"), {})
        if ready.get("status") != "True":
            self._patch(f"/api/v1/nodes/{node.name}/status", {"status": {"conditions": self._conditions("True")}})
            log.info("node %s: posted Ready again (it read %s)", node.name, ready.get("status"))
        node.status_synced = time.monotonic()

    def _renew(self, node: _Node) -> None:
        self._patch(f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{node.name}",
                    {"spec": {"renewTime": _micro_now()}})
        node.lease_renewed = time.monotonic()

    def _write_hosts(self, services: list[Obj], pods: list[Obj]) -> None:
        """Every name cluster DNS would answer for a Service (``name[.ns[.svc[.cluster.local]]]``) or for a pod
        with a hostname in a headless Service's subdomain (``host.subdomain[.ns...]``, JobSet's pods), and each
        pod's own hostname: all 127.0.0.1."""
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        names = [(_meta(s)["name"], _meta(s)["namespace"]) for s in services]
        names += [(f"{_spec(p)['hostname']}.{_spec(p)['subdomain']}", _meta(p)["namespace"]) for p in pods
                  if _spec(p).get("hostname") and _spec(p).get("subdomain")]
        for name, namespace in names:
            lines.append(f"{LOOPBACK} {name} {name}.{namespace} {name}.{namespace}.svc {name}.{namespace}.svc.cluster.local")
        # A pod's processes run with this machine's hostname (no UTS namespace here), where a real pod's is its own
        # name, which the real kubelet writes into the pod's /etc/hosts; without it, gloo's lookup of the hostname
        # goes to DNS, which is not there, and each rank's process group waits 2 s for that to time out.
        hostnames = sorted({_spec(p).get("hostname") or _meta(p)["name"] for p in pods} | {socket.gethostname()})
        if hostnames:
            lines.append(f"{LOOPBACK} {' '.join(hostnames)}")
        text = "\n".join(lines) + "\n"
        if text != self._hosts_text:
            # In place, never replaced: each container's /etc/hosts is a bind mount of this very inode.
            with open(self.hosts_file, "a+") as hosts:
                hosts.seek(0)
                hosts.truncate()
                hosts.write(text)
            self._hosts_text = text

    def _patch(self, path: str, body: Obj) -> None:
        self.client.call_api(path, "PATCH", header_params={"Content-Type": "application/merge-patch+json"},
                             body=body, auth_settings=["BearerToken"], _preload_content=False)

    # ---------------------------------------------------------------- pods

    def _sync(self, pod: Obj) -> None:
        meta = _meta(pod)
        run = self._pods.get(meta["uid"])
        deleting = bool(meta.get("deletionTimestamp"))
        if run is None:
            if deleting:
                self._delete(pod)  # never ran here: nothing to stop
                return
            if (pod.get("status") or {}).get("phase") not in (None, "Pending"):
                return  # finished under a kubelet before this one (a reboot): not restarted
            run = _Pod(meta["namespace"], meta["name"], meta["uid"], _spec(pod)["nodeName"],
                       _spec(pod).get("restartPolicy") or "Always", _now(), len(_spec(pod).get("initContainers") or []))
            self._pods[meta["uid"]] = run
            self._start(run, pod)
        self._observe_exit(run, pod, deleting)
        if deleting:
            self._stop_for_deletion(run, pod)
            return
        if run.restart_at is not None and time.monotonic() >= run.restart_at:
            self._start(run, pod)
        status = self._status(run, pod)
        if status != run.written:
            self._patch(f"/api/v1/namespaces/{run.namespace}/pods/{run.name}/status", {"status": status})
            run.written = status

    def _container(self, run: _Pod, pod: Obj) -> Obj:
        """The container to run next: the next init container, else the first container."""
        inits = _spec(pod).get("initContainers") or []
        return inits[run.init_done] if run.init_done < len(inits) else _spec(pod)["containers"][0]

    def _start(self, run: _Pod, pod: Obj) -> None:
        run.restart_at = None
        spec = self._container(run, pod)
        try:
            argv, env, cwd = self._command(pod, spec, run.node)
        except _CannotStart as e:
            run.state = {"waiting": {"reason": e.reason, "message": str(e)}}
            return
        run.log_path = self.workdir / "logs" / f"{run.namespace}_{run.name}_{spec['name']}.log"
        run.log_offset = run.log_path.stat().st_size if run.log_path.exists() else 0
        run.logs.setdefault(spec["name"], (run.log_path, run.log_offset))
        run.run_started_at, run.run_started_mono, run.kill_at = _now(), time.monotonic(), None
        # A mount namespace of its own whose /etc/hosts is the kubelet's hosts file (Services -> 127.0.0.1).
        wrapper = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                   'mount --bind "$0" /etc/hosts && exec "$@"', str(self.hosts_file)]
        with open(run.log_path, "ab") as out:
            try:
                run.process = subprocess.Popen([*wrapper, *argv], cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                               stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as e:
                run.state = {"waiting": {"reason": "StartError", "message": str(e)}}
                return
        run.pid = run.process.pid
        run.state = {"running": {"startedAt": run.run_started_at}}
        log.info("started %s/%s (%s) on %s: pid %d", run.namespace, run.name, spec["name"], run.node, run.pid)

    def _command(self, pod: Obj, spec: Obj, node: str) -> tuple[list[str], dict[str, str], Path]:
        mounts = self._host_mounts(pod, spec, node)
        own = self._env(pod, spec, node)
        argv = [_rewrite(_expand(str(a), own), mounts) for a in [*(spec.get("command") or []), *(spec.get("args") or [])]]
        if not argv:
            raise _CannotStart("CreateContainerError", "the process kubelet runs a container's command and args; this one "
                                                       "has none (an image's entrypoint cannot run here)")
        path = os.pathsep.join((str(self.workdir / "bin"), str(Path(sys.executable).parent), os.environ.get("PATH", "")))
        env = {**os.environ, "PATH": path, **{k: _rewrite(v, mounts) for k, v in own.items()}, POD_MARKER: _meta(pod)["uid"],
               KUBELET_MARKER: str(self.workdir)}
        working = spec.get("workingDir")
        cwd = Path(_rewrite(working, mounts)) if working else None
        return argv, env, cwd if cwd is not None and cwd.is_dir() else self.node_dir(node)

    def _host_mounts(self, pod: Obj, spec: Obj, node: str) -> list[tuple[str, Path]]:
        volumes = {v.get("name"): v for v in _spec(pod).get("volumes") or []}
        mounts: list[tuple[str, Path]] = []
        for mount in spec.get("volumeMounts") or []:
            host_path = (volumes.get(mount.get("name")) or {}).get("hostPath")
            mount_path = (mount.get("mountPath") or "").rstrip("/")
            if not host_path or not mount_path:
                continue
            host = self.node_dir(node) / str(host_path.get("path") or "").lstrip("/")
            if mount.get("subPath"):
                host = host / mount["subPath"]
            is_file = host_path.get("type") in ("File", "FileOrCreate", "Socket", "CharDevice", "BlockDevice")
            (host.parent if is_file else host).mkdir(parents=True, exist_ok=True)
            mounts.append((mount_path, host))
        return sorted(mounts, key=lambda m: len(m[0]), reverse=True)

    def _env(self, pod: Obj, spec: Obj, node: str) -> dict[str, str]:
        if spec.get("envFrom"):
            raise _CannotStart("CreateContainerConfigError", "envFrom is not supported by the process kubelet")
        env: dict[str, str] = {}
        meta = _meta(pod)
        fields = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"), "metadata.uid": meta.get("uid"),
                  "spec.nodeName": node, "spec.serviceAccountName": _spec(pod).get("serviceAccountName") or "default",
                  "status.podIP": LOOPBACK, "status.hostIP": LOOPBACK, "status.podIPs": LOOPBACK, "status.hostIPs": LOOPBACK}
        for item in spec.get("env") or []:
            if "valueFrom" not in item:
                env[item["name"]] = _expand(str(item.get("value") or ""), env)
                continue
            path = (item["valueFrom"].get("fieldRef") or {}).get("fieldPath")
            if path in fields:
                env[item["name"]] = str(fields[path])
            elif path and (m := re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)):
                env[item["name"]] = str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
            else:
                raise _CannotStart("CreateContainerConfigError",
                                   f"the process kubelet does not support this env source: {json.dumps(item['valueFrom'])}")
        return env

    def _observe_exit(self, run: _Pod, pod: Obj, deleting: bool) -> None:
        process = run.process
        if process is None or process.poll() is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)  # what the container left behind dies with it, as with a cgroup
        _kill_pod_processes(run.uid)
        run.process = None
        code = _exit_code(process.returncode)
        terminated: Obj = {"exitCode": code, "reason": "Completed" if code == 0 else "Error", "startedAt": run.run_started_at,
                           "finishedAt": _now(), "containerID": f"process://{run.pid}"}
        if code != 0:
            terminated["message"] = self._log_tail(run)
        if process.returncode < 0:
            terminated["signal"] = -process.returncode
        inits = _spec(pod).get("initContainers") or []
        if run.init_done < len(inits) and code == 0 and not deleting:
            run.init_states.append({"terminated": terminated})
            run.init_done += 1
            self._start(run, pod)  # the next init container, or the main one
            return
        self._finish_run(run, terminated, deleting or (run.init_done < len(inits) and run.restart_policy == "Never"))

    def _log_tail(self, run: _Pod) -> str:
        if run.log_path is None:
            return ""
        with contextlib.suppress(OSError), open(run.log_path, "rb") as log_file:
            size = log_file.seek(0, os.SEEK_END)
            log_file.seek(max(run.log_offset, size - LOG_TAIL_BYTES))
            return log_file.read().decode(errors="replace")
        return ""

    @staticmethod
    def _finish_run(run: _Pod, terminated: Obj, final: bool) -> None:
        code, policy = terminated["exitCode"], run.restart_policy
        if final or policy == "Never" or (policy == "OnFailure" and code == 0):
            run.state, run.done = {"terminated": terminated}, True
            return
        ran = time.monotonic() - run.run_started_mono
        first = run.backoff_s == 0 or ran >= BACKOFF_RESET_S
        run.backoff_s = BACKOFF_FIRST_S if first else min(run.backoff_s * 2, BACKOFF_CAP_S)
        run.restart_count += 1
        run.last_state = {"terminated": terminated}
        run.restart_at = time.monotonic() + run.backoff_s
        run.state = {"waiting": {"reason": "CrashLoopBackOff",
                                 "message": f"back-off {run.backoff_s:g}s restarting failed container of pod {run.name}"}}

    def _stop_for_deletion(self, run: _Pod, pod: Obj) -> None:
        if run.running():
            assert run.process is not None
            if run.kill_at is None:
                grace = min(int(_meta(pod).get("deletionGracePeriodSeconds") or 0), GRACE_CAP_S)
                run.kill_at = time.monotonic() + grace
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(run.process.pid, signal.SIGTERM)
            elif time.monotonic() >= run.kill_at:
                self._kill(run)
            return
        if run.confirmed:
            return
        run.restart_at = None
        if not run.done:
            run.done = True
            if "terminated" in run.last_state:
                run.state = run.last_state
        status = self._status(run, pod)
        if status != run.written:
            self._patch(f"/api/v1/namespaces/{run.namespace}/pods/{run.name}/status", {"status": status})
        self._delete(pod)
        run.confirmed = True

    def _delete(self, pod: Obj) -> None:
        meta = _meta(pod)
        body = {"preconditions": {"uid": meta["uid"]}, "gracePeriodSeconds": 0}
        with contextlib.suppress(ApiException):
            self.core.delete_namespaced_pod(meta["name"], meta["namespace"], body=body, grace_period_seconds=0,
                                            _preload_content=False)

    @staticmethod
    def _kill(run: _Pod) -> None:
        process = run.process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        _kill_pod_processes(run.uid)

    def _status(self, run: _Pod, pod: Obj) -> Obj:
        spec = _spec(pod)
        inits = spec.get("initContainers") or []
        initialized = run.init_done >= len(inits)
        ready = initialized and "running" in run.state
        code = (run.state.get("terminated") or {}).get("exitCode")
        phase = ("Succeeded" if code == 0 else "Failed") if run.done else "Running" if initialized and (
            run.pid is not None or run.restart_count) else "Pending"
        conditions = [{"type": kind, "status": str(value), "lastTransitionTime": run.started_at}
                      for kind, value in (("PodReadyToStartContainers", True), ("Initialized", initialized),
                                          ("ContainersReady", ready), ("Ready", ready), ("PodScheduled", True))]
        main = spec["containers"]
        statuses = [{"name": c["name"], "image": c.get("image") or "", "imageID": "", "ready": False, "restartCount": 0,
                     "started": False, "state": {"waiting": {"reason": "PodInitializing" if not initialized else
                                                            "NotSupported"}}} for c in main]
        if initialized:
            statuses[0].update({"ready": ready, "started": ready, "restartCount": run.restart_count, "state": run.state,
                                "lastState": run.last_state, "containerID": f"process://{run.pid}" if run.pid else ""})
        init_statuses = []
        for index, container in enumerate(inits):
            state = run.init_states[index] if index < len(run.init_states) else run.state if index == run.init_done \
                else {"waiting": {"reason": "PodInitializing"}}
            init_statuses.append({"name": container["name"], "image": container.get("image") or "", "imageID": "",
                                  "ready": "terminated" in state, "restartCount": 0, "state": state})
        status: Obj = {"phase": phase, "hostIP": LOOPBACK, "hostIPs": [{"ip": LOOPBACK}], "podIP": LOOPBACK,
                       "podIPs": [{"ip": LOOPBACK}], "startTime": run.started_at, "conditions": conditions,
                       "containerStatuses": statuses}
        if inits:
            status["initContainerStatuses"] = init_statuses
        return status

    # ---------------------------------------------------------------- /containerLogs for the API server

    def _serve_logs(self, serving: KeyPair) -> http.server.ThreadingHTTPServer:
        kubelet = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 -- the stdlib's name
                url = urllib.parse.urlparse(self.path)
                parts = url.path.strip("/").split("/")
                if len(parts) != 4 or parts[0] != "containerLogs":
                    self.send_error(404, "the process kubelet serves /containerLogs only")
                    return
                query = urllib.parse.parse_qs(url.query)
                data = kubelet._logs(*parts[1:], tail=int(query.get("tailLines", ["-1"])[0]))
                if data is None:
                    self.send_error(404, f"no container {parts[3]} in pod {parts[1]}/{parts[2]}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 -- the stdlib's name
                log.debug(format, *args)

        server = http.server.ThreadingHTTPServer((LOOPBACK, 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(serving.cert, serving.key)
        server.socket = context.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, name="process-kubelet-logs", daemon=True).start()
        return server

    def _logs(self, namespace: str, pod: str, container: str, *, tail: int) -> bytes | None:
        with self._lock:
            run = next((r for r in self._pods.values() if (r.namespace, r.name) == (namespace, pod)), None)
            where = run.logs.get(container) if run is not None else None
        if where is None:
            return None
        path, offset = where
        with open(path, "rb") as file:
            file.seek(offset)
            data = file.read()
        if tail >= 0:
            data = b"".join(data.splitlines(keepends=True)[-tail:]) if tail else b""
        return data
