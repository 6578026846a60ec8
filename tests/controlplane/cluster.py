"""A real Kubernetes control plane on loopback, for the tests: ``with ControlPlane(workdir) as cp: ...``.

Started in order and waited for, each on its own loopback port, each with its log in ``workdir/logs``:

1. etcd (``/health``), ``--unsafe-no-fsync``: a test cluster needs no durability across power loss;
2. kube-apiserver (``/readyz``) with RBAC (``--authorization-mode=Node,RBAC``) and NodeRestriction, service-account signing
   keys and client certificates the fixture made (pki.py), short default tolerations of the
   not-ready/unreachable taints so that a dead node's pods are evicted within seconds;
3. kube-controller-manager (``/healthz``) with every default controller, per-controller service-account
   credentials and a short node-monitor grace period (``NODE_GRACE_S``): the node lifecycle
   controller marks a silent node NotReady/Unknown and taints it within seconds;
4. kube-scheduler (``/healthz``);
5. with ``kubeflow=True``: training-operator v1 (PyTorchJob only) with its CRD ``Established`` and its
   validating webhook registered; with ``trainer=True`` also JobSet (its defaulting webhook matters: its
   controller relies on fields only the webhook sets) and the Trainer v2 controller with its
   ``torch-distributed`` ClusterTrainingRuntime, each with its webhooks;
6. with ``kueue=True``: Kueue's controller manager (its CRDs, its webhooks, the PyTorchJob integration).

The Kubeflow controllers each run in a private mount namespace (root only) whose
``/tmp/k8s-webhook-server`` is their own folder: both write their serving certificates to that fixed
path, as each would in its own pod.

What is not here: a kubelet and a container runtime (tests/controlplane/kubelet.py plays them with
processes; tests/controlplane/node.py runs real ones, with a cluster DNS and kube-proxy).
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import yaml
from prometheus_client.parser import text_string_to_metric_families

from controlplane import components, pki
from unbroken.plumbing.waiting import WaitTimeout, wait_until

LOOPBACK = "127.0.0.1"
NODE_GRACE_S = 6
"""``--node-monitor-grace-period``: a node whose Lease is this old is NotReady (Kubernetes: 50 s)."""
TOLERATION_S = 2
"""Default ``tolerationSeconds`` of the not-ready/unreachable NoExecute taints (Kubernetes: 300 s)."""
START_TIMEOUT_S = 60.0
SERVICE_CIDR = "10.96.0.0/16"
KUBEFLOW_NAMESPACE = "kubeflow"
JOBSET_NAMESPACE = "jobset-system"
TRAINER_NAMESPACE = "kubeflow-system"
KUEUE_NAMESPACE = "kueue-system"
"""The namespaces JobSet, the Trainer and Kueue assume when not in a pod (their Secrets live there)."""


@dataclass(frozen=True)
class WebhookController:
    """A Kubeflow controller with webhooks: where cert-controller looks for its certificates, and its
    webhook configurations (manifest file -> {name in the file: name the controller injects its CA into})."""

    name: str
    namespace: str
    secret: str
    ca_name: str
    service: str
    port: int
    configurations: dict[Path, dict[str, str]]
    keep: Callable[[dict[str, Any]], bool] = lambda hook: True


_HANDED_OUT: set[int] = set()
"""Ports ``listen_port`` gave out in this process: never given twice, as a port given to one component is free until
it binds it (two components of one plane picking the same port, each free when checked, lost a scheduler once)."""


def listen_port() -> int:
    """A port free now for a component to listen on, below the kernel's ephemeral range.

    A port picked by binding port 0 lies inside that range, where any outgoing connection (a test's client, a
    pod's) may take it before the component binds it ("address already in use": CI lost a kube-scheduler that
    way); below the range only another listener can."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    low = max(1024, ephemeral_low - 12000)
    for _ in range(200):
        port = random.randrange(low, ephemeral_low)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((LOOPBACK, port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    raise ControlPlaneError(f"no free port to listen on in {low}-{ephemeral_low - 1}")


class ControlPlaneError(RuntimeError):
    pass


@dataclass
class Process:
    name: str
    command: list[str]
    log: Path
    env: dict[str, str]
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            out.write(f"\n=== {time.strftime('%H:%M:%S')} start: {' '.join(self.command)}\n".encode())
            out.flush()
            self.popen = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                          start_new_session=True)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        if self.popen is None:
            return
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGCONT)
            os.killpg(self.popen.pid, sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        self.popen = None

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def write_kubeconfig(path: Path, server: str, ca: Path, *, cert: pki.KeyPair | None = None, token: str | None = None,
                     user: str = "user") -> Path:
    auth: dict[str, Any] = {"token": token} if token else {"client-certificate": str(cert.cert), "client-key": str(cert.key)} \
        if cert else {}
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "test",
              "clusters": [{"name": "test", "cluster": {"server": server, "certificate-authority": str(ca)}}],
              "users": [{"name": user, "user": auth}],
              "contexts": [{"name": "test", "context": {"cluster": "test", "user": user}}]}
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


class Started:
    """``with X(...) as x:``: ``start()`` on entry (and ``stop()`` if it fails half-way), ``stop()`` on exit."""

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


class ControlPlane(Started):
    """etcd, kube-apiserver, kube-controller-manager, kube-scheduler (and Kubeflow's controllers) on loopback."""

    def __init__(self, workdir: Path, *, kubeflow: bool = True, trainer: bool = False, crds: bool = False,
                 kueue: bool = False, controllers: str = "*", address: str = LOOPBACK, init_image: str | None = None,
                 while_starting: Callable[[ControlPlane], None] | None = None) -> None:
        """``kubeflow``: training-operator runs; ``trainer``: JobSet and the Trainer too; ``crds``: only the
        Kubeflow CRDs are installed (PyTorchJob, TrainJob and its runtimes, JobSet), no controller: for tests of
        what unbroken writes to those objects. ``kueue``: Kueue's controller manager too, queueing PyTorchJobs (those
        labelled ``kueue.x-k8s.io/queue-name``). ``controllers``: the controller-manager's ``--controllers``
        (benchmarks/scale.py turns the node lifecycle controller off: its Nodes have no kubelet). ``address``: where the
        API server listens and what it advertises (the ``kubernetes`` Service's endpoint): loopback, unless pods in
        containers must reach it (node.ApiAddress gives one). ``init_image``: the image of the init container
        training-operator gives a PyTorchJob's workers (``nslookup`` of the master; its default, alpine:3.10, is on no
        registry here): for real nodes (image.busybox_image). ``while_starting``: called once the API server answers
        and every component has been launched, before their readiness is waited for (it must not create the
        objects their webhooks validate: PyTorchJobs, TrainJobs)."""
        self.controllers = controllers
        self.while_starting = while_starting
        self.address = address
        self.init_image = init_image
        needed = [components.ETCD, components.KUBERNETES] + [components.TRAINING_OPERATOR] * (kubeflow or trainer or crds) \
            + [components.TRAINER] * (trainer or crds) + [components.KUEUE] * kueue
        missing = [c for c in needed if not c.is_built()]
        if missing:
            raise ControlPlaneError("the control plane is not built: "
                                    + ", ".join(f"{c.name} {c.version}" for c in missing)
                                    + " (run `make control-plane`, or `python tests/controlplane/build.py`)")
        self.workdir = workdir
        self.kubeflow = kubeflow or trainer
        self.trainer = trainer
        self.kueue = kueue
        self.crds = crds
        (workdir / "logs").mkdir(parents=True, exist_ok=True)
        self.pki_dir = workdir / "pki"
        self.ca = pki.Authority(self.pki_dir)
        self.sa_keys = pki.service_account_keys(self.pki_dir)
        self.apiserver_port = listen_port()
        self.server = f"https://{address}:{self.apiserver_port}"
        self.etcd_port, self.etcd_peer_port = listen_port(), listen_port()
        self._issue_certificates()
        self.processes: dict[str, Process] = {}
        self.restarted: tuple[float, float] | None = None
        """Wall-clock seconds the last ``start_apiserver`` began and saw the server ready."""
        self.secure_ports = {"kube-controller-manager": listen_port(), "kube-scheduler": listen_port()}
        """Where the controller-manager and the scheduler serve /healthz."""
        self._define_processes()

    # ---------------------------------------------------------------- credentials and kubeconfigs

    def _issue_certificates(self) -> None:
        ca = self.ca
        self.serving = ca.issue("apiserver", common_name="kube-apiserver", server=True,
                                ips=tuple(dict.fromkeys((LOOPBACK, self.address, "10.96.0.1"))),
                                dns=("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                                     "kubernetes.default.svc.cluster.local"))
        self.kubelet_client = ca.issue("apiserver-kubelet-client", common_name="kube-apiserver-kubelet-client",
                                       organizations=("kubeadm:cluster-admins",), client=True)
        self.kubelet_serving = ca.issue("kubelet-serving", common_name="process-kubelet", server=True, ips=(LOOPBACK,),
                                        dns=("localhost",))
        self.admin_kubeconfig = self._client_kubeconfig("admin", "kubernetes-admin", ("system:masters",))
        self.controller_manager_kubeconfig = self._client_kubeconfig("controller-manager", "system:kube-controller-manager")
        self.scheduler_kubeconfig = self._client_kubeconfig("scheduler", "system:kube-scheduler")

    def _client_kubeconfig(self, name: str, user: str, groups: tuple[str, ...] = ()) -> Path:
        pair = self.ca.issue(name, common_name=user, organizations=groups, client=True)
        return write_kubeconfig(self.workdir / f"{name}.kubeconfig", self.server, self.ca.cert, cert=pair, user=user)

    @property
    def kubeconfig(self) -> Path:
        """The admin's (``system:masters``): what a test uses to set things up and look."""
        return self.admin_kubeconfig

    def token_kubeconfig(self, path: Path, token: str, user: str) -> Path:
        """A kubeconfig that authenticates with a bearer token (a ServiceAccount's)."""
        return write_kubeconfig(path, self.server, self.ca.cert, token=token, user=user)

    # ---------------------------------------------------------------- processes

    def _process(self, name: str, command: list[str], env: dict[str, str] | None = None) -> None:
        self.processes[name] = Process(name, command, self.workdir / "logs" / f"{name}.log",
                                       {**os.environ, **(env or {})})

    def _define_processes(self) -> None:
        etcd = components.ETCD.binary("etcd")
        kube = components.KUBERNETES
        peer = f"http://{LOOPBACK}:{self.etcd_peer_port}"
        client = f"http://{LOOPBACK}:{self.etcd_port}"
        self._process("etcd", [
            str(etcd), "--name", "default", "--data-dir", str(self.workdir / "etcd"), "--listen-client-urls", client,
            "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"default={peer}", "--unsafe-no-fsync", "--log-level", "warn"])
        pki_dir = self.pki_dir
        self._process("kube-apiserver", [
            str(kube.binary("kube-apiserver")), f"--etcd-servers={client}", f"--bind-address={self.address}",
            f"--advertise-address={self.address}", f"--secure-port={self.apiserver_port}", f"--cert-dir={pki_dir}",
            f"--tls-cert-file={self.serving.cert}", f"--tls-private-key-file={self.serving.key}",
            f"--client-ca-file={self.ca.cert}", "--authorization-mode=Node,RBAC",
            # NodeRestriction, as every managed cluster runs it (on top of the plugins on by default, which
            # include ValidatingAdmissionPolicy: deploy/admission/agent-policy.yaml relies on it)
            "--enable-admission-plugins=NodeRestriction",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={self.sa_keys.cert}",
            f"--service-account-signing-key-file={self.sa_keys.key}", f"--service-cluster-ip-range={SERVICE_CIDR}",
            # the ``kubernetes`` Service's endpoint is this address; loopback cannot be one
            "--allow-privileged=true", f"--endpoint-reconciler-type={'none' if self.address == LOOPBACK else 'lease'}",
            f"--kubelet-client-certificate={self.kubelet_client.cert}", f"--kubelet-client-key={self.kubelet_client.key}",
            f"--kubelet-certificate-authority={self.ca.cert}", "--kubelet-preferred-address-types=InternalIP",
            f"--default-not-ready-toleration-seconds={TOLERATION_S}",
            f"--default-unreachable-toleration-seconds={TOLERATION_S}", "--profiling=false"])
        self._process("kube-controller-manager", [
            str(kube.binary("kube-controller-manager")), f"--kubeconfig={self.controller_manager_kubeconfig}",
            f"--authentication-kubeconfig={self.controller_manager_kubeconfig}",
            f"--authorization-kubeconfig={self.controller_manager_kubeconfig}",
            "--leader-elect=false", f"--bind-address={LOOPBACK}", f"--secure-port={self.secure_ports['kube-controller-manager']}",
            f"--service-account-private-key-file={self.sa_keys.key}", f"--root-ca-file={self.ca.cert}",
            "--use-service-account-credentials=true", f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--node-monitor-period=1s", f"--node-monitor-grace-period={NODE_GRACE_S}s", "--node-startup-grace-period=20s",
            "--kube-api-qps=200", "--kube-api-burst=400", "--profiling=false", f"--controllers={self.controllers}"])
        self._process("kube-scheduler", [
            str(kube.binary("kube-scheduler")), f"--kubeconfig={self.scheduler_kubeconfig}",
            f"--authentication-kubeconfig={self.scheduler_kubeconfig}",
            f"--authorization-kubeconfig={self.scheduler_kubeconfig}",
            "--leader-elect=false", f"--bind-address={LOOPBACK}", f"--secure-port={self.secure_ports['kube-scheduler']}",
            "--profiling=false"])
        if self.kubeflow:
            self._define_training_operator()
        if self.trainer:
            self._define_trainer()
        if self.kueue:
            self._define_kueue()

    def _isolated(self, name: str, command: list[str]) -> list[str]:
        """``command`` in a mount namespace of its own whose /tmp/k8s-webhook-server is ``workdir/<name>``."""
        own = self.workdir / name / "k8s-webhook-server"
        own.mkdir(parents=True, exist_ok=True)
        script = 'mkdir -p /tmp/k8s-webhook-server && mount --bind "$0" /tmp/k8s-webhook-server && exec "$@"'
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(own), *command]

    def _define_training_operator(self) -> None:
        self.training_operator_webhook_port = listen_port()
        self.training_operator_probe_port = listen_port()
        command = [str(components.TRAINING_OPERATOR.binary("training-operator")), "--enable-scheme=pytorchjob",
                   f"--metrics-bind-address={LOOPBACK}:{listen_port()}",
                   f"--health-probe-bind-address={LOOPBACK}:{self.training_operator_probe_port}",
                   f"--webhook-server-port={self.training_operator_webhook_port}"]
        if self.init_image is not None:
            # training-operator's own template but for how the lookup is judged: busybox's nslookup fails when the name
            # is not found under one of the search domains, although it resolved under another
            template = self.workdir / "pytorch-init-container.yaml"
            template.write_text(
                "- name: init-pytorch\n  image: {{.InitContainerImage}}\n  imagePullPolicy: IfNotPresent\n"
                "  command: ['sh', '-c', 'err=1;for i in $(seq 100); do if nslookup {{.MasterAddr}} | grep -q Name:; then err=0 && break; fi;"
                "echo waiting for master; sleep 2; done; exit $err']\n")
            command += [f"--pytorch-init-container-image={self.init_image}",
                        f"--pytorch-init-container-template-file={template}"]
        self._process("training-operator", self._isolated("training-operator", command),
                      {"KUBECONFIG": str(self.admin_kubeconfig), "MY_POD_NAMESPACE": KUBEFLOW_NAMESPACE})

    def start(self) -> ControlPlane:
        started = time.monotonic()
        self._start("etcd", lambda: self._get(f"http://{LOOPBACK}:{self.etcd_port}/health", tls=False))
        self._start("kube-apiserver", lambda: self._get(f"{self.server}/readyz"))
        # What only needs the API is done while the controller-manager, the scheduler and training-operator come up
        # (2-3 s of every cluster's start, and the end-to-end tests start dozens): their readiness is waited for last.
        self._start("kube-controller-manager", None)
        self._start("kube-scheduler", None)
        last: list[tuple[str, Callable[[], bool]]] = [
            ("the controller-manager and the scheduler",
             lambda: self._healthy("kube-controller-manager") and self._healthy("kube-scheduler"))]
        if self.crds:
            self.install_crds()
        if self.kubeflow:
            last.append(("training-operator", self._start_training_operator()))
        if self.trainer:
            if not self.crds:
                self.install_crds()
            self._start_trainer()
        if self.kueue:
            self._start_kueue()
        if self.while_starting is not None:
            self.while_starting(self)
        for what, ready in last:
            self._wait(what, ready)
        self.ready_seconds = time.monotonic() - started
        return self

    def stop_apiserver(self) -> None:
        """An API-server outage: kube-apiserver SIGKILLed (a crash, or a server no client can reach); etcd,
        the controllers and every client keep running and retrying."""
        self.processes["kube-apiserver"].stop(signal.SIGKILL)

    def start_apiserver(self) -> None:
        """The API server back on its port, from the same etcd, waited for (``/readyz``); ``restarted`` says when."""
        started = time.time()
        self._start("kube-apiserver", lambda: self._get(f"{self.server}/readyz"))
        self.restarted = (started, time.time())

    def _start(self, name: str, ready: Callable[[], bool] | None) -> None:
        self.processes[name].start()
        if ready is not None:
            self._wait(name, ready)

    def _wait(self, what: str, ready: Callable[[], bool], timeout: float = START_TIMEOUT_S) -> None:
        """Until ``ready()``; a component that exits meanwhile fails at once, with its log's tail."""
        def probe() -> bool:
            for process in self.processes.values():
                if process.popen is not None and process.popen.poll() is not None:
                    raise ControlPlaneError(f"{process.name} exited with {process.popen.returncode} while waiting for "
                                            f"{what}; its log ends:\n{process.tail()}")
            try:
                return ready()
            except (OSError, urllib.error.URLError, ssl.SSLError):
                return False  # not listening yet
        try:
            wait_until(probe, timeout, what)
        except WaitTimeout:
            raise ControlPlaneError(f"{what} not ready within {timeout:.0f} s; logs:\n{self.logs_tail()}") from None

    def _healthy(self, name: str) -> bool:
        return self._get(f"https://{LOOPBACK}:{self.secure_ports[name]}/healthz", verify=False)

    def _get(self, url: str, *, tls: bool = True, verify: bool = True) -> bool:
        context = None
        if tls:
            context = ssl.create_default_context(cafile=str(self.ca.cert)) if verify else ssl._create_unverified_context()
            if verify:
                admin = self.pki_dir
                context.load_cert_chain(admin / "admin.crt", admin / "admin.key")
        with urllib.request.urlopen(url, timeout=2, context=context) as response:
            return bool(response.status == 200)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        """The real kubectl as the admin."""
        result = subprocess.run(["kubectl", f"--kubeconfig={self.admin_kubeconfig}", *args], input=input,
                                capture_output=True, text=True, timeout=60)
        if check and result.returncode != 0:
            raise ControlPlaneError(f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def requests_answered(self, verbs: Collection[str], resource: str | None = None) -> float:
        """Requests the API server has answered with one of ``verbs`` (``LIST``, ``PATCH``, ...; a watch is
        ``WATCH``), for ``resource`` or any: its own ``apiserver_request_total``."""
        return sum(sample.value for sample in self._metric_samples("apiserver_request_total")
                   if sample.labels.get("verb") in verbs and resource in (None, sample.labels.get("resource")))

    def response_bytes(self) -> float:
        """Bytes the API server has answered with, all requests but watch streams (``apiserver_response_sizes``)."""
        return sum(sample.value for sample in self._metric_samples("apiserver_response_sizes_sum"))

    def _metric_samples(self, name: str) -> list[Any]:
        text = self.kubectl("get", "--raw", "/metrics").stdout
        return [sample for family in text_string_to_metric_families(text) for sample in family.samples if sample.name == name]

    def apply(self, manifests: str | list[dict[str, Any]]) -> None:
        text = manifests if isinstance(manifests, str) else yaml.safe_dump_all(manifests)
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=text)

    def wait_established(self, *crds: str) -> None:
        """Until every CRD named is ``Established`` (served)."""
        def established(name: str) -> bool:
            crd = json.loads(self.kubectl("get", "crd", name, "-o", "json").stdout)
            return any(c["type"] == "Established" and c["status"] == "True"
                       for c in (crd.get("status") or {}).get("conditions") or [])
        self._wait(f"CRDs {', '.join(crds)} established", lambda: all(established(name) for name in crds))

    def install_crds(self) -> None:
        """PyTorchJob, TrainJob, (Cluster)TrainingRuntime and JobSet, from the pinned modules."""
        files = [components.TRAINING_OPERATOR.directory / "crds" / "kubeflow.org_pytorchjobs.yaml",
                 *sorted((components.TRAINER.directory / "trainer-crds").glob("*.yaml")),
                 *sorted((components.TRAINER.directory / "jobset-crds").glob("*.yaml"))]
        self.kubectl("apply", "--server-side", *[arg for f in files for arg in ("-f", str(f))])
        self.wait_established("pytorchjobs.kubeflow.org", "trainjobs.trainer.kubeflow.org",
                              "trainingruntimes.trainer.kubeflow.org", "clustertrainingruntimes.trainer.kubeflow.org",
                              "jobsets.jobset.x-k8s.io")

    def create_namespace(self, name: str) -> str:
        """A namespace, once its ``default`` ServiceAccount exists (the ServiceAccount admission plugin refuses a
        pod whose account is missing, and the controller-manager makes it a moment after the namespace)."""
        self.kubectl("create", "namespace", name)
        self._wait(f"namespace {name}'s default ServiceAccount",
                   lambda: self.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0)
        return name

    def _start_training_operator(self) -> Callable[[], bool]:
        """Started; returns its readiness probe."""
        if not self.crds:
            directory = components.TRAINING_OPERATOR.directory / "crds"
            self.kubectl("apply", "--server-side", "-f", str(directory / "kubeflow.org_pytorchjobs.yaml"))
            self.wait_established("pytorchjobs.kubeflow.org")
        self._webhook_controller(WebhookController(
            "training-operator", KUBEFLOW_NAMESPACE, "training-operator-webhook-cert", "training-operator-ca",
            "training-operator", self.training_operator_webhook_port,
            {components.TRAINING_OPERATOR.directory / "webhook" / "manifests.yaml":
             {"validating-webhook-configuration": "validator.training-operator.kubeflow.org"}},
            keep=lambda hook: "pytorchjob" in hook["name"]))  # only the PyTorchJob scheme runs
        self._start("training-operator", None)
        return lambda: self._get(f"http://{LOOPBACK}:{self.training_operator_probe_port}/readyz", tls=False)

    def _define_trainer(self) -> None:
        """JobSet and the Trainer, each from a configuration file of its own (their only way to be configured)."""
        trainer = components.TRAINER
        self.jobset_webhook_port, self.jobset_probe_port = listen_port(), listen_port()
        self.trainer_webhook_port, self.trainer_probe_port = listen_port(), listen_port()
        for name, port, probe in (("jobset", self.jobset_webhook_port, self.jobset_probe_port),
                                  ("trainer", self.trainer_webhook_port, self.trainer_probe_port)):
            config = {"apiVersion": "config.jobset.x-k8s.io/v1alpha1" if name == "jobset"
                      else "config.trainer.kubeflow.org/v1alpha1", "kind": "Configuration",
                      "health": {"healthProbeBindAddress": f"{LOOPBACK}:{probe}"},
                      "metrics": {"bindAddress": "0"}, "webhook": {"port": port, "host": LOOPBACK},
                      "leaderElection": {"leaderElect": False}}
            if name == "trainer":
                config["certManagement"] = {"enable": True}
            path = self.workdir / f"{name}-config.yaml"
            path.write_text(yaml.safe_dump(config))
            binary = trainer.binary("jobset" if name == "jobset" else "trainer-controller-manager")
            self._process(name, self._isolated(name, [str(binary), f"--config={path}",
                                                      f"--kubeconfig={self.admin_kubeconfig}"]))

    def _start_trainer(self) -> None:
        directory = components.TRAINER.directory
        self._webhook_controller(WebhookController(
            "jobset", JOBSET_NAMESPACE, "jobset-webhook-server-cert", "jobset-ca", "jobset-webhook-service",
            self.jobset_webhook_port,
            {directory / "jobset-webhook" / "manifests.yaml": {
                "validating-webhook-configuration": "jobset-validating-webhook-configuration",
                "mutating-webhook-configuration": "jobset-mutating-webhook-configuration"}}))
        self._start("jobset", lambda: self._get(f"http://{LOOPBACK}:{self.jobset_probe_port}/readyz", tls=False))
        self._webhook_controller(WebhookController(
            "trainer", TRAINER_NAMESPACE, "kubeflow-trainer-webhook-cert", "kubeflow-trainer-ca",
            "kubeflow-trainer-controller-manager", self.trainer_webhook_port,
            {directory / "trainer-webhook" / "manifests.yaml": {
                "validating-webhook-configuration": "validator.trainer.kubeflow.org",
                "mutating-webhook-configuration": "defaulter.trainer.kubeflow.org"}}))
        self._start("trainer", lambda: self._get(f"http://{LOOPBACK}:{self.trainer_probe_port}/readyz", tls=False))
        # the runtime Kubeflow ships for torchrun jobs, as its installation applies it
        self.kubectl("apply", "--server-side", "-f", str(directory / "trainer-runtimes" / "torch_distributed.yaml"))

    def _define_kueue(self) -> None:
        """Kueue's controller manager, from a configuration file (its only way to be configured): the PyTorchJob
        integration only, no leader election, its webhooks on loopback, its on-demand visibility API server off
        (an aggregated API the tests do not read)."""
        self.kueue_webhook_port, self.kueue_probe_port = listen_port(), listen_port()
        config = {"apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration", "namespace": KUEUE_NAMESPACE,
                  "health": {"healthProbeBindAddress": f"{LOOPBACK}:{self.kueue_probe_port}"}, "metrics": {"bindAddress": "0"},
                  "webhook": {"port": self.kueue_webhook_port, "host": LOOPBACK}, "leaderElection": {"leaderElect": False},
                  "internalCertManagement": {"enable": True, "webhookServiceName": "kueue-webhook-service",
                                             "webhookSecretName": "kueue-webhook-server-cert"},
                  "integrations": {"frameworks": ["kubeflow.org/pytorchjob"]}}
        path = self.workdir / "kueue-config.yaml"
        path.write_text(yaml.safe_dump(config))
        self._process("kueue", self._isolated("kueue", [
            str(components.KUEUE.binary("kueue")), f"--config={path}", "--feature-gates=VisibilityOnDemand=false"]),
            {"KUBECONFIG": str(self.admin_kubeconfig)})

    def _start_kueue(self) -> None:
        directory = components.KUEUE.directory
        self.kubectl("apply", "--server-side", *[arg for f in sorted((directory / "crds").glob("*.yaml")) for arg in ("-f", str(f))])
        self.wait_established("workloads.kueue.x-k8s.io", "clusterqueues.kueue.x-k8s.io", "localqueues.kueue.x-k8s.io",
                              "resourceflavors.kueue.x-k8s.io")
        kept = ("pytorchjob", "workload", "clusterqueue", "localqueue", "resourceflavor", "cohort")
        bundle = self._webhook_controller(WebhookController(
            "kueue", KUEUE_NAMESPACE, "kueue-webhook-server-cert", "kueue-ca", "kueue-webhook-service", self.kueue_webhook_port,
            {directory / "webhook" / "manifests.yaml": {
                "mutating-webhook-configuration": "kueue-mutating-webhook-configuration",
                "validating-webhook-configuration": "kueue-validating-webhook-configuration"}},
            keep=lambda hook: any(f"{k}.kb.io" == hook["name"][1:] for k in kept)))
        # Kueue's cert-controller also injects its CA into the conversion webhooks of its CRDs (its install patches
        # them so) and is not ready until it has: the same conversion, pointed at 127.0.0.1.
        for crd in ("clusterqueues", "cohorts", "localqueues", "multikueueclusters", "resourceflavors", "workloads"):
            conversion = {"strategy": "Webhook", "webhook": {"conversionReviewVersions": ["v1"], "clientConfig": {
                "url": f"https://{LOOPBACK}:{self.kueue_webhook_port}/convert", "caBundle": bundle}}}
            self.kubectl("patch", "crd", f"{crd}.kueue.x-k8s.io", "--type=merge", "-p", json.dumps({"spec": {"conversion": conversion}}))
        self._start("kueue", lambda: self._get(f"http://{LOOPBACK}:{self.kueue_probe_port}/readyz", tls=False))

    def _webhook_controller(self, controller: WebhookController) -> str:
        """What a Kubeflow controller's cert-controller would make itself, made beforehand: a CA of its name and a
        serving certificate for its Service that also names 127.0.0.1 (the address the API server is given). The
        Secret holds them (cert-controller keeps valid certificates it finds), the files its pod's Secret volume
        would hold are written (cert-controller waits for them; the webhook server reads them), and its webhook
        configurations (its module's manifests) point at 127.0.0.1. Returns the CA bundle (base64), for what else
        points at the controller (CRD conversion webhooks)."""
        home = self.workdir / controller.name
        authority = pki.Authority(home / "pki", controller.ca_name, named=True)
        serving = authority.issue("webhook", common_name=controller.service, server=True, ips=(LOOPBACK,),
                                  dns=(f"{controller.service}.{controller.namespace}.svc",))
        files = {"ca.crt": authority.cert.read_text(), "ca.key": authority.key.read_text(),
                 "tls.crt": serving.cert.read_text(), "tls.key": serving.key.read_text()}
        certs = home / "k8s-webhook-server" / "serving-certs"
        certs.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (certs / name).write_text(text)
        bundle = base64.b64encode(authority.cert_pem).decode()
        configurations = []
        for source, renames in controller.configurations.items():
            for configuration in (d for d in yaml.safe_load_all(source.read_text()) if d):
                configuration["metadata"] = {"name": renames[configuration["metadata"]["name"]]}
                hooks = [h for h in configuration["webhooks"] if controller.keep(h)]
                for hook in hooks:
                    path = hook["clientConfig"]["service"]["path"]
                    hook["clientConfig"] = {"url": f"https://{LOOPBACK}:{controller.port}{path}", "caBundle": bundle}
                configurations.append({**configuration, "webhooks": hooks})
        self.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": controller.namespace}},
                    {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                     "metadata": {"name": controller.secret, "namespace": controller.namespace}, "stringData": files},
                    *configurations])
        return bundle

    def stop(self) -> None:
        """SIGKILL, newest first: a test's control plane keeps nothing worth a graceful shutdown (etcd runs
        without fsync, the cluster is thrown away), and graceful ones cost seconds per test."""
        for process in reversed(list(self.processes.values())):
            process.stop(signal.SIGKILL)

    def logs_tail(self, lines: int = 20) -> str:
        return "\n".join(f"--- {p.name} ({p.log}):\n{p.tail(lines)}" for p in self.processes.values() if p.log.exists())



def main() -> None:
    """``python -m controlplane.cluster DIR``: run a control plane until Ctrl-C (to poke at it with kubectl)."""
    import sys

    workdir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/unbroken-control-plane")
    shutil.rmtree(workdir, ignore_errors=True)
    with ControlPlane(workdir) as plane:
        print(json.dumps({"kubeconfig": str(plane.kubeconfig), "ready_seconds": round(plane.ready_seconds, 1)}), flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
