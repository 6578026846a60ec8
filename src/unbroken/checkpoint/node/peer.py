"""Shards between nodes: every node agent serves its memory tier over HTTPS with mutual TLS.

HTTP/1.1 (the standard library's server and client: nothing to install on a
node, no framing of our own) over TLS 1.3, where both sides must present a
certificate of the cluster's CA (:mod:`unbroken.checkpoint.node.credentials`). The API:

- ``PUT  /v1/jobs/{job}/replicas/{step}/{rank}``: the shard's bytes, its ``ShardInfo`` in the
  ``Unbroken-Shard`` header. Stored as a held replica; the checksum is checked while the
  bytes arrive and the descriptor appears only if it matches (else 422, the good copy stays).
- ``GET  /v1/jobs/{job}/shards/{step}/{rank}``: a complete shard of this node (own or held),
  ``Unbroken-Shard`` header + bytes, read under the slot's shared lock.
- ``GET  /v1/jobs/{job}/shards``: every complete shard of the job on this node.
- ``POST /v1/jobs/{job}/verify``: re-checksums them and reports each.
- ``GET  /v1/jobs/{job}/catalog``: the restore catalog (steps committed in memory, where every
  copy is), for a restoring rank.

Errors are JSON ``{"error": "..."}`` with a 4xx status. Each connection is served by
its own thread; a peer that fails the handshake or sends a bad request loses that
connection only. TLS costs ~1 GB/s of encryption per core on the sending and the
receiving side, paid by the agents in the background; ``sendfile`` cannot cross TLS.
"""

from __future__ import annotations

import http.client
import json
import logging
import mmap
import os
import re
import socket
import ssl
import threading
import urllib.parse
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from unbroken.checkpoint.node import shm
from unbroken.checkpoint.node.credentials import Credentials
from unbroken.checkpoint.format.integrity import StreamingChecksum, checksum
from unbroken.checkpoint.format.manifest import ShardInfo
from unbroken.checkpoint.format.restore_catalog import RestoreCatalog
from unbroken.errors import CheckpointError
from unbroken.plumbing.http_bind import bind_without_lookup

log = logging.getLogger("unbroken.checkpoint.node.peer")

SHARD_HEADER = "Unbroken-Shard"
CONNECT_TIMEOUT = 2.0
IO_TIMEOUT = 60.0
_CHUNK = 4 << 20
_ROUTES = {
    ("PUT", re.compile(r"^/v1/jobs/(?P<job>[^/]+)/replicas/(?P<step>\d+)/(?P<rank>\d+)$")): "_put",
    ("GET", re.compile(r"^/v1/jobs/(?P<job>[^/]+)/shards/(?P<step>\d+)/(?P<rank>\d+)$")): "_get",
    ("GET", re.compile(r"^/v1/jobs/(?P<job>[^/]+)/shards$")): "_list",
    ("POST", re.compile(r"^/v1/jobs/(?P<job>[^/]+)/verify$")): "_verify",
    ("GET", re.compile(r"^/v1/jobs/(?P<job>[^/]+)/catalog$")): "_catalog",
}


def _quoted(job: str) -> str:
    """A job name as one path segment (Kubernetes jobs are ``<namespace>/<name>``); the server unquotes."""
    return urllib.parse.quote(job, safe="")


class AuthError(CheckpointError):
    """The other side does not hold the cluster's certificate (or speaks no TLS)."""


class RequestError(Exception):
    """A request this server refuses: answered with its status, the connection goes on."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


# -- server ---------------------------------------------------------------------------


class ShardServer:
    """Serves one node's memory tier; ``catalog`` answers restoring ranks (the agent's catalog view)."""

    def __init__(self, root: Path, credentials: Credentials, host: str = "127.0.0.1", *,
                 catalog: Callable[[str], RestoreCatalog] | None = None, port: int = 0) -> None:
        self.root = root
        self.catalog = catalog
        self._pushing: dict[int, tuple[str, int]] = {}
        """Open connections that have begun a put: the job and step each is pushing (see ``receiving``)."""
        self._pushing_lock = threading.Lock()
        context = credentials.server_context()
        server = self

        class Handler(_Handler):
            shard_server = server

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True

            def server_bind(self) -> None:
                bind_without_lookup(self)  # no reverse DNS: in a node's namespace it blocks for seconds

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a refused handshake or a dropped peer was logged where it happened

            def get_request(self) -> tuple[socket.socket, Any]:
                sock, address = super().get_request()
                # Replies go out as headers then body: without this, Nagle holds the body back
                # until the client's delayed ACK (40 ms on every catalog a restoring rank asks for).
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                # The handshake runs in the connection's own thread (``Handler.setup``), so a
                # client that stalls it never holds up the accept loop.
                return context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), address

        self._server = Server((host, port), Handler)
        self.address = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="shard-server", daemon=True)

    def start(self) -> "ShardServer":
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def receiving(self) -> frozenset[tuple[str, int]]:
        """The (job, step)s a peer is pushing replicas of to this node now: a connection that began a put
        and is still open. A peer pushes all its shards of a step on one connection, so a save's replicas
        read as one span (the agent holds its copy records of that step through it: checkpoint/node/service.py)."""
        with self._pushing_lock:
            return frozenset(self._pushing.values())

    def _pushing_from(self, connection: int, shard: tuple[str, int] | None) -> None:
        with self._pushing_lock:
            if shard is None:
                self._pushing.pop(connection, None)
            else:
                self._pushing[connection] = shard


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a replication or a restore is several requests
    shard_server: ShardServer

    def setup(self) -> None:
        self.request.settimeout(IO_TIMEOUT)
        try:
            self.request.do_handshake()
        except (ssl.SSLError, OSError) as exc:
            log.warning("refused a peer without the cluster's certificate: %s", exc, extra={"peer": self.client_address[0]})
            raise
        super().setup()

    def handle(self) -> None:
        try:
            super().handle()
        except (ssl.SSLError, OSError) as exc:
            log.info("peer connection ended: %s", exc, extra={"peer": self.client_address[0]})
        finally:
            self.shard_server._pushing_from(id(self), None)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # requests are not logged one by one; failures are

    def do_GET(self) -> None:
        self._route("GET")

    def do_PUT(self) -> None:
        self._route("PUT")

    def do_POST(self) -> None:
        self._route("POST")

    def _route(self, method: str) -> None:
        for (verb, pattern), name in _ROUTES.items():
            match = pattern.match(self.path) if verb == method else None
            if match:
                params = {k: urllib.parse.unquote(v) for k, v in match.groupdict().items()}
                try:
                    getattr(self, name)(params["job"], *(int(params[k]) for k in ("step", "rank") if k in params))
                except RequestError as exc:
                    self._json(exc.status, {"error": str(exc)})
                return
        self._json(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint: {method} {self.path}"})

    def _json(self, status: HTTPStatus, body: Any) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    # -- the endpoints ------------------------------------------------------------

    def _put(self, job: str, step: int, rank: int) -> None:
        try:
            info = ShardInfo.model_validate_json(self.headers.get(SHARD_HEADER, ""))
        except ValidationError as exc:
            self.close_connection = True  # its body is still coming: nothing else can be read on this connection
            raise RequestError(HTTPStatus.BAD_REQUEST, f"{SHARD_HEADER} header: {exc.errors()[0]['msg']}") from None
        length = int(self.headers.get("Content-Length", "-1"))
        if (info.job, info.step, info.rank) != (job, step, rank) or length != info.size:
            self.close_connection = True
            raise RequestError(HTTPStatus.BAD_REQUEST, f"path, {SHARD_HEADER} and Content-Length disagree")
        self.shard_server._pushing_from(id(self), (info.job, info.step))
        root = self.shard_server.root
        path = shm.held_path(root, info.job, info.step, info.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{threading.get_ident()}.tmp")
        digest = StreamingChecksum(like=info.checksum)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if info.size:
                os.ftruncate(fd, info.size)
                os.posix_fallocate(fd, 0, info.size)  # ENOSPC now, not SIGBUS while receiving
                with mmap.mmap(fd, info.size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)) as view:
                    with memoryview(view) as mv:
                        _read_into(self.rfile, mv, digest)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            self.close_connection = True
            raise
        os.close(fd)
        got = digest.hexdigest() if info.size else checksum(b"", 0, like=info.checksum)
        if got != info.checksum:
            tmp.unlink(missing_ok=True)
            raise RequestError(HTTPStatus.UNPROCESSABLE_ENTITY, f"checksum mismatch: sent {info.checksum}, received {got}")
        # Only now does a copy already held for this step and rank go: descriptor first,
        # so nobody pairs the old descriptor with the new bytes.
        shm.descriptor_path(path).unlink(missing_ok=True)
        os.replace(tmp, path)
        shm.write_descriptor(path, info)
        self._json(HTTPStatus.OK, {"stored": str(path.name)})

    def _get(self, job: str, step: int, rank: int) -> None:
        for stored in shm.scan(self.shard_server.root, job):
            if stored.info.step != step or stored.info.rank != rank:
                continue
            with shm.SharedRead(stored) as read:
                if not read.ok:
                    continue
                self.send_response(HTTPStatus.OK)
                self.send_header(SHARD_HEADER, stored.info.model_dump_json())
                self.send_header("Content-Length", str(stored.info.size))
                self.end_headers()
                if stored.info.size:  # same inode; our LOCK_SH keeps writers out
                    with mmap.mmap(read.fd, stored.info.size, prot=mmap.PROT_READ) as view, memoryview(view) as mv:
                        for offset in range(0, stored.info.size, _CHUNK):
                            self.wfile.write(mv[offset : offset + _CHUNK])
                return
        raise RequestError(HTTPStatus.NOT_FOUND, f"no complete shard of {job} step {step} rank {rank} here")

    def _list(self, job: str) -> None:
        shards = shm.scan(self.shard_server.root, job)
        self._json(HTTPStatus.OK, {"shards": [{"info": s.info.model_dump(mode="json"), "held": s.held} for s in shards]})

    def _verify(self, job: str) -> None:
        self._json(HTTPStatus.OK, {"results": verify_local(self.shard_server.root, job)})

    def _catalog(self, job: str) -> None:
        if self.shard_server.catalog is None:
            raise RequestError(HTTPStatus.NOT_FOUND, "this server keeps no catalog")
        self._json(HTTPStatus.OK, self.shard_server.catalog(job).model_dump(mode="json"))


def _read_into(stream: Any, view: memoryview, digest: StreamingChecksum | None = None) -> None:
    done = 0
    while done < len(view):
        got = stream.readinto(view[done : done + _CHUNK])
        if not got:
            raise ConnectionError(f"peer closed the connection after {done} of {len(view)} bytes")
        if digest is not None:
            digest.update(view[done : done + got])
        done += got


def verify_local(root: Path, job: str) -> list[dict[str, Any]]:
    """Re-checksum every complete shard of ``job`` on this node."""
    results = []
    for stored in shm.scan(root, job):
        with shm.SharedRead(stored) as read:
            if not read.ok:
                continue
            ok = _checksum_file(read.fd, stored.info.size, stored.info.checksum) == stored.info.checksum
        results.append({"step": stored.info.step, "rank": stored.info.rank, "held": stored.held, "ok": ok, "size": stored.info.size})
    return results


def _checksum_file(fd: int, size: int, like: str) -> str:
    if size == 0:
        return checksum(b"", 0, like=like)
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as view:
        return checksum(view, size, like=like)


# -- client ---------------------------------------------------------------------------


class PeerClient:
    """A keep-alive connection to one node's shard server; usable as a context manager."""

    def __init__(self, address: str, credentials: Credentials) -> None:
        host, _, port = address.rpartition(":")
        self.address = address
        self._conn = http.client.HTTPSConnection(host, int(port), timeout=CONNECT_TIMEOUT, context=credentials.client_context())
        try:
            self._conn.connect()
        except ssl.SSLError as exc:
            self._conn.close()
            raise AuthError(f"shard server {address} is not of this cluster (TLS: {exc.reason or exc})") from None
        assert self._conn.sock is not None
        self._conn.sock.settimeout(IO_TIMEOUT)

    def __enter__(self) -> "PeerClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self._conn.close()

    def _exchange(self, method: str, path: str, *, headers: dict[str, str] | None = None,
                  body: Callable[[], None] | None = None) -> http.client.HTTPResponse:
        """One request; ``body`` sends the request body itself (its Content-Length is in ``headers``)."""
        try:
            self._conn.putrequest(method, path, skip_accept_encoding=True)
            for name, value in (headers or {"Content-Length": "0"}).items():
                self._conn.putheader(name, value)
            self._conn.endheaders()
            if body is not None:
                body()
            response = self._conn.getresponse()
        except ssl.SSLError as exc:
            raise AuthError(f"shard server {self.address} refused us: not of this cluster (TLS: {exc.reason or exc})") from None
        if response.status >= 400:
            detail = response.read().decode(errors="replace")
            try:
                detail = json.loads(detail)["error"]
            except (ValueError, KeyError, TypeError):
                pass
            raise CheckpointError(f"{self.address}: {detail}")
        return response

    def _json(self, method: str, path: str) -> Any:
        return json.loads(self._exchange(method, path).read())

    def put(self, path: Path, info: ShardInfo) -> None:
        """Send a shard file from shared memory to be held as a replica."""
        def send() -> None:
            if not info.size:
                return
            with open(path, "rb") as f, mmap.mmap(f.fileno(), info.size, prot=mmap.PROT_READ) as view, memoryview(view) as mv:
                for offset in range(0, info.size, _CHUNK):
                    self._conn.send(mv[offset : offset + _CHUNK])

        headers = {"Content-Length": str(info.size), SHARD_HEADER: info.model_dump_json()}
        self._exchange("PUT", f"/v1/jobs/{_quoted(info.job)}/replicas/{info.step}/{info.rank}", headers=headers, body=send).read()

    def get(self, job: str, step: int, rank: int, into: Callable[[ShardInfo], memoryview]) -> ShardInfo:
        """Receive a shard into the buffer ``into(info)`` returns; checked against its checksum."""
        response = self._exchange("GET", f"/v1/jobs/{_quoted(job)}/shards/{step}/{rank}")
        info = ShardInfo.model_validate_json(response.getheader(SHARD_HEADER) or "")
        digest = StreamingChecksum(like=info.checksum)
        if info.size:
            _read_into(response, into(info)[: info.size], digest)
        got = digest.hexdigest() if info.size else checksum(b"", 0, like=info.checksum)
        if got != info.checksum:
            raise CheckpointError(f"{self.address}: {job} step {step} rank {rank} checksum mismatch ({info.checksum} != {got})")
        return info

    def shards(self, job: str) -> list[tuple[ShardInfo, bool]]:
        return [(ShardInfo.model_validate(s["info"]), bool(s["held"])) for s in self._json("GET", f"/v1/jobs/{_quoted(job)}/shards")["shards"]]

    def catalog(self, job: str) -> RestoreCatalog:
        raw = self._json("GET", f"/v1/jobs/{_quoted(job)}/catalog")
        try:
            return RestoreCatalog.model_validate(raw)
        except ValidationError as exc:
            raise CheckpointError(f"{self.address}: not a restore catalog this unbroken reads: {exc.errors()[0]['msg']}") from None

    def verify(self, job: str) -> list[dict[str, Any]]:
        results: list[dict[str, Any]] = self._json("POST", f"/v1/jobs/{_quoted(job)}/verify")["results"]
        return results
