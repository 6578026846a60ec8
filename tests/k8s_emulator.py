"""A Kubernetes API emulator for tests: PyPI ``kmock`` (0.8) served over real HTTP, in its own process.

Usage::

    with kubernetes_emulator(tmp_path) as k8s:
        kubeconfig = k8s.write_kubeconfig(tmp_path / "kubeconfig")
        kubernetes.config.load_kube_config(config_file=str(kubeconfig))   # or: kubectl --kubeconfig ...

The emulator runs as ``python tests/k8s_emulator.py --ready-file F`` (this file), binds 127.0.0.1 on a
port the OS picks, writes its URL to F, and is stopped by the context manager (it also exits by itself
when its parent process goes away). Its stdout/stderr (one access-log line per request) go to
``workdir/k8s-emulator.log``. Nothing is shared with the test's event loop; every client talks HTTP.

What is real here
-----------------
* An HTTP server (aiohttp) that speaks the Kubernetes REST conventions: ``/api/v1/...``,
  ``/apis/<group>/<version>/...``, ``namespaces/<ns>/...``, JSON bodies, ``Status`` error bodies with
  real HTTP codes (404 NotFound, 409 AlreadyExists/Conflict, 405, 415, 422, 400).
* Discovery (``/api``, ``/api/v1``, ``/apis``, ``/apis/<g>``, ``/apis/<g>/<v>``, ``/version``) for the
  registered resources, good enough for ``kubectl`` (v1.32), the ``kubernetes`` client and ``kopf``.
* An in-memory object store (kmock's ``ObjectsArray``, with per-object history) with:
  create (POST, incl. ``generateName``), get, list, watch, PATCH, PUT (replace), DELETE, deletecollection.
* ``metadata.resourceVersion``: one cluster-wide counter, a monotonically increasing integer string,
  bumped on every write (create, patch, replace, delete, deletionTimestamp). A no-op patch changes nothing
  and emits no event, as in a real API server. ``uid`` (uuid4), ``creationTimestamp`` (RFC 3339, seconds),
  ``generation`` (1 on create, +1 when anything outside metadata/status changes), ``apiVersion``/``kind``
  are set by the server. ``uid``/``creationTimestamp``/``generation``/``deletionTimestamp`` cannot be
  changed by clients; a changed name/namespace is rejected (422).
* Optimistic concurrency: a ``metadata.resourceVersion`` in a PUT or PATCH body, or in DeleteOptions
  ``preconditions``, must equal the current one, else 409 Conflict.
* Patches by Content-Type: ``application/merge-patch+json`` (RFC 7386), ``application/json-patch+json``
  (RFC 6902, via ``jsonpatch``), ``application/strategic-merge-patch+json`` (a subset, see below; refused
  with 415 on custom resources, as a real server does). Server-side apply (``apply-patch+yaml``) → 415.
* ``status`` subresource (for resources registered with it): PATCH/PUT on the main endpoint keeps the
  old ``status``; PATCH/PUT on ``/status`` changes only ``status``. On create, ``status`` is dropped
  (pods get ``{"phase": "Pending"}``, namespaces ``{"phase": "Active"}``), except for Nodes, which keep it
  -- as in a real API server. There is no kubelet: pod phases only change when a test patches ``/status``.
* Finalizers: DELETE of an object with ``metadata.finalizers`` sets ``deletionTimestamp`` (MODIFIED);
  the write that removes the last finalizer deletes it (DELETED). Deleting a Namespace deletes the
  objects in it first (without a Terminating phase).
* Graceful pod deletion (pods only, as a real server's pod strategy): DELETE of a pod bound to a node
  (``spec.nodeName``) and not Succeeded/Failed, with a grace period > 0 (``gracePeriodSeconds`` from the
  DeleteOptions body, else the query, else ``spec.terminationGracePeriodSeconds``, else 30), does not
  remove it: it sets ``deletionTimestamp`` (now + grace) and ``deletionGracePeriodSeconds`` (MODIFIED) and
  the pod stays, "Terminating", until its kubelet confirms with a DELETE with ``gracePeriodSeconds=0``
  (then it goes, or waits for its finalizers). A DELETE with grace 0 (force) removes it at once; so does
  any DELETE of an unbound or finished pod. A second graceful DELETE may shorten the grace period,
  never extend it. There is no kubelet here: a bound pod deleted gracefully stays Terminating for good
  unless a test confirms it -- or runs ``tests/k8s_kubelet.py``, which does.
* Namespaced resources need an existing Namespace (404 otherwise); ``default``, ``kube-system``,
  ``kube-public`` and ``kube-node-lease`` exist from the start. Cluster-scoped resources (nodes,
  namespaces, CRDs) ignore ``metadata.namespace``.
* ``labelSelector`` (``=``, ``==``, ``!=``, ``in``, ``notin``, ``key``, ``!key``) and ``fieldSelector``
  (``=``, ``==``, ``!=`` on any dotted path, e.g. ``metadata.name``, ``spec.nodeName``, ``status.phase``)
  on list, watch and deletecollection; ``limit``/``continue`` paging on list.
* Watch (``?watch=true``): without ``resourceVersion`` (or ``"0"``, or ``sendInitialEvents=true``) it
  sends ADDED for the current objects, then live events; with ``resourceVersion=N`` it replays the events
  after N from an event log (so no event is lost between a list and a watch), or an ERROR 410 Expired
  when N is older than the log. An object that starts/stops matching the selectors arrives as
  ADDED/DELETED. ``timeoutSeconds`` ends the stream. ``sendInitialEvents=true`` ends the initial burst
  with a BOOKMARK carrying the ``k8s.io/initial-events-end`` annotation.
* A created CustomResourceDefinition (``apiextensions.k8s.io/v1``) registers its resource (all served
  versions) for discovery and use, and gets an ``Established`` condition.
* ``dryRun`` is refused (400) rather than silently written.

kmock 0.8 limits found (verified against a bare ``kmock.KubernetesEmulator`` over HTTP), and the workaround
---------------------------------------------------------------------------------------------------------
1. No ``resourceVersion``/``uid``/``creationTimestamp`` (lists say ``"resourceVersion": "..."``) -> all
   writes are handled by this fixture's ``_handle`` override, which assigns them (kmock has no write hook).
2. ``labelSelector``/``fieldSelector`` ignored -> implemented here (list, watch, deletecollection).
3. No PUT (404 "Endpoint Not Found"), no deletecollection (404) -> implemented here.
4. Every PATCH is a home-grown recursive dict merge whatever the Content-Type: no strategic merge, lists
   always replaced, ``$patch`` directives stored verbatim, a dict over a scalar/None (e.g. ``status: null``)
   is a 500 -> RFC 7386 / RFC 6902 / SMP subset implemented here, chosen by Content-Type.
5. Subresources ignored: PATCH ``/status`` patches the whole object, GET ``pods/x/log`` returns the pod ->
   ``/status`` semantics implemented; any other subresource is a 404.
6. URL parser: ``/api/v1/namespaces`` (create a namespace) is a 500 ValueError and
   ``/api/v1/namespaces/<name>`` is taken for discovery (404) -> this fixture replaces
   ``kmock._internal.parsing.parse_path`` in the emulator process (kmock-internal API, pinned to 0.8).
7. Discovery of the core group says ``"groupVersion": "/v1"``, so kubectl finds no resource type at all;
   subresources are advertised with all verbs -> ``_serve_version`` overridden. ``/version`` claimed k3s
   1.26 -> says ``v1.32.0-kmock-emulator``.
8. ``generateName`` is stored with no name (then 500 "More than one object matches") -> names generated.
9. A namespaced object POSTed without ``metadata.namespace`` is stored without it, so namespaced watches
   never see it -> the URL namespace is written into the object; a mismatch is a 400.
10. Unknown resources are accepted on POST (and then appear in discovery) -> 404 unless registered.
11. Watch: ignores ``resourceVersion`` (replays every object as ADDED), ignores ``timeoutSeconds`` (streams
    forever), and subscribes to its event bus only after sending the initial objects, so a write in
    between is lost -> watch reimplemented on this fixture's own event log and ``asyncio.Condition``.
12. Finalizer handling existed but bumped nothing and timestamps had microseconds -> reimplemented.

What clients (operator/agent code and tests) must live with
------------------------------------------------------------
* No controllers, no scheduler, no kubelet, no garbage collector: Jobs/Deployments/DaemonSets/JobSets/
  PyTorchJobs/TrainJobs create no pods; ``ownerReferences`` cascade nothing; pod phases, node conditions
  and Lease expiry change only when a client writes them. Tests play those roles (``tests/k8s_kubelet.py``
  plays a scheduler, a kubelet running pods as local processes, and the Job and PyTorchJob controllers).
* No admission, no defaulting, no schema validation: any JSON is stored as sent (no ``spec.nodeName``
  checks, no container defaults, no CRD OpenAPI pruning, no ``fieldValidation``); field selectors accept
  any path (a real server rejects unsupported fields with 400).
* Strategic merge patch is a subset: ``$patch: delete|replace``, ``$deleteFromPrimitiveList``,
  ``$setElementOrder``/``$retainKeys`` dropped, ``finalizers`` merged as a set, and lists of dicts merged
  by a fixed table of merge keys (``name`` for containers/env/volumes/..., ``containerPort``/``port``
  for ports, ``type`` for conditions, ``uid`` for ownerReferences); every other list is replaced.
  No OpenAPI (``/openapi/v2``, ``/openapi/v3`` are 404; ``kubectl explain`` does not work).
* core/v1 Events and events.k8s.io/v1 Events are two separate stores (a real server shows each event
  in both APIs with converted fields).
* List ``resourceVersion``/``resourceVersionMatch`` parameters are ignored (always the latest state);
  the event log keeps the last 100000 events. No periodic BOOKMARKs; no ``Table`` responses (kubectl
  falls back to its own printing: ``-L``, ``-o wide/json/yaml/jsonpath/name`` work; AGE may be blank).
* ``pods/<name>/log`` is served only when the emulator is started with ``pod_logs=DIR`` (the directory
  where ``tests/k8s_kubelet.py`` writes its containers' output): it plays the API server's proxy to the
  node's kubelet, reading ``DIR/<ns>_<pod>_<container>.log`` from where the pod's current run began (the
  kubelet's ``.start`` file beside it names the pod uid and offset), with ``container`` and ``tailLines``;
  ``follow``, ``previous``, ``sinceSeconds``/``sinceTime``, ``timestamps`` and ``limitBytes`` are a 400.
  A pod whose container has not started is a 400 "... is waiting to start", as from a real server.
* Deleting a CRD does not delete its objects nor unregister the resource; other subresources
  (``exec``, ``eviction``, ``scale``, ``binding``, ``token``...) are 404; ``kubectl drain``
  falls back to plain deletes (no ``policy`` group). No auth (any token passes), no RBAC, no TLS.
* Objects keep their last 20 versions in memory; the server also remembers every request (kmock's
  ``requests`` list), so keep an emulator per test or per module, not forever.
* kopf: works in ``--standalone`` mode. Without it, kopf looks up ``kopf.dev/v1`` (cluster)kopfpeerings;
  pass ``extra_resources=KOPF_PEERING_RESOURCES`` if a test wants peering objects to exist.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import bisect
import contextlib
import copy
import datetime
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from processes import stop_process

# --------------------------------------------------------------------------------------------------
# The registry: what the emulator serves.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Resource:
    """One served resource. ``builtin`` resources accept strategic merge patches; custom ones do not."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    subresources: tuple[str, ...] = ("status",)
    shortnames: tuple[str, ...] = ()
    builtin: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.group, self.version, self.plural)


def _core(plural: str, kind: str, namespaced: bool = True, subresources: tuple[str, ...] = (), short: tuple[str, ...] = ()) -> Resource:
    return Resource("", "v1", plural, kind, namespaced, subresources, short)


RESOURCES: tuple[Resource, ...] = (
    _core("nodes", "Node", namespaced=False, subresources=("status",), short=("no",)),
    _core("namespaces", "Namespace", namespaced=False, subresources=("status",), short=("ns",)),
    _core("pods", "Pod", subresources=("status",), short=("po",)),
    _core("events", "Event", short=("ev",)),
    _core("configmaps", "ConfigMap", short=("cm",)),
    _core("secrets", "Secret"),
    _core("serviceaccounts", "ServiceAccount", short=("sa",)),
    _core("services", "Service", subresources=("status",), short=("svc",)),
    Resource("coordination.k8s.io", "v1", "leases", "Lease", True, ()),
    Resource("events.k8s.io", "v1", "events", "Event", True, (), ("ev",)),
    Resource("batch", "v1", "jobs", "Job", True),
    Resource("apps", "v1", "daemonsets", "DaemonSet", True, ("status",), ("ds",)),
    Resource("apps", "v1", "deployments", "Deployment", True, ("status",), ("deploy",)),
    Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", False,
             ("status",), ("crd", "crds")),
    Resource("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob", True, builtin=False),
    Resource("trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob", True, builtin=False),
    Resource("trainer.kubeflow.org", "v1alpha1", "clustertrainingruntimes", "ClusterTrainingRuntime", False, (), builtin=False),
    Resource("jobset.x-k8s.io", "v1alpha2", "jobsets", "JobSet", True, builtin=False),
)

# kopf's peering resources (not registered by default; kopf falls back to standalone without them).
KOPF_PEERING_RESOURCES: tuple[Resource, ...] = (
    Resource("kopf.dev", "v1", "kopfpeerings", "KopfPeering", True, (), builtin=False),
    Resource("kopf.dev", "v1", "clusterkopfpeerings", "ClusterKopfPeering", False, (), builtin=False),
)

SEEDED_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")

# --------------------------------------------------------------------------------------------------
# The test side: start the server process, wait for it, write kubeconfigs.
# --------------------------------------------------------------------------------------------------


@dataclass
class Emulator:
    """A running emulator process. ``url`` is ``http://127.0.0.1:<port>``."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    workdir: Path

    def write_kubeconfig(self, path: Path, *, namespace: str = "default", context: str = "emulator") -> Path:
        """Write a kubeconfig (plain http, a dummy bearer token, context ``context``) for kubectl and the client."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "emulator", "user": {"token": "emulator-dummy-token"}}],
            "contexts": [{"name": context, "context": {"cluster": "emulator", "user": "emulator", "namespace": namespace}}],
            "current-context": context,
            "preferences": {},
        }
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config, indent=2))  # JSON is YAML: both kubectl and the client read it
        return path

    def pause(self) -> None:
        """SIGSTOP: the API server stops answering (connections still open at the kernel level)."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/version", timeout=1) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


@contextlib.contextmanager
def kubernetes_emulator(workdir: Path, *, extra_resources: Iterable[Resource] = (), pod_logs: Path | None = None,
                        timeout: float = 30.0) -> Iterator[Emulator]:
    """Start the emulator in its own process on 127.0.0.1 (OS-chosen port); stop it, and only it, on exit.
    ``pod_logs``: the test kubelet's log directory, which ``pods/<name>/log`` reads (module docstring)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "k8s-emulator.log"
    ready = workdir / "k8s-emulator.ready"
    ready.unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--ready-file", str(ready), "--parent-pid", str(os.getpid())]
    for resource in extra_resources:
        command += ["--resource", json.dumps(asdict(resource))]
    if pod_logs is not None:
        command += ["--pod-logs", str(pod_logs)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        url = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"the k8s emulator exited {proc.returncode}:\n{log.read_text(errors='replace')}")
            if url is None and ready.exists():
                url = json.loads(ready.read_text())["url"]
            if url is not None and _answers(url):
                break
            time.sleep(0.05)  # polling a process we started for readiness; nothing to wait on instead
        else:
            raise AssertionError(f"the k8s emulator did not answer within {timeout:g} s:\n{log.read_text(errors='replace')}")
        yield Emulator(url=url, proc=proc, log=log, workdir=workdir)
    finally:
        stop_process(proc)


# --------------------------------------------------------------------------------------------------
# Pure helpers of the server side: patches and selectors.
# --------------------------------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: dicts merge recursively, ``None`` deletes, everything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# Strategic-merge keys by field name (a real server takes them from the Go types' patchMergeKey).
_SMP_MERGE_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",), "initContainers": ("name",), "ephemeralContainers": ("name",),
    "env": ("name",), "volumes": ("name",), "volumeMounts": ("mountPath", "name"), "imagePullSecrets": ("name",),
    "ports": ("containerPort", "port"), "conditions": ("type",), "ownerReferences": ("uid",),
    "volumeDevices": ("devicePath",), "hostAliases": ("ip",), "readinessGates": ("conditionType",),
}
_SMP_SET_LISTS = {"finalizers"}


def _strip_directives(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_directives(v) for k, v in value.items() if not k.startswith("$")}
    if isinstance(value, list):
        return [_strip_directives(v) for v in value if not (isinstance(v, dict) and "$patch" in v and len(v) == 1)]
    return copy.deepcopy(value)


def _smp_list(name: str, current: list[Any], patch: list[Any]) -> list[Any]:
    if any(isinstance(e, dict) and e.get("$patch") == "replace" for e in patch):
        return _strip_directives([e for e in patch if not (isinstance(e, dict) and e.get("$patch") == "replace")])
    if name in _SMP_SET_LISTS and not any(isinstance(e, (dict, list)) for e in current + patch):
        return copy.deepcopy(current) + [e for e in patch if e not in current]
    everything = current + patch
    if everything and all(isinstance(e, dict) for e in everything):
        merge_key = next((k for k in _SMP_MERGE_KEYS.get(name, ()) if all(k in e for e in everything)), None)
        if merge_key is not None:
            result = copy.deepcopy(current)
            for element in patch:
                index = next((i for i, e in enumerate(result) if e[merge_key] == element[merge_key]), None)
                if element.get("$patch") == "delete":
                    if index is not None:
                        del result[index]
                elif index is not None:
                    result[index] = strategic_merge_patch(result[index], element)
                else:
                    result.append(_strip_directives(element))
            return result
    return _strip_directives(patch)


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """A subset of Kubernetes' strategic merge patch (see the module docstring for what is covered)."""
    if not isinstance(patch, dict):
        return _strip_directives(patch)
    if patch.get("$patch") == "replace":
        return _strip_directives(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            if isinstance(result.get(name), list):
                result[name] = [e for e in result[name] if e not in value]
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        current = result.get(key)
        if value is None or (isinstance(value, dict) and value.get("$patch") == "delete"):
            result.pop(key, None)
        elif isinstance(value, dict):
            result[key] = strategic_merge_patch(current, value)
        elif isinstance(value, list) and isinstance(current, list):
            result[key] = _smp_list(key, current, value)
        else:
            result[key] = _strip_directives(value)
    return result


_LABEL_KEY = r"[A-Za-z0-9_./-]+"
_LABEL_VALUE = r"[A-Za-z0-9_.-]*"
_EXISTS = re.compile(rf"^(!?)\s*({_LABEL_KEY})$")
_EQUALITY = re.compile(rf"^({_LABEL_KEY})\s*(==|!=|=)\s*({_LABEL_VALUE})$")
_SET = re.compile(rf"^({_LABEL_KEY})\s+(in|notin)\s*\(([^()]*)\)$")

Matcher = Callable[[dict[str, Any]], bool]


def _split_terms(text: str) -> list[str]:
    terms, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(text[start:i])
            start = i + 1
    terms.append(text[start:])
    return [t.strip() for t in terms if t.strip()]


def label_selector(text: str) -> Matcher:
    """Parse a label selector into a predicate on objects; ValueError if it does not parse."""
    checks: list[Callable[[dict[str, str]], bool]] = []
    for term in _split_terms(text):
        if m := _EQUALITY.match(term):
            key, op, value = m.groups()
            if op == "!=":
                checks.append(lambda labels, k=key, v=value: labels.get(k) != v)
            else:
                checks.append(lambda labels, k=key, v=value: labels.get(k) == v)
        elif m := _SET.match(term):
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",") if v.strip()}
            if op == "in":
                checks.append(lambda labels, k=key, vs=values: k in labels and labels[k] in vs)
            else:
                checks.append(lambda labels, k=key, vs=values: k not in labels or labels[k] not in vs)
        elif m := _EXISTS.match(term):
            negated, key = m.groups()
            checks.append(lambda labels, k=key, n=bool(negated): (k in labels) != n)
        else:
            raise ValueError(f"unable to parse requirement: {term!r}")

    def matches(obj: dict[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(check(labels) for check in checks)

    return matches


def _field_value(obj: Any, path: str) -> str:
    for part in path.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    if obj is None:
        return ""
    if isinstance(obj, bool):
        return "true" if obj else "false"
    return str(obj)


def field_selector(text: str) -> Matcher:
    """Parse a field selector (``path=value``, ``path==value``, ``path!=value``, comma-joined)."""
    checks: list[Matcher] = []
    for term in _split_terms(text):
        m = re.match(r"^([A-Za-z0-9_.]+)\s*(==|!=|=)\s*(.*)$", term)
        if not m:
            raise ValueError(f"invalid field selector: {term!r}")
        path, op, value = m.groups()
        if op == "!=":
            checks.append(lambda obj, p=path, v=value: _field_value(obj, p) != v)
        else:
            checks.append(lambda obj, p=path, v=value: _field_value(obj, p) == v)
    return lambda obj: all(check(obj) for check in checks)


def _truthy(value: str | None) -> bool:
    return (value or "").lower() in ("true", "1")  # the kubernetes client sends watch=True


def _without_meta_status(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


def _now(plus_seconds: float = 0) -> str:
    moment = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=plus_seconds)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _grace_period(params: Any, options: dict[str, Any]) -> int | None:
    """DeleteOptions.gracePeriodSeconds: from the body when it has one (as a real server decodes it), else the query."""
    value = options.get("gracePeriodSeconds")
    if value is None:
        value = params.get("gracePeriodSeconds") if params else None
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"invalid gracePeriodSeconds {value!r}") from None


def _pod_grace_period(pod: dict[str, Any], requested: int | None) -> int:
    """The grace period a real API server gives a pod's deletion (its pod strategy's CheckGracefulDelete):
    the requested one, else ``spec.terminationGracePeriodSeconds`` (defaulted to 30 by a real server on create,
    and so here); 0 -- deleted at once -- when the pod is bound to no node or already Succeeded/Failed;
    a negative request means 1 s."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    if requested is None:
        default = spec.get("terminationGracePeriodSeconds")
        requested = 30 if default is None else int(default)
    if not spec.get("nodeName") or status.get("phase") in ("Succeeded", "Failed"):
        return 0
    return 1 if requested < 0 else requested


# --------------------------------------------------------------------------------------------------
# The server side (runs in the emulator process only).
# --------------------------------------------------------------------------------------------------


def _parse_path(path: str) -> Any:
    """kmock's URL parser, fixed for the ``namespaces`` resource itself and its subresources."""
    from kmock._internal import parsing

    parts = path.strip("/").split("/")
    if len(parts) >= 2 and parts[0] == "apis":
        group, version, rest = parts[1], (parts[2] if len(parts) >= 3 else None), parts[3:]
    elif len(parts) >= 2 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    else:
        return parsing.ParsedPath()
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces" and not (len(rest) == 3 and rest[2] in ("status", "finalize")):
        namespace, rest = rest[1], rest[2:]
    plural = rest[0] if rest else None
    name = rest[1] if len(rest) >= 2 else None
    subresource = "/".join(rest[2:]) or None
    return parsing.ParsedPath(group, version, plural, namespace, name, subresource)


def _make_handler_class() -> type:
    import aiohttp.web
    import jsonpatch
    import jsonpointer
    import kmock
    from kmock._internal import parsing

    parsing.parse_path = _parse_path  # see limit 6 in the module docstring

    def error(status: int, reason: str, message: str, **details: Any) -> kmock.KubernetesError:
        return kmock.KubernetesError(status=status, reason=reason, message=message, details=details or {"emulator": True})

    class Handler(kmock.KubernetesEmulator):  # type: ignore[misc]
        """kmock's emulator with this fixture's own semantics for every resource request (see the docstring)."""

        LOG_LIMIT = 100_000
        HISTORY_LIMIT = 20

        def __init__(self, resources: Iterable[Resource], pod_logs: Path | None = None) -> None:
            super().__init__()
            self._pod_logs = pod_logs
            self._infos: dict[tuple[str, str, str], Resource] = {}
            self._rv = 0
            self._log: list[tuple[int, tuple[str, str, str], str, dict[str, Any], dict[str, Any] | None]] = []
            self._log_rvs: list[int] = []
            self._log_floor = 0
            self._changed = asyncio.Condition()
            for resource in resources:
                self.register(resource)

        # ---- registry & discovery ----

        def register(self, resource: Resource) -> None:
            self._infos[resource.key] = resource
            self.resources[kmock.resource(*resource.key)] = kmock.ResourceInfo(
                namespaced=resource.namespaced, kind=resource.kind, singular=resource.kind.lower(),
                verbs=set(self._verbs(resource)), shortnames=set(resource.shortnames), subresources=set(resource.subresources),
            )

        @staticmethod
        def _verbs(resource: Resource) -> list[str]:
            return ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]

        async def _serve_version(self, request: Any) -> Any:
            group, version = request.resource.group, request.resource.version
            infos = sorted((r for r in self._infos.values() if (r.group, r.version) == (group, version)), key=lambda r: r.plural)
            if not infos:
                raise error(404, "NotFound", "the server could not find the requested resource")
            resources: list[dict[str, Any]] = []
            for r in infos:
                resources.append({"name": r.plural, "singularName": r.kind.lower(), "namespaced": r.namespaced,
                                  "kind": r.kind, "verbs": self._verbs(r), "shortNames": list(r.shortnames)})
                for sub in r.subresources:
                    resources.append({"name": f"{r.plural}/{sub}", "singularName": "", "namespaced": r.namespaced,
                                      "kind": r.kind, "verbs": ["get", "patch", "update"]})
            return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{group}/{version}" if group else version,
                    "resources": resources}

        async def _serve_server_version(self, request: Any) -> Any:
            return {"major": "1", "minor": "32", "gitVersion": "v1.32.0-kmock-emulator", "gitCommit": "", "gitTreeState": "clean",
                    "buildDate": "2025-01-01T00:00:00Z", "goVersion": "", "compiler": "gc", "platform": "linux/amd64"}

        # ---- bookkeeping ----

        def _next_rv(self) -> int:
            self._rv += 1
            return self._rv

        async def _emit(self, rv: int, resource: Resource, kind: str, obj: dict[str, Any], previous: dict[str, Any] | None) -> None:
            self._log.append((rv, resource.key, kind, obj, previous))
            self._log_rvs.append(rv)
            if len(self._log) > self.LOG_LIMIT:
                cut = len(self._log) // 2
                self._log_floor = self._log_rvs[cut - 1]
                del self._log[:cut], self._log_rvs[:cut]
            async with self._changed:
                self._changed.notify_all()

        def _entry(self, resource: Resource, namespace: str | None, name: str) -> Any:
            key = (kmock.resource(*resource.key), namespace, name)
            entry = self._objects[key] if key in self._objects else None
            return None if entry is None or entry.deleted else entry

        def _store(self, resource: Resource, obj: dict[str, Any]) -> None:
            meta = obj["metadata"]
            key = (kmock.resource(*resource.key), meta.get("namespace") if resource.namespaced else None, meta["name"])
            if key in self._objects:
                entry = self._objects[key]
                entry.create(obj)
                if len(entry.history) > self.HISTORY_LIMIT:
                    del entry.history[: len(entry.history) - self.HISTORY_LIMIT]
            else:
                self._objects[key] = obj

        def _live(self, resource: Resource) -> Iterator[dict[str, Any]]:
            for (res, _, _), entry in list(self._objects.items()):
                if (res.group, res.version, res.plural) == resource.key and not entry.deleted:
                    yield entry.raw

        @staticmethod
        def _not_found(resource: Resource, name: str) -> kmock.KubernetesError:
            return error(404, "NotFound", f'{resource.plural}{"." + resource.group if resource.group else ""} "{name}" not found',
                         name=name, kind=resource.plural, group=resource.group)

        # ---- dispatch ----

        def _openapi_v3(self, path: str) -> dict[str, Any] | None:
            """Just enough OpenAPI v3 for kubectl to see ``fieldValidation`` support and skip client-side validation."""
            groups = sorted({(r.group, r.version) for r in self._infos.values()})
            prefix = lambda g, v: f"apis/{g}/{v}" if g else f"api/{v}"  # noqa: E731
            if path == "/openapi/v3":
                return {"paths": {prefix(g, v): {"serverRelativeURL": f"/openapi/v3/{prefix(g, v)}"} for g, v in groups}}
            for group, version in groups:
                if path != f"/openapi/v3/{prefix(group, version)}":
                    continue
                paths = {}
                for r in self._infos.values():
                    if (r.group, r.version) == (group, version):
                        ns = "/namespaces/{namespace}" if r.namespaced else ""
                        paths[f"/{prefix(group, version)}{ns}/{r.plural}/{{name}}"] = {"patch": {
                            "x-kubernetes-group-version-kind": {"group": r.group, "version": r.version, "kind": r.kind},
                            "parameters": [{"name": "fieldValidation", "in": "query", "schema": {"type": "string"}}],
                            "responses": {"200": {"description": "OK"}}}}
                return {"openapi": "3.0.0", "info": {"title": "kmock emulator", "version": "v1.32.0"}, "paths": paths}
            return None

        async def _handle(self, request: Any) -> aiohttp.web.StreamResponse:
            res = request.resource
            if request.url.path.startswith("/openapi/v3"):
                doc = self._openapi_v3(request.url.path)
                if doc is not None:
                    return aiohttp.web.json_response(doc)
            if res is None or res.plural is None or res.version is None:
                return await super()._handle(request)  # discovery, /version, unknown paths (404)
            resource = self._infos.get((res.group, res.version, res.plural))
            if resource is None:
                raise error(404, "NotFound", "the server could not find the requested resource")
            if request.params.get("dryRun"):
                raise error(400, "BadRequest", "dryRun is not supported by the emulator")
            sub = request.subresource
            if (sub == "log" and resource.plural == "pods" and request.name and request.namespace and self._pod_logs is not None
                    and request.method.value == "GET"):
                return aiohttp.web.Response(text=self._pod_log(request), content_type="text/plain")
            if sub is not None and (sub not in resource.subresources or sub != "status" or request.name is None):
                raise error(404, "NotFound", f"the server could not find the requested resource ({res.plural}/{sub})")
            if resource.namespaced is False and request.namespace is not None:
                raise error(404, "NotFound", f"{res.plural} is not namespaced")
            method, name = request.method.value, request.name
            if method == "GET" and _truthy(request.params.get("watch")):
                return await self._watch(request, resource)
            if method == "GET":
                payload = self._get(request, resource) if name else self._list(request, resource)
                return aiohttp.web.json_response(payload)
            if resource.namespaced and request.namespace is None:
                raise error(405, "MethodNotAllowed", f"{method} on all namespaces is not allowed")
            async with self._lock:
                if method == "POST" and name is None:
                    obj = await self._create(resource, request.namespace, request.data)
                    return aiohttp.web.json_response(obj, status=201)
                if method == "PATCH" and name:
                    return aiohttp.web.json_response(await self._patch(request, resource))
                if method == "PUT" and name:
                    return aiohttp.web.json_response(await self._replace(request, resource))
                if method == "DELETE" and name:
                    return aiohttp.web.json_response(await self._delete_one(request, resource))
                if method == "DELETE":
                    return aiohttp.web.json_response(await self._delete_collection(request, resource))
            raise error(405, "MethodNotAllowed", f"{method} is not supported on {request.url.path}")

        # ---- reads ----

        def _get(self, request: Any, resource: Resource) -> dict[str, Any]:
            entry = self._entry(resource, request.namespace, request.name)
            if entry is None:
                raise self._not_found(resource, request.name)
            return entry.raw

        def _pod_log(self, request: Any) -> str:
            """The current run's output of one of the pod's containers (the kubelet's part of ``kubectl logs``)."""
            assert self._pod_logs is not None
            pod = self._get(request, self._infos[("", "v1", "pods")])
            namespace, name, uid = pod["metadata"]["namespace"], pod["metadata"]["name"], pod["metadata"]["uid"]
            unsupported = sorted(set(request.params) & {"follow", "previous", "sinceSeconds", "sinceTime", "timestamps", "limitBytes"})
            if unsupported:
                raise error(400, "BadRequest", f"{', '.join(unsupported)}: not supported by the emulator's pod logs")
            containers = [c.get("name") for c in (pod.get("spec") or {}).get("containers") or []]
            container = request.params.get("container")
            if container is None:
                if len(containers) != 1:
                    raise error(400, "BadRequest", f"a container name must be specified for pod {name}, choose one of: {containers}")
                container = containers[0]
            elif container not in containers:
                raise error(400, "BadRequest", f"container {container} is not valid for pod {name}")
            path = self._pod_logs / f"{namespace}_{name}_{container}.log"
            try:
                start = json.loads(path.with_name(path.name + ".start").read_text())
                if start["uid"] != uid:
                    raise FileNotFoundError(path)  # an earlier pod of that name ran; this one has not started
                with open(path, "rb") as log_file:
                    log_file.seek(int(start["offset"]))
                    text = log_file.read().decode(errors="replace")
            except FileNotFoundError:
                raise error(400, "BadRequest", f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating') from None
            tail = request.params.get("tailLines")
            if tail is not None:
                lines = text.splitlines(keepends=True)
                text = "".join(lines[-int(tail):]) if int(tail) > 0 else ""
            return text

        def _matcher(self, request: Any) -> Matcher:
            try:
                labels = label_selector(request.params.get("labelSelector", ""))
                fields = field_selector(request.params.get("fieldSelector", ""))
            except ValueError as e:
                raise error(400, "BadRequest", str(e)) from None
            namespace, name = request.namespace, request.name

            def matches(obj: dict[str, Any]) -> bool:
                meta = obj.get("metadata") or {}
                return ((namespace is None or meta.get("namespace") == namespace) and (name is None or meta.get("name") == name)
                        and labels(obj) and fields(obj))

            return matches

        def _list(self, request: Any, resource: Resource) -> dict[str, Any]:
            matches = self._matcher(request)
            items = sorted((o for o in self._live(resource) if matches(o)),
                           key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))
            meta: dict[str, Any] = {"resourceVersion": str(self._rv)}
            if token := request.params.get("continue"):
                try:
                    after = tuple(json.loads(base64.urlsafe_b64decode(token.encode())))
                except ValueError:
                    raise error(400, "BadRequest", "invalid continue token") from None
                items = [o for o in items if (o["metadata"].get("namespace") or "", o["metadata"]["name"]) > after]
            limit = int(request.params.get("limit") or 0)
            if limit and len(items) > limit:
                items = items[:limit]
                last = items[-1]["metadata"]
                meta["continue"] = base64.urlsafe_b64encode(json.dumps([last.get("namespace") or "", last["name"]]).encode()).decode()
            return {"apiVersion": resource.api_version, "kind": f"{resource.kind}List", "metadata": meta, "items": items}

        async def _watch(self, request: Any, resource: Resource) -> aiohttp.web.StreamResponse:
            matches = self._matcher(request)
            params = request.params
            since = params.get("resourceVersion") or "0"
            initial = since == "0" or _truthy(params.get("sendInitialEvents"))
            try:
                cursor = self._rv if initial else int(since)
            except ValueError:
                raise error(400, "BadRequest", f"invalid resourceVersion {since!r}") from None
            timeout = float(params["timeoutSeconds"]) if params.get("timeoutSeconds") else None
            loop = asyncio.get_running_loop()
            deadline = None if timeout is None else loop.time() + timeout
            first: list[dict[str, Any]] = []
            if initial:
                first = [{"type": "ADDED", "object": o} for o in self._live(resource) if matches(o)]
                if _truthy(params.get("sendInitialEvents")):
                    first.append({"type": "BOOKMARK", "object": {
                        "apiVersion": resource.api_version, "kind": resource.kind,
                        "metadata": {"resourceVersion": str(cursor), "annotations": {"k8s.io/initial-events-end": "true"}}}})
            raw = request._raw_request
            response = aiohttp.web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            await response.prepare(raw)
            try:
                await self._write(response, first)
                while deadline is None or loop.time() < deadline:
                    if cursor < self._log_floor:
                        await self._write(response, [{"type": "ERROR", "object": {
                            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "code": 410,
                            "reason": "Expired", "message": f"too old resource version: {cursor} ({self._log_floor})"}}])
                        break
                    start = bisect.bisect_right(self._log_rvs, cursor)
                    batch = []
                    for rv, key, kind, obj, previous in self._log[start:]:
                        cursor = rv
                        if key != resource.key:
                            continue
                        now, before = matches(obj), previous is not None and matches(previous)
                        if kind == "MODIFIED" and now != before:
                            kind = "ADDED" if now else "DELETED"
                        if now or (kind == "DELETED" and before):
                            batch.append({"type": kind, "object": obj})
                    if batch:
                        await self._write(response, batch)
                        continue
                    if raw.transport is None or raw.transport.is_closing():
                        return response
                    wait = 1.0 if deadline is None else max(0.0, min(1.0, deadline - loop.time()))
                    async with self._changed:
                        if self._rv == cursor:
                            with contextlib.suppress(TimeoutError):
                                await asyncio.wait_for(self._changed.wait(), wait)
                await response.write_eof()
            except (ConnectionError, RuntimeError):
                pass  # the client went away
            return response

        @staticmethod
        async def _write(response: aiohttp.web.StreamResponse, events: list[dict[str, Any]]) -> None:
            if events:
                await response.write(b"".join(json.dumps(e).encode() + b"\n" for e in events))

        # ---- writes (all under self._lock) ----

        async def _create(self, resource: Resource, namespace: str | None, body: Any) -> dict[str, Any]:
            if not isinstance(body, dict):
                raise error(400, "BadRequest", "the body must be a JSON object")
            obj = copy.deepcopy(body)
            meta = obj.setdefault("metadata", {})
            if not isinstance(meta, dict):
                raise error(400, "BadRequest", "metadata must be an object")
            if resource.namespaced:
                if meta.get("namespace") not in (None, "", namespace):
                    raise error(400, "BadRequest", "the namespace of the provided object does not match the namespace sent on the request")
                if self._entry(self._infos[("", "v1", "namespaces")], None, namespace) is None:
                    raise error(404, "NotFound", f'namespaces "{namespace}" not found', name=namespace, kind="namespaces")
                meta["namespace"] = namespace
            else:
                meta.pop("namespace", None)
            if not meta.get("name"):
                if not meta.get("generateName"):
                    raise error(422, "Invalid", "metadata.name or metadata.generateName is required")
                alphabet = "bcdfghjklmnpqrstvwxz2456789"
                while True:
                    meta["name"] = meta["generateName"] + "".join(random.choices(alphabet, k=5))
                    if self._entry(resource, meta.get("namespace"), meta["name"]) is None:
                        break
            if self._entry(resource, meta.get("namespace"), meta["name"]) is not None:
                raise error(409, "AlreadyExists", f'{resource.plural} "{meta["name"]}" already exists', name=meta["name"], kind=resource.plural)
            for key in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion"):
                meta.pop(key, None)
            rv = self._next_rv()
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), resourceVersion=str(rv), generation=1)
            obj["apiVersion"], obj["kind"] = resource.api_version, resource.kind
            if "status" in resource.subresources and resource.kind != "Node":
                obj.pop("status", None)
                if resource.kind == "Pod":
                    obj["status"] = {"phase": "Pending"}
                elif resource.kind == "Namespace":
                    obj["status"] = {"phase": "Active"}
            if resource.kind == "CustomResourceDefinition":
                self._register_crd(obj)
            self._store(resource, obj)
            await self._emit(rv, resource, "ADDED", obj, None)
            return obj

        def _register_crd(self, crd: dict[str, Any]) -> None:
            spec = crd.get("spec") or {}
            names = spec.get("names") or {}
            for version in spec.get("versions") or []:
                if version.get("served", True) and spec.get("group") and names.get("plural") and names.get("kind"):
                    self.register(Resource(spec["group"], version["name"], names["plural"], names["kind"],
                                           spec.get("scope", "Namespaced") == "Namespaced", tuple(version.get("subresources") or ()),
                                           tuple(names.get("shortNames") or ()), builtin=False))
            crd["status"] = {"acceptedNames": names, "storedVersions": [v["name"] for v in spec.get("versions") or []],
                             "conditions": [{"type": t, "status": "True", "lastTransitionTime": _now(), "reason": t, "message": ""}
                                            for t in ("NamesAccepted", "Established")]}

        async def _patch(self, request: Any, resource: Resource) -> dict[str, Any]:
            entry = self._entry(resource, request.namespace, request.name)
            if entry is None:
                raise self._not_found(resource, request.name)
            old = copy.deepcopy(entry.raw)
            content_type = next((v for k, v in request.headers.items() if k.lower() == "content-type"), "").split(";")[0].strip()
            body = request.data
            try:
                if content_type == "application/json-patch+json" and isinstance(body, list):
                    new = jsonpatch.apply_patch(old, body, in_place=False)
                elif content_type == "application/merge-patch+json" and isinstance(body, dict):
                    new = merge_patch(old, body)
                elif content_type == "application/strategic-merge-patch+json" and isinstance(body, dict):
                    if not resource.builtin:
                        raise error(415, "UnsupportedMediaType",
                                    f"the body of the request was in an unknown format - accepted media types include: "
                                    f"application/json-patch+json, application/merge-patch+json ({resource.kind} is a custom resource)")
                    new = strategic_merge_patch(old, body)
                else:
                    raise error(415, "UnsupportedMediaType", f"the emulator does not support {content_type!r} with this body")
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as e:
                raise error(422, "Invalid", f"the JSON patch failed: {e}") from None
            return await self._update(resource, old, new, request.subresource)

        async def _replace(self, request: Any, resource: Resource) -> dict[str, Any]:
            entry = self._entry(resource, request.namespace, request.name)
            body = request.data
            if not isinstance(body, dict) or not isinstance(body.get("metadata"), dict):
                raise error(400, "BadRequest", "the body must be an object with metadata")
            if body["metadata"].get("name") != request.name:
                raise error(400, "BadRequest", f"the name of the object ({body['metadata'].get('name')}) does not match the name on the URL ({request.name})")
            if entry is None:
                raise self._not_found(resource, request.name)
            new = copy.deepcopy(body)
            if resource.namespaced:
                new["metadata"].setdefault("namespace", request.namespace)
            return await self._update(resource, copy.deepcopy(entry.raw), new, request.subresource)

        async def _update(self, resource: Resource, old: dict[str, Any], new: dict[str, Any], sub: str | None) -> dict[str, Any]:
            old_meta = old["metadata"]
            if not isinstance(new, dict) or not isinstance(new.get("metadata"), dict):
                raise error(422, "Invalid", "the result has no metadata")
            wanted_rv = new["metadata"].get("resourceVersion")
            if wanted_rv and wanted_rv != old_meta["resourceVersion"]:
                raise error(409, "Conflict", f'Operation cannot be fulfilled on {resource.plural} "{old_meta["name"]}": '
                            "the object has been modified; please apply your changes to the latest version and try again",
                            name=old_meta["name"], kind=resource.plural)
            for key in ("name", "namespace"):
                if new["metadata"].get(key, old_meta.get(key)) != old_meta.get(key):
                    raise error(422, "Invalid", f"metadata.{key}: field is immutable")
            if "status" in resource.subresources:
                if sub == "status":
                    status = new.get("status")
                    new = copy.deepcopy(old)
                    if status is None:
                        new.pop("status", None)
                    else:
                        new["status"] = status
                elif "status" in old:
                    new["status"] = old["status"]
                else:
                    new.pop("status", None)
            meta = new["metadata"]
            for key in ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generation", "namespace", "name"):
                if key in old_meta:
                    meta[key] = old_meta[key]
                else:
                    meta.pop(key, None)
            new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
            meta["resourceVersion"] = old_meta["resourceVersion"]
            if new == old:
                return old  # a no-op: no new resourceVersion, no event
            if _without_meta_status(new) != _without_meta_status(old):
                meta["generation"] = int(old_meta.get("generation") or 0) + 1
            rv = self._next_rv()
            meta["resourceVersion"] = str(rv)
            self._store(resource, new)
            if meta.get("deletionTimestamp") and not meta.get("finalizers") and not meta.get("deletionGracePeriodSeconds"):
                entry = self._entry(resource, meta.get("namespace"), meta["name"])
                entry.delete()
                await self._emit(rv, resource, "DELETED", new, old)
            else:
                await self._emit(rv, resource, "MODIFIED", new, old)
            return new

        async def _delete_one(self, request: Any, resource: Resource) -> dict[str, Any]:
            entry = self._entry(resource, request.namespace, request.name)
            if entry is None:
                raise self._not_found(resource, request.name)
            options = request.data if isinstance(request.data, dict) else {}
            preconditions = options.get("preconditions") or {}
            meta = entry.raw["metadata"]
            for key in ("uid", "resourceVersion"):
                if preconditions.get(key) and preconditions[key] != meta.get(key):
                    raise error(409, "Conflict", f"Precondition failed: {key} in precondition: {preconditions[key]}, {key} in object meta: {meta.get(key)}")
            return await self._delete(resource, entry, self._requested_grace(request))

        @staticmethod
        def _requested_grace(request: Any) -> int | None:
            try:
                return _grace_period(request.params, request.data if isinstance(request.data, dict) else {})
            except ValueError as e:
                raise error(400, "BadRequest", str(e)) from None

        async def _delete_collection(self, request: Any, resource: Resource) -> dict[str, Any]:
            matches = self._matcher(request)
            grace = self._requested_grace(request)
            victims = [o for o in self._live(resource) if matches(o)]
            items = []
            for obj in victims:
                entry = self._entry(resource, obj["metadata"].get("namespace"), obj["metadata"]["name"])
                if entry is not None:
                    items.append(await self._delete(resource, entry, grace))
            return {"apiVersion": resource.api_version, "kind": f"{resource.kind}List", "metadata": {"resourceVersion": str(self._rv)}, "items": items}

        async def _delete(self, resource: Resource, entry: Any, grace: int | None = None) -> dict[str, Any]:
            old = entry.raw
            obj = copy.deepcopy(old)
            meta = obj["metadata"]
            if resource.kind == "Pod" and resource.group == "":
                grace = _pod_grace_period(old, grace)
                if grace > 0:
                    return await self._start_graceful_deletion(resource, obj, old, grace)
            if meta.get("finalizers"):
                if meta.get("deletionTimestamp") and not meta.get("deletionGracePeriodSeconds"):
                    return obj  # already terminating, held by its finalizers only
                rv = self._next_rv()
                meta.update(deletionTimestamp=meta.get("deletionTimestamp") or _now(), deletionGracePeriodSeconds=0, resourceVersion=str(rv))
                self._store(resource, obj)
                await self._emit(rv, resource, "MODIFIED", obj, old)
                return obj
            if resource.kind == "Namespace" and resource.group == "":
                for other in list(self._infos.values()):
                    if other.namespaced:
                        for child in list(self._live(other)):
                            if child["metadata"].get("namespace") == meta["name"]:
                                await self._delete(other, self._entry(other, meta["name"], child["metadata"]["name"]), 0)
            rv = self._next_rv()
            meta["resourceVersion"] = str(rv)
            self._store(resource, obj)
            entry.delete()
            await self._emit(rv, resource, "DELETED", obj, old)
            return obj

        async def _start_graceful_deletion(self, resource: Resource, obj: dict[str, Any], old: dict[str, Any], grace: int) -> dict[str, Any]:
            """A bound pod's graceful deletion: mark it (MODIFIED) and keep it until its kubelet confirms with grace 0.

            A second graceful delete may shorten the grace period, never extend it (as in a real API server).
            """
            meta = obj["metadata"]
            if meta.get("deletionTimestamp") and grace >= int(meta.get("deletionGracePeriodSeconds") or 0):
                return obj
            rv = self._next_rv()
            meta.update(deletionTimestamp=_now(grace), deletionGracePeriodSeconds=grace, resourceVersion=str(rv))
            self._store(resource, obj)
            await self._emit(rv, resource, "MODIFIED", obj, old)
            return obj

    return Handler


async def serve(ready_file: Path, extra_resources: Iterable[Resource] = (), parent_pid: int | None = None, port: int = 0,
                pod_logs: Path | None = None) -> None:
    """Run the emulator until SIGTERM/SIGINT or until the parent process is gone."""
    import aiohttp.web

    handler_class = _make_handler_class()
    handler = handler_class([*RESOURCES, *extra_resources], pod_logs)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with handler:
        namespaces = handler._infos[("", "v1", "namespaces")]
        async with handler._lock:
            for name in SEEDED_NAMESPACES:
                await handler._create(namespaces, None, {"metadata": {"name": name}})
        access_log = logging.getLogger("k8s-emulator")
        server = aiohttp.web.Server(handler, access_log=access_log, access_log_format='%r %s %b %Tfs')
        runner = aiohttp.web.ServerRunner(server)
        await runner.setup()
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{bound}"
        tmp = ready_file.with_name(ready_file.name + ".tmp")
        tmp.write_text(json.dumps({"url": url, "pid": os.getpid()}))
        tmp.replace(ready_file)
        access_log.info("serving on %s", url)
        try:
            while not stop.is_set():
                if parent_pid is not None and os.getppid() != parent_pid:
                    break  # orphaned: the test process is gone
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)
        finally:
            await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A Kubernetes API emulator (kmock) on 127.0.0.1.")
    parser.add_argument("--ready-file", type=Path, required=True, help="where to write {'url': ...} once serving")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is no longer the parent")
    parser.add_argument("--resource", action="append", default=[], help="an extra Resource as JSON (repeatable)")
    parser.add_argument("--pod-logs", type=Path, default=None, help="serve pods/<name>/log from this test-kubelet log directory")
    args = parser.parse_args(argv)
    extra = []
    for text in args.resource:
        fields = json.loads(text)
        fields.update(subresources=tuple(fields.get("subresources", ())), shortnames=tuple(fields.get("shortnames", ())))
        extra.append(Resource(**fields))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    asyncio.run(serve(args.ready_file, extra, args.parent_pid, args.port, args.pod_logs))


if __name__ == "__main__":
    main()
