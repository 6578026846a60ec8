"""In-memory copies of what the operator reads on every pass, kept by watches: list once, then watch.

A :class:`WatchCache` keeps one resource (Nodes, the agents' Leases, one workload kind, one kind's pods)
as the API serves it (JSON dicts: no client models, which lag the CRDs and cost parsing):

1. LIST with ``resourceVersion=0`` (served from the API server's own watch cache, not a quorum read of
   etcd), which replaces the copy whole;
2. WATCH from the list's resourceVersion (bookmarks on), applying ADDED / MODIFIED / DELETED; the server
   ends each watch after ``watch_timeout_seconds`` and the next one resumes from the last version seen;
3. LIST again only when the server says the version is too old (410 Gone), and every
   ``resync_seconds`` (5 minutes) as a safety net against a missed event.

A pass of the reconcile loop therefore reads memory, and the API server sends each change once. A
watch that fails (an API-server outage) keeps the last copy and retries every second: the copy is
stale meanwhile, which is safe because the operator decides nothing while it cannot confirm it leads
(kubernetes/backend/leader.py). The operator's own writes are put into the copy from the write's
answer (:meth:`observe`), so the next pass reads what it wrote even before the watch brings it; an
older version of an object never replaces a newer one (resourceVersions compared as etcd revisions,
which is what they are on every API server unbroken supports; an opaque one is taken as newer).

The copy also knows how far it has read the server's history (its *horizon*: the list's version, then
every event's and bookmark's). A write's answer for an object the copy does not hold, at a version the
horizon has passed, is an object deleted since (its DELETED event came first: a pod the operator
deleted and the kubelet removed at once); it is not put back, since no event would ever take that ghost
out again. For the same reason a relist keeps the copies newer than the list (the operator's own
writes the list predates) rather than going back in time until the watch replays them.

Why not kopf's streams (the operator used them to wake up): kopf offers no "listed everything" signal,
and a half-filled copy of the Leases would make live nodes look silent.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import kubernetes
from kubernetes.watch.watch import iter_resp_lines

from unbroken.kubernetes.backend.api import call
from unbroken.errors import NotFoundError

log = logging.getLogger("unbroken.kubernetes.backend.watch_cache")

Obj = dict[str, Any]
Key = tuple[str, str]
"""(namespace, name); namespace "" for cluster-scoped objects."""

RESYNC_SECONDS = 300.0
WATCH_TIMEOUT_SECONDS = 60
RETRY_SECONDS = 1.0
ABSENT_RETRY_SECONDS = 30.0
"""How often a resource whose CRD is not installed is looked for again."""


class _Expired(Exception):
    """410 Gone: the watch's resourceVersion is older than the server's history; list again."""


def key_of(obj: Obj) -> Key:
    meta = obj.get("metadata") or {}
    return (meta.get("namespace") or "", meta.get("name") or "")


def _newer(candidate: str | None, known: str | None) -> bool:
    """Whether ``candidate`` may replace ``known`` (etcd revisions; anything unparseable counts as newer)."""
    candidate_revision, known_revision = _revision(candidate), _revision(known)
    return candidate_revision is None or known_revision is None or candidate_revision >= known_revision


def _revision(version: str | None) -> int | None:
    """A resourceVersion as the etcd revision it is; None for an opaque one (nothing is judged by it)."""
    try:
        return int(version or "")
    except ValueError:
        return None


def _version(obj: Obj) -> str | None:
    return (obj.get("metadata") or {}).get("resourceVersion")


class WatchCache:
    """One resource, kept in memory by a LIST then a WATCH in a thread of its own.

    ``list_call`` is a list method of the Kubernetes client (``CoreV1Api.list_node``,
    ``CustomObjectsApi.list_cluster_custom_object``, ...) bound to an ApiClient this cache owns (each
    watch holds one connection for minutes); ``args`` and ``label_selector`` go with every call.
    ``on_change`` is called after every change applied (the operator's loop wakes on it)."""

    def __init__(self, name: str, list_call: Callable[..., Any], *args: Any, label_selector: str | None = None,
                 kind: str | None = None, api_version: str | None = None, on_change: Callable[[], None] | None = None,
                 resync_seconds: float = RESYNC_SECONDS, watch_timeout_seconds: int = WATCH_TIMEOUT_SECONDS) -> None:
        self.name = name
        self._list_call = list_call
        self._args = args
        self._label_selector = label_selector
        self._kind = kind
        self._api_version = api_version
        self.on_change = on_change
        self.resync_seconds = resync_seconds
        self.watch_timeout_seconds = watch_timeout_seconds
        self._objects: dict[Key, Obj] = {}
        self._lock = threading.Lock()
        self._synced = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._response: Any = None
        """The watch in flight: closed by :meth:`stop`, which ends the thread's blocking read."""
        self.absent = False
        """The list answered 404: the resource's CRD is not installed (no objects; looked for again)."""
        self.lists = 0
        """LISTs made so far (the first, then one per expiry or resync)."""
        self._horizon: int | None = None
        """The revision up to which the copy has read the server's history (the list's, then each event's)."""

    # -- reading --------------------------------------------------------------------------

    @property
    def synced(self) -> bool:
        """Listed at least once (the copy may be stale while the watch is down; see the module's docstring)."""
        return self._synced.is_set()

    def wait_synced(self, timeout: float) -> bool:
        return self._synced.wait(timeout)

    def objects(self) -> list[Obj]:
        with self._lock:
            return list(self._objects.values())

    def get(self, namespace: str, name: str) -> Obj | None:
        with self._lock:
            return self._objects.get((namespace, name))

    def discard(self, namespace: str, name: str) -> None:
        """Drop an object the caller just deleted (the watch's DELETED event follows)."""
        with self._lock:
            self._objects.pop((namespace, name), None)

    def observe(self, obj: Obj) -> None:
        """Put an object the operator just wrote (the write's answer) into the copy, unless the copy has a newer one,
        or has read past that version and no longer holds the object (deleted since: it stays deleted)."""
        self._apply("MODIFIED", obj, written=True)

    # -- keeping -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"watch-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        response = self._response
        if response is not None:
            try:
                response.shutdown()  # urllib3 2.3+: unblocks a read in another thread
            except Exception:  # noqa: BLE001 - best effort: otherwise the server ends the watch within its timeout
                pass

    def _run(self) -> None:
        version: str | None = None
        listed_at = 0.0
        failing = False
        while not self._stopping.is_set():
            try:
                if version is None or time.monotonic() - listed_at >= self.resync_seconds:
                    version = self._list()
                    listed_at = time.monotonic()
                    if version is None:  # absent: look again later
                        self._stopping.wait(ABSENT_RETRY_SECONDS)
                        continue
                version = self._watch(version, deadline=listed_at + self.resync_seconds)
                if failing:
                    log.info("watch of %s is back", self.name)
                    failing = False
            except _Expired:
                version = None
            except Exception as exc:  # noqa: BLE001 - the thread must outlive any failure (a stream cut mid-chunk, a bad line)
                if self._stopping.is_set():
                    break
                if not failing:
                    log.warning("watch of %s failed (keeping the last copy; retrying every %.0f s): %s",
                                self.name, RETRY_SECONDS, exc)
                    failing = True
                self._stopping.wait(RETRY_SECONDS)

    def _request(self, **kwargs: Any) -> Any:
        if self._label_selector:
            kwargs["label_selector"] = self._label_selector
        return call(lambda: self._list_call(*self._args, _preload_content=False, **kwargs))

    def _list(self) -> str | None:
        try:
            response = self._request(resource_version="0")
        except NotFoundError:
            with self._lock:
                self._objects = {}
            self.absent = True
            self._synced.set()
            return None
        listing = json.loads(response.data)
        version = str((listing.get("metadata") or {}).get("resourceVersion") or "") or None
        listed_at = _revision(version)
        objects = {key_of(obj): self._typed(obj) for obj in listing.get("items") or []}
        with self._lock:
            if listed_at is not None:  # writes of the operator's own that the list predates: the watch replays them
                objects.update({key: obj for key, obj in self._objects.items()
                                if (revision := _revision(_version(obj))) is not None and revision > listed_at})
            self._objects = objects
            self._horizon = listed_at
        self.absent = False
        self.lists += 1
        self._synced.set()
        self._changed()
        return version

    def _watch(self, version: str, *, deadline: float) -> str:
        """Apply one watch's events until the server ends it (or the resync is due); the last version seen."""
        timeout = max(1, min(self.watch_timeout_seconds, int(deadline - time.monotonic()) + 1))
        response = self._request(watch=True, resource_version=version, allow_watch_bookmarks=True,
                                 timeout_seconds=timeout, _request_timeout=(10, timeout + 15))
        self._response = response
        try:
            for event in self._events(response):
                kind = event.get("type")
                obj = event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _Expired()
                    raise ValueError(f"watch error {obj.get('code')}: {obj.get('message')}")
                version = str(_version(obj) or version)
                if kind != "BOOKMARK":
                    self._apply(str(kind), self._typed(obj))
                self._read_up_to(version)
                if self._stopping.is_set():
                    break
        finally:
            self._response = None
            response.close()
            response.release_conn()
        return version

    @staticmethod
    def _events(response: Any) -> Iterator[Obj]:
        for line in iter_resp_lines(response):
            if line and not line.isspace():
                yield json.loads(line)

    def _typed(self, obj: Obj) -> Obj:
        """List items carry no apiVersion/kind; the store reads them as it reads a GET's answer."""
        if self._kind:
            obj.setdefault("kind", self._kind)
        if self._api_version:
            obj.setdefault("apiVersion", self._api_version)
        return obj

    def _apply(self, kind: str, obj: Obj, *, written: bool = False) -> None:
        """An event of the watch, or (``written``) the answer of the operator's own write."""
        key = key_of(obj)
        with self._lock:
            known = self._objects.get(key)
            if known is not None and not _newer(_version(obj), _version(known)):
                return  # an event older than what we wrote ourselves
            revision = _revision(_version(obj))
            if written and known is None and revision is not None and self._horizon is not None \
                    and revision <= self._horizon:
                return  # the watch has read past this write and holds no such object: deleted since
            if kind == "DELETED":
                self._objects.pop(key, None)
            else:
                self._objects[key] = obj
        self._changed()

    def _read_up_to(self, version: str) -> None:
        revision = _revision(version)
        if revision is not None:
            with self._lock:
                self._horizon = max(revision, self._horizon or 0)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()


def own_client(api: kubernetes.client.ApiClient) -> kubernetes.client.ApiClient:
    """A client with its own connection pool, with ``api``'s configuration: a watch holds its connection."""
    return kubernetes.client.ApiClient(api.configuration)
