"""A real Kubernetes node on this machine: containerd, runc and the kubelet, joined to the test control plane.

``with RealNode(plane, "node-a", index=1, workdir=...) as node:`` starts, as a node's boot does:

1. **Network**: a veth pair whose first end holds the node's IP (``10.99.<index>.2``; the kubelet needs an
   address that is not loopback, and this machine's kernel has no dummy links), and the pod subnet
   ``10.88.<index>.0/24`` behind a bridge the CNI bridge plugin makes (``ubpods<index>``, host-local IPAM). Every
   node's bridge is in this machine's network namespace, so pods on different nodes reach each other through
   its routing table, as through a cluster's pod network.
2. **A mount namespace of the node's own**, where everything below runs: its ``/var/lib/kubelet`` is the node's
   (the kubelet's device manager uses that path whatever its root directory), and the containers' root
   filesystems, the kubelet's volume mounts and the pods' network-namespace mounts die with the node.
3. **containerd** (v2, built from its Go module) with its own root, state, socket, CNI configuration and the
   sandbox image pinned; runc is Debian's, through ``runc-oom-floor`` (below). The images the test asks for
   are imported (``ctr images import``); pods name them with ``imagePullPolicy: Never``: no registry here.
4. **The kubelet** (built from the control plane's Kubernetes module) with cgroup v1 and the cgroupfs driver
   under a cgroup root of its own (``/unbroken-<name>``), its own root directory, pod-log directory and ports,
   a client certificate of ``system:node:<name>`` (so NodeRestriction applies to it) and a serving
   certificate for its IP from the control plane's CA (the API server verifies it: ``kubectl logs``/``exec``
   go API server -> kubelet over TLS). Only clients with a certificate from that CA may talk to it; once
   authenticated, any is allowed (``AlwaysAllow``; a cluster would ask the API server with a webhook).

With ``gpus=N``, a device plugin offers N fake ``nvidia.com/gpu`` through the kubelet's device-plugin API, as
NVIDIA's does (the node's capacity, the scheduler's accounting, ``NVIDIA_VISIBLE_DEVICES`` in the container);
no device is behind them.

``fail()`` is a node lost at once: its kubelet, containerd, shims and every container SIGKILLed, its
network cut. ``stop()`` (and ``__exit__``) leaves nothing behind: containers, mounts, the pods' network
namespaces (under the node's state directory), links and cgroups; ``clean_leftovers`` does the same for
a node a killed test run left.

Two things this machine refuses, and what stands in:

* It has no ``CAP_SYS_RESOURCE``, so runc cannot lower a process's ``oom_score_adj`` below this machine's
  own (the kubelet asks -998 for the pause container, and runc fails with "can't get final child's PID
  from pipe"). ``runc-oom-floor`` raises a container's ``oomScoreAdj`` to the floor and runs runc; nothing
  else about the container changes.
* No registry: images are built here (image.py) and imported.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import yaml

from controlplane import components, image
from controlplane.cluster import ControlPlane, ControlPlaneError, Process, Started, listen_port, write_kubeconfig
from unbroken.plumbing.waiting import WaitTimeout, wait_until

RUNC = "/usr/sbin/runc"
CNI_PLUGINS = "/usr/lib/cni"
CGROUP_ROOT = Path("/sys/fs/cgroup")
START_TIMEOUT_S = 60.0
RUN_ROOT = Path("/run/unbroken-nodes")
POD_CIDRS = "10.88.0.0/16"
"""Every node's pod subnet (10.88.<index>.0/24) is in it."""
NODE_LOCAL = ("/run/unbroken", "/dev/shm/unbroken", "/var/lib/unbroken")
"""The host folders deploy/'s agent DaemonSet mounts (``/var/run`` is ``/run``): each node has its own."""
CLUSTER_DNS_IP = "10.96.0.10"
"""kubeadm's choice: the tenth address of the Service range (cluster.SERVICE_CIDR)."""
RUNC_OOM_FLOOR = f'''#!{sys.executable}
# runc, with a container's oomScoreAdj raised to this machine's floor (no CAP_SYS_RESOURCE to go below it)
import json, os, sys
args = sys.argv[1:]
if "create" in args or "run" in args:
    flag = "--bundle" if "--bundle" in args else "-b" if "-b" in args else None
    path = os.path.join(args[args.index(flag) + 1] if flag else ".", "config.json")
    with open(path) as f:
        spec = json.load(f)
    with open("/proc/self/oom_score_adj") as f:
        floor = int(f.read())
    if spec.get("process", {{}}).get("oomScoreAdj", floor) < floor:
        spec["process"]["oomScoreAdj"] = floor
        with open(path, "w") as f:
            json.dump(spec, f)
os.execv("{RUNC}", ["runc", *args])
'''


class NodeError(ControlPlaneError):
    pass


def _run(*command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, capture_output=True, text=True)
    if check and result.returncode:
        raise NodeError(f"`{' '.join(command)}` exited {result.returncode}: {result.stderr.strip()}")
    return result


def missing_prerequisites() -> list[str]:
    """What this machine lacks to run a real node (root, runc, the CNI plugins, the built binaries), said."""
    missing = [] if os.geteuid() == 0 else ["root (network links, mounts and cgroups)"]
    missing += [f"{path} (apt-get install {package})" for path, package in
                ((RUNC, "runc"), (f"{CNI_PLUGINS}/bridge", "containernetworking-plugins"))
                if not os.path.exists(path)]
    missing += [f"{c.name} {c.version} (make control-plane)" for c in components.NODE if not c.is_built()]
    return missing


class RealNode(Started):
    def __init__(self, plane: ControlPlane, name: str, index: int, workdir: Path,
                 images: tuple[image.Image, ...] = (), gpus: int = 0, dns: ClusterDNS | None = None,
                 instance_type: str = "cpu-dev") -> None:
        """``gpus``: fake ``nvidia.com/gpu`` devices offered through the kubelet's device-plugin API
        (kubernetes/fake-gpu-plugin/main.go), IDs ``GPU-<name>-<i>``. ``dns``: the cluster DNS the kubelet gives
        its pods (``clusterDNS``). ``instance_type``: the node's ``node.kubernetes.io/instance-type`` label, which a
        cloud's kubelet sets (unbroken's agent picks its health profile by it; cpu-dev: the checks a CPU node can
        pass)."""
        self.dns = dns
        self.instance_type = instance_type
        if not 1 <= index <= 200:
            raise ValueError(f"node index {index}: 1 to 200 (it names the node's subnets)")
        self.plane, self.name, self.index = plane, name, index
        self.dir = workdir / name
        self.ip = f"10.99.{index}.2"
        self.pod_cidr = f"10.88.{index}.0/24"
        self.link, self.bridge = f"ubnode{index}", f"ubpods{index}"
        self.cgroup = f"unbroken-{name}"
        self.images = images
        self.gpus = gpus
        self.run_dir = RUN_ROOT / name
        """containerd's sockets and the kubelet's root directory (its pod-resources and device-plugin sockets): a unix
        socket's path has at most 104 bytes, too few for a test's temporary folder."""
        self.socket = self.run_dir / "containerd.sock"
        self.processes: dict[str, Process] = {}
        self.enter: list[str] = []
        self.kernel_log: KernelLog | None = None
        """The node's own ``/dev/kmsg`` (``write_kernel_log``), from its start."""

    # ---------------------------------------------------------------- start

    def start(self) -> RealNode:
        missing = missing_prerequisites()
        if missing:
            raise NodeError("a real node needs " + "; ".join(missing))
        clean_leftovers(self.name, self.index, self.dir)
        self.run_dir.mkdir(parents=True)
        for folder in ("logs", "containerd", "cni/ipam", "kubelet/pki", "pod-logs"):
            (self.dir / folder).mkdir(parents=True, exist_ok=True)
        self._network()
        self._cgroups()
        self._start_mount_namespace()
        self._start_containerd()
        for each in (image.pause_image(), *self.images):
            self.ctr("images", "import", "--local", str(each.archive))
        self._start_kubelet()
        self._own_kernel_log()
        return self

    def _own_kernel_log(self) -> None:
        """The node's own ``/dev/kmsg`` from now on, for what opens it later (the agents' pods). Not before the
        kubelet: its OOM watcher reads ``/dev/kmsg`` too, and a pseudo-terminal gives each line to one reader, where
        the kernel's gives every record to every reader; the kubelet keeps the machine's."""
        self.kernel_log = KernelLog()
        _run(*self.enter, "mount", "--bind", self.kernel_log.path, "/dev/kmsg")

    def _network(self) -> None:
        _run("ip", "link", "add", self.link, "type", "veth", "peer", "name", f"{self.link}p")
        _run("ip", "addr", "add", f"{self.ip}/24", "dev", self.link)
        _run("ip", "link", "set", self.link, "up")
        _run("ip", "link", "set", f"{self.link}p", "up")
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1")  # pods of one node reach another's, through here

    def _cgroups(self) -> None:
        """The kubelet's cgroup root in every v1 hierarchy; cpuset's needs its parent's cpus and mems first."""
        for hierarchy in _hierarchies():
            path = hierarchy / self.cgroup
            path.mkdir(exist_ok=True)
            for name in ("cpuset.cpus", "cpuset.mems"):
                if (hierarchy / name).exists():
                    (path / name).write_text((hierarchy / name).read_text())

    def _start_mount_namespace(self) -> None:
        """The node's own mount namespace, held by a process that waits, for containerd, its shims, the kubelet and
        the device plugin: its ``/var/lib/kubelet`` is the node's (the kubelet's device manager serves its socket
        and writes its checkpoint at ``/var/lib/kubelet/device-plugins/`` whatever its root directory: two nodes
        would share both), and the containers' root filesystems, the kubelet's volume mounts and the pods'
        network-namespace mounts live and die with it. Mounts of this machine still reach it (``slave``), so
        hostPath volumes see what the test writes. The host folders unbroken's DaemonSet mounts (``NODE_LOCAL``) are
        the node's own too, as on separate machines: ``self.host_path(...)`` is where this machine sees them. So is
        its ``/dev/kmsg`` (``KernelLog``): an Xid written there is this node's alone."""
        binds = []
        for target in ("/var/lib/kubelet", *NODE_LOCAL):
            own = self.host_path(target)
            own.mkdir(parents=True)
            Path(target).mkdir(parents=True, exist_ok=True)  # the mount point, empty on this machine
            binds.append(f'mount --bind "{own}" "{target}"')
        script = " && ".join([*binds, "echo mounted", "exec sleep infinity"])
        holder = Process("mount-namespace", ["unshare", "--mount", "--propagation", "slave", "sh", "-c", script],
                         self.dir / "logs" / "mount-namespace.log", dict(os.environ))
        self.processes["mount-namespace"] = holder
        holder.start()
        self._wait("the node's mount namespace", lambda: "mounted" in holder.tail())
        assert holder.popen is not None
        self.enter = ["nsenter", f"--mount=/proc/{holder.popen.pid}/ns/mnt", "--"]

    def host_path(self, path: str) -> Path:
        """Where this machine sees the node's ``/var/lib/kubelet`` or one of its ``NODE_LOCAL`` folders."""
        return self.run_dir / "host" / path.strip("/").replace("/", "-")

    def _start_containerd(self) -> None:
        wrapper = self.dir / "runc-oom-floor"
        wrapper.write_text(RUNC_OOM_FLOOR)
        wrapper.chmod(0o755)
        state = self.dir / "containerd"
        (self.dir / "cni" / "10-pods.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "pods", "plugins": [
                {"type": "bridge", "bridge": self.bridge, "isGateway": True, "ipMasq": False,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": self.pod_cidr}]],
                          "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(self.dir / "cni" / "ipam")}},
                {"type": "loopback"}]}))
        config = f'''version = 3
root = "{state}/root"
state = "{state}/state"
[grpc]
  address = "{self.socket}"
[ttrpc]
  address = "{self.socket}.ttrpc"
[plugins."io.containerd.cri.v1.runtime"]
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "{wrapper}"
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{CNI_PLUGINS}"]
    conf_dir = "{self.dir / 'cni'}"
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{image.PAUSE_REF}"
'''
        (state / "config.toml").write_text(config)
        binary = components.CONTAINERD.binary("containerd")
        env = {**os.environ, "PATH": f"{binary.parent}:{os.environ.get('PATH', '')}"}  # its shim, by name
        self._process("containerd", [str(binary), "--config", str(state / "config.toml")], env)
        self._wait("containerd", lambda: self.ctr("version", check=False).returncode == 0)

    def _start_kubelet(self) -> None:
        kubelet = self.dir / "kubelet"
        serving = self.plane.ca.issue(f"kubelet-{self.name}", common_name=f"system:node:{self.name}", server=True,
                                      ips=(self.ip,), dns=(self.name,))
        client = self.plane.ca.issue(f"node-{self.name}", common_name=f"system:node:{self.name}",
                                     organizations=("system:nodes",), client=True)
        kubeconfig = write_kubeconfig(kubelet / "kubeconfig", self.plane.server, self.plane.ca.cert, cert=client,
                                      user=f"system:node:{self.name}")
        self.kubelet_port = 10250 + self.index * 10  # each node's own, on its own IP
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "failCgroupV1": False, "cgroupDriver": "cgroupfs", "cgroupRoot": f"/{self.cgroup}",
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "address": self.ip, "port": self.kubelet_port, "healthzBindAddress": "127.0.0.1",
            "healthzPort": listen_port(), "readOnlyPort": 0,
            "tlsCertFile": str(serving.cert), "tlsPrivateKeyFile": str(serving.key),
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                               "x509": {"clientCAFile": str(self.plane.ca.cert)}},
            "authorization": {"mode": "AlwaysAllow"},
            "podLogsDir": str(self.dir / "pod-logs"), "volumePluginDir": str(kubelet / "volume-plugins"),
            "clusterDomain": "cluster.local", "failSwapOn": False,
            **({"clusterDNS": [CLUSTER_DNS_IP]} if self.dns else {}),
            # a test machine's disk and memory are shared by every node on it: no eviction, no image GC
            "evictionHard": {}, "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "enforceNodeAllocatable": [], "localStorageCapacityIsolation": False, "makeIPTablesUtilChains": False,
            # the Lease renewed every 2 s (a quarter of its duration): within the control plane's short grace
            # (cluster.NODE_GRACE_S) on a loaded machine, where the default 10 s would read as a lost node
            "nodeStatusReportFrequency": "10s", "nodeStatusUpdateFrequency": "2s", "nodeLeaseDurationSeconds": 8,
            "maxPods": 20, "podPidsLimit": -1, "serializeImagePulls": False,
        }
        (kubelet / "config.yaml").write_text(yaml.safe_dump(config))
        self._process("kubelet", [
            str(components.KUBELET.binary("kubelet")), f"--config={kubelet / 'config.yaml'}",
            f"--kubeconfig={kubeconfig}", f"--root-dir={self.run_dir / 'kubelet'}", f"--cert-dir={kubelet / 'pki'}",
            f"--hostname-override={self.name}", f"--node-ip={self.ip}",
            f"--node-labels={','.join(f'{k}={v}' for k, v in self.labels().items())}", "--v=1"])
        self._wait("the kubelet's node Ready", self.ready)
        if self.gpus:
            self._process("fake-gpu-plugin", [
                str(components.KUBELET.binary("fake-gpu-plugin")), f"--count={self.gpus}", f"--id-prefix=GPU-{self.name}"])
            self._wait(f"{self.gpus} nvidia.com/gpu allocatable", lambda: self.allocatable().get("nvidia.com/gpu") == str(self.gpus))

    def labels(self) -> dict[str, str]:
        """What a cloud's kubelet and NVIDIA's GPU feature discovery label a node with (deploy/overlays/gpu selects
        ``nvidia.com/gpu.present``)."""
        return {"node.kubernetes.io/instance-type": self.instance_type, **({"nvidia.com/gpu.present": "true"} if self.gpus else {})}

    def _process(self, name: str, command: list[str], env: dict[str, str] | None = None) -> None:
        """``command`` started in the node's mount namespace."""
        process = Process(name, [*self.enter, *command], self.dir / "logs" / f"{name}.log", env or dict(os.environ))
        self.processes[name] = process
        process.start()

    def _wait(self, what: str, ready: Callable[[], bool]) -> None:
        try:
            wait_until(_while_running(self.processes.values(), f"{self.name}: {what}", ready), START_TIMEOUT_S, what)
        except WaitTimeout:
            raise NodeError(f"{self.name}: {what} not within {START_TIMEOUT_S:.0f} s; logs:\n"
                            + "\n".join(f"--- {p.name}\n{p.tail()}" for p in self.processes.values())) from None

    # ---------------------------------------------------------------- use

    def write_kernel_log(self, message: str) -> None:
        """A kernel message in this node's ``/dev/kmsg`` (what the GPU driver writes for an Xid)."""
        assert self.kernel_log is not None, "the node has not started"
        self.kernel_log.write(message)

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``ctr`` against this node's containerd, in the CRI's namespace (``k8s.io``)."""
        return _run(*self.enter, str(components.CONTAINERD.binary("ctr")), "--address", str(self.socket),
                    "--namespace", "k8s.io", *args, check=check)

    def ready(self) -> bool:
        result = self.plane.kubectl("get", "node", self.name, "-o", "json", check=False)
        if result.returncode:
            return False
        conditions = json.loads(result.stdout)["status"].get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def allocatable(self) -> dict[str, str]:
        node = json.loads(self.plane.kubectl("get", "node", self.name, "-o", "json").stdout)
        return dict(node["status"].get("allocatable", {}))

    # ---------------------------------------------------------------- end

    def fail(self) -> None:
        """The node lost at once: everything on it SIGKILLed, its link down. The Node object stays, going
        NotReady as the node lifecycle controller notices (cluster.NODE_GRACE_S)."""
        for process in self.processes.values():
            process.stop(signal.SIGKILL)
        _kill_node_processes(self.name, self.dir)
        _run("ip", "link", "set", self.link, "down", check=False)

    def stop(self) -> None:
        """The kubelet, then containerd, then whatever is left (containers, mounts, links, cgroups)."""
        for name in ("fake-gpu-plugin", "kubelet", "containerd", "mount-namespace"):
            if name in self.processes:
                self.processes.pop(name).stop()
        if self.kernel_log is not None:
            self.kernel_log.close()
            self.kernel_log = None
        clean_leftovers(self.name, self.index, self.dir)


class KernelLog:
    """A node's own kernel log: a pseudo-terminal whose terminal end is bound over ``/dev/kmsg`` in the node's mount
    namespace, so that the agent's hostPath ``/dev/kmsg`` (deploy/overlays/gpu: ``type: CharDevice``) is a character
    device that gives one record a read, ``pri,seq,ts,flags;message``, as the kernel's does. Every node on this
    machine shares one kernel, whose real ring buffer would tell an Xid to every node's agent at once. Unlike the
    kernel's, it cannot seek (the agent reads it from where it opens it) and holds no history."""

    def __init__(self) -> None:
        self.writer, self._terminal = os.openpty()
        attributes = termios.tcgetattr(self._terminal)
        attributes[3] &= ~(termios.ECHO | termios.ECHONL)  # lflag: nothing echoed back; ICANON kept: a line a read
        termios.tcsetattr(self._terminal, termios.TCSANOW, attributes)
        self.path = os.ttyname(self._terminal)
        self._sequence = 0

    def write(self, message: str, priority: int = 3) -> None:
        self._sequence += 1
        os.write(self.writer, f"{priority},{self._sequence},{time.monotonic_ns() // 1000},-;{message}\n".encode())

    def close(self) -> None:
        os.close(self.writer)
        os.close(self._terminal)


class ClusterDNS(Started):
    """The cluster's DNS, as CoreDNS serves it on a cluster (its kubernetes plugin, zone ``cluster.local``):
    Services, a headless Service's pods and a pod's ``hostname.subdomain`` resolve to pod IPs. It runs as a
    process of this machine answering at ``CLUSTER_DNS_IP`` (the address of a link of its own: every node's pods
    reach this machine through their bridge), not as a Deployment behind a ClusterIP: it then needs neither the
    image nor kube-proxy to be up first. It reads the API with the admin's credentials."""

    LINK = "ubdns"

    def __init__(self, plane: ControlPlane, workdir: Path) -> None:
        self.plane, self.dir = plane, workdir / "cluster-dns"
        self.process: Process | None = None

    def start(self) -> ClusterDNS:
        missing = [f"{c.name} {c.version} (make control-plane)" for c in (components.COREDNS,) if not c.is_built()]
        if missing:
            raise NodeError("the cluster DNS needs " + "; ".join(missing))
        self.dir.mkdir(parents=True, exist_ok=True)
        _address_link(self.LINK, CLUSTER_DNS_IP)
        corefile = self.dir / "Corefile"
        corefile.write_text(f"""cluster.local:53 {{
    bind {CLUSTER_DNS_IP}
    errors
    log
    kubernetes cluster.local {{
        kubeconfig {self.plane.kubeconfig} test
        pods verified
    }}
}}
""")
        self.process = Process("coredns", [str(components.COREDNS.binary("coredns")), "-conf", str(corefile)],
                               self.dir / "coredns.log", dict(os.environ))
        self.process.start()
        coredns = self.process
        # the banner CoreDNS prints once its servers listen, after its kubernetes plugin synced with the API
        what = f"CoreDNS answering at {CLUSTER_DNS_IP}"
        wait_until(_while_running([coredns], what, lambda: "CoreDNS-" in coredns.tail()), START_TIMEOUT_S, what)
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
        _run("ip", "link", "del", self.LINK, check=False)


class ApiAddress(Started):
    """An address of this machine for the API server that pods in containers reach (``ControlPlane(address=...)``):
    the ``kubernetes`` Service's endpoint, to which kube-proxy sends in-cluster clients (the operator and the agents
    in their pods). Loopback is each pod's own. The address of a link of its own, as the cluster DNS's."""

    LINK = "ubapi"
    ADDRESS = "10.99.255.1"

    def start(self) -> ApiAddress:
        _address_link(self.LINK, self.ADDRESS)
        return self

    def stop(self) -> None:
        _run("ip", "link", "del", self.LINK, check=False)


def _address_link(link: str, address: str) -> None:
    """A veth pair (this kernel has no dummy links) whose first end holds ``address``; a killed run's goes first."""
    _run("ip", "link", "del", link, check=False)
    _run("ip", "link", "add", link, "type", "veth", "peer", "name", f"{link}p")
    _run("ip", "addr", "add", f"{address}/32", "dev", link)
    _run("ip", "link", "set", link, "up")
    _run("ip", "link", "set", f"{link}p", "up")


class ServiceProxy(Started):
    """kube-proxy (iptables mode), one for this machine: every node's pods route through this machine's network
    namespace, where its rules turn a ClusterIP Service's address into one of its pods'. A cluster runs one per
    node, each in that node's network namespace; here they would all write the same tables. Its rules are
    removed when it stops (``kube-proxy --cleanup``)."""

    def __init__(self, plane: ControlPlane, workdir: Path, node: str) -> None:
        self.plane, self.dir, self.node = plane, workdir / "kube-proxy", node
        self.process: Process | None = None

    def start(self) -> ServiceProxy:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.process = Process("kube-proxy", [
            str(components.KUBELET.binary("kube-proxy")), f"--kubeconfig={self.plane.kubeconfig}",
            "--proxy-mode=iptables", f"--cluster-cidr={POD_CIDRS}", f"--hostname-override={self.node}",
            f"--healthz-bind-address=127.0.0.1:{listen_port()}", f"--metrics-bind-address=127.0.0.1:{listen_port()}",
            "--conntrack-max-per-core=0"], self.dir / "kube-proxy.log", dict(os.environ))
        self.process.start()
        what = "kube-proxy's first sync of the Services"
        synced = _while_running([self.process], what,
                                lambda: "KUBE-SERVICES" in _run("iptables-save", "-t", "nat", check=False).stdout)
        wait_until(synced, START_TIMEOUT_S, what)
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
        _run(str(components.KUBELET.binary("kube-proxy")), "--cleanup", "--proxy-mode=iptables", check=False)


def _while_running(processes: Iterable[Process], what: str, ready: Callable[[], bool]) -> Callable[[], bool]:
    """``ready``, polled, failing at once with the log's tail if one of ``processes`` exits meanwhile."""
    def probe() -> bool:
        for process in processes:
            if process.popen is not None and process.popen.poll() is not None:
                raise NodeError(f"{process.name} exited with {process.popen.returncode} while waiting for {what}; "
                                f"its log ends:\n{process.tail()}")
        return ready()
    return probe


def _hierarchies() -> list[Path]:
    """The writable cgroup v1 hierarchies (cgroup2's ``unified`` has no controllers here)."""
    return [path for path in sorted(CGROUP_ROOT.iterdir())
            if path.is_dir() and not path.is_symlink() and path.name != "unified" and (path / "cgroup.procs").exists()]


def _node_processes(name: str, directory: Path) -> set[int]:
    """The node's processes: its containers (in its cgroup root) and containerd's shims (outside it, started with
    the node's socket in their command line), and its kubelet and containerd (its directory in theirs)."""
    pids: set[int] = set()
    hierarchy = _hierarchies()[0] / f"unbroken-{name}"
    if hierarchy.exists():
        for procs in hierarchy.rglob("cgroup.procs"):
            pids.update(int(pid) for pid in procs.read_text().split())
    markers = (f"{directory}/".encode(), f"{RUN_ROOT / name}/".encode())
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                command = (proc / "cmdline").read_bytes()
                if any(marker in command for marker in markers):
                    pids.add(int(proc.name))
            except OSError:
                continue  # gone meanwhile
    pids.discard(os.getpid())
    return pids


def _kill_node_processes(name: str, directory: Path) -> None:
    """SIGKILL the node's processes until none is left (a shim may start a process while the first are killed)."""
    def none_left() -> bool:
        pids = _node_processes(name, directory)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return not pids
    wait_until(none_left, 20.0, f"the processes of {directory} gone")


def _remove_cgroups(root: Path) -> None:
    """``root`` and every cgroup below it, deepest first, once their processes have exited (rmdir says EBUSY
    until then)."""
    def removed() -> bool:
        try:
            for path in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
                path.rmdir()
            root.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            return False
        return not root.exists()
    wait_until(removed, 20.0, f"the cgroup {root} removed")


def clean_leftovers(name: str, index: int, directory: Path) -> None:
    """Whatever a node of this name left: processes, mounts under its directory (overlay root filesystems, /dev/shm,
    network namespaces), its links and bridge, its cgroups, its directory."""
    _kill_node_processes(name, directory)
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    places = (f"{directory}/", f"{RUN_ROOT / name}/")
    for mount in sorted((m for m in mounts if m.startswith(places)), key=len, reverse=True):
        _run("umount", "-l", mount, check=False)
    for link in (f"ubnode{index}", f"ubpods{index}"):
        _run("ip", "link", "del", link, check=False)
    for hierarchy in CGROUP_ROOT.iterdir():  # cgroup2's ``unified`` too: the kubelet makes its root there as well
        _remove_cgroups(hierarchy / f"unbroken-{name}")
    shutil.rmtree(RUN_ROOT / name, ignore_errors=True)
    for path in directory.glob("*"):
        if path.name != "logs":  # kept for a failed test's report (its pod logs are in pod-logs: gone with the pods)
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
