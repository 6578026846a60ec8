"""Shards between nodes: an authenticated TCP protocol served by every node agent.

Handshake (mutual, the cluster token never crosses the wire)::

    server -> client   32-byte nonce Ns
    client -> server   HMAC-SHA256(token, "client" + Ns) + 32-byte nonce Nc
    server -> client   HMAC-SHA256(token, "server" + Nc)      (or closes: unauthenticated)

Then requests, each a 4-byte big-endian length + a JSON header, maybe followed
by raw bytes:

- ``put``: header ``{"op": "put", "info": ShardInfo}`` + ``info.size`` bytes. The server
  writes them into its memory tier as a held replica, checking the checksum while
  receiving; the descriptor appears only if it matches.
- ``get``: ``{"op": "get", "job", "step", "rank"}``: reply header with the ShardInfo,
  then the bytes, sent with ``sendfile`` straight from shared memory.
- ``list``: ``{"op": "list", "job"}``: every complete shard of the job on the node.
- ``verify``: ``{"op": "verify", "job"}``: re-checksums them and reports each.
- ``catalog``: ``{"op": "catalog", "job"}``: the steps committed in memory and where every
  copy of their shards is (from the store), for a restoring rank.

Like NCCL's and gloo's own traffic, payloads are not encrypted: the token keeps
other processes and hosts from reading or planting shards, the network is the
cluster's private one.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import mmap
import os
import secrets
import socket
import socketserver
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unbroken.checkpoint import shm
from unbroken.checkpoint.manifest import ShardInfo
from unbroken.checkpoint.restore_catalog import RestoreCatalog
from unbroken.checkpoint.integrity import StreamingChecksum, checksum
from pydantic import ValidationError

from unbroken.errors import CheckpointError

log = logging.getLogger("unbroken.checkpoint.peer")

NONCE = 32
MAX_HEADER = 16 << 20
CONNECT_TIMEOUT = 2.0
IO_TIMEOUT = 60.0
_CHUNK = 4 << 20


class AuthError(CheckpointError):
    """The other side does not hold the cluster token."""


def load_token(path: Path) -> bytes:
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise CheckpointError(f"cannot read the cluster token {path}: {exc.strerror}") from None
    if len(token) < 32:
        raise CheckpointError(f"cluster token {path} is too short ({len(token)} characters, need >= 32)")
    return token.encode()


def create_token(path: Path) -> None:
    """A fresh random token, readable by the owner only (agents and ranks run as the cluster's user)."""
    if path.exists():
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


def _mac(token: bytes, label: bytes, nonce: bytes) -> bytes:
    return hmac.new(token, label + nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray(n)
    _recv_into(sock, memoryview(data))
    return bytes(data)


def _recv_into(sock: socket.socket, view: memoryview, digest: StreamingChecksum | None = None) -> None:
    done = 0
    while done < len(view):
        got = sock.recv_into(view[done : done + _CHUNK])
        if not got:
            raise ConnectionError(f"peer closed the connection after {done} of {len(view)} bytes")
        if digest is not None:
            digest.update(view[done : done + got])
        done += got


def _send_header(sock: socket.socket, header: dict[str, Any]) -> None:
    data = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def _recv_header(sock: socket.socket) -> dict[str, Any]:
    (length,) = struct.unpack(">I", _recv_exact(sock, 4))
    if length > MAX_HEADER:
        raise ConnectionError(f"header of {length} bytes is larger than {MAX_HEADER}")
    header: dict[str, Any] = json.loads(_recv_exact(sock, length))
    return header


# -- server ---------------------------------------------------------------------------


class ShardServer:
    """Serves one node's memory tier; ``catalog`` answers restoring ranks (the agent's store view)."""

    def __init__(
        self,
        root: Path,
        token: bytes,
        host: str = "127.0.0.1",
        *,
        catalog: Callable[[str], RestoreCatalog] | None = None,
    ) -> None:
        self.root = root
        self.token = token
        self.catalog = catalog
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                server._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, 0), Handler)
        self.address = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="shard-server", daemon=True)

    def start(self) -> "ShardServer":
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _serve(self, sock: socket.socket) -> None:
        sock.settimeout(IO_TIMEOUT)
        peer = "%s:%s" % sock.getpeername()[:2]
        try:
            nonce = secrets.token_bytes(NONCE)
            sock.sendall(nonce)
            answer = _recv_exact(sock, 32 + NONCE)
            if not hmac.compare_digest(answer[:32], _mac(self.token, b"client", nonce)):
                log.warning("rejected a peer without the cluster token", extra={"peer": peer})
                return
            sock.sendall(_mac(self.token, b"server", answer[32:]))
            while True:
                try:
                    header = _recv_header(sock)
                except ConnectionError:
                    return  # client done
                self._dispatch(sock, header)
        except Exception as exc:  # noqa: BLE001 - one bad peer or request must not take the server down
            log.warning("peer connection failed: %s: %s", type(exc).__name__, exc, extra={"peer": peer})

    def _dispatch(self, sock: socket.socket, header: dict[str, Any]) -> None:
        op = header.get("op")
        if op == "put":
            self._put(sock, ShardInfo.model_validate(header["info"]))
        elif op == "get":
            self._get(sock, str(header["job"]), int(header["step"]), int(header["rank"]))
        elif op == "list":
            shards = shm.scan(self.root, str(header["job"]))
            _send_header(sock, {"ok": True, "shards": [{"info": s.info.model_dump(mode="json"), "held": s.held} for s in shards]})
        elif op == "catalog" and self.catalog is not None:
            _send_header(sock, {"ok": True, "catalog": self.catalog(str(header["job"])).model_dump(mode="json")})
        elif op == "verify":
            _send_header(sock, {"ok": True, "results": verify_local(self.root, str(header["job"]))})
        else:
            _send_header(sock, {"ok": False, "error": f"unknown op {op!r}"})

    def _put(self, sock: socket.socket, info: ShardInfo) -> None:
        path = shm.held_path(self.root, info.job, info.step, info.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{threading.get_ident()}.tmp")
        digest = StreamingChecksum()
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if info.size:
                os.ftruncate(fd, info.size)
                os.posix_fallocate(fd, 0, info.size)  # ENOSPC now, not SIGBUS while receiving
                with mmap.mmap(fd, info.size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)) as view:
                    with memoryview(view) as mv:
                        _recv_into(sock, mv, digest)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        if digest.hexdigest() != info.checksum:
            tmp.unlink(missing_ok=True)
            _send_header(sock, {"ok": False, "error": f"checksum mismatch: sent {info.checksum}, received {digest.hexdigest()}"})
            return
        # Only now does a copy already held for this step and rank go: descriptor first,
        # so nobody pairs the old descriptor with the new bytes.
        shm.descriptor_path(path).unlink(missing_ok=True)
        os.replace(tmp, path)
        shm.write_descriptor(path, info)
        _send_header(sock, {"ok": True})

    def _get(self, sock: socket.socket, job: str, step: int, rank: int) -> None:
        for stored in shm.scan(self.root, job):
            if stored.info.step != step or stored.info.rank != rank:
                continue
            with shm.SharedRead(stored) as read:
                if not read.ok:
                    continue
                _send_header(sock, {"ok": True, "info": stored.info.model_dump(mode="json")})
                if stored.info.size:
                    with open(stored.path, "rb") as f:  # same inode; our LOCK_SH keeps writers out
                        sock.sendfile(f, 0, stored.info.size)
                return
        _send_header(sock, {"ok": False, "error": f"no complete shard of {job} step {step} rank {rank} here"})


def verify_local(root: Path, job: str) -> list[dict[str, Any]]:
    """Re-checksum every complete shard of ``job`` on this node."""
    results = []
    for stored in shm.scan(root, job):
        with shm.SharedRead(stored) as read:
            if not read.ok:
                continue
            ok = _checksum_file(read.fd, stored.info.size) == stored.info.checksum
        results.append({"step": stored.info.step, "rank": stored.info.rank, "held": stored.held, "ok": ok, "size": stored.info.size})
    return results


def _checksum_file(fd: int, size: int) -> str:
    if size == 0:
        return checksum(b"", 0)
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as view:
        return checksum(view, size)


# -- client ---------------------------------------------------------------------------


class PeerClient:
    """One authenticated connection to a node's shard server; usable as a context manager."""

    def __init__(self, address: str, token: bytes) -> None:
        host, _, port = address.rpartition(":")
        self.address = address
        self.sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT)
        self.sock.settimeout(IO_TIMEOUT)
        try:
            nonce = _recv_exact(self.sock, NONCE)
            mine = secrets.token_bytes(NONCE)
            self.sock.sendall(_mac(token, b"client", nonce) + mine)
            try:
                proof = _recv_exact(self.sock, 32)
            except ConnectionError:
                raise AuthError(f"shard server {address} rejected our cluster token") from None
            if not hmac.compare_digest(proof, _mac(token, b"server", mine)):
                raise AuthError(f"shard server {address} does not hold the cluster token")
        except BaseException:
            self.sock.close()
            raise

    def __enter__(self) -> "PeerClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def _reply(self) -> dict[str, Any]:
        reply = _recv_header(self.sock)
        if not reply.get("ok"):
            raise CheckpointError(f"{self.address}: {reply.get('error')}")
        return reply

    def put(self, path: Path, info: ShardInfo) -> None:
        """Send a shard file (``sendfile`` from shared memory) to be held as a replica."""
        _send_header(self.sock, {"op": "put", "info": info.model_dump(mode="json")})
        if info.size:
            with open(path, "rb") as f:
                self.sock.sendfile(f, 0, info.size)
        self._reply()

    def get(self, job: str, step: int, rank: int, into: Callable[[ShardInfo], memoryview]) -> ShardInfo:
        """Receive a shard into the buffer ``into(info)`` returns; checked against its checksum."""
        _send_header(self.sock, {"op": "get", "job": job, "step": step, "rank": rank})
        info = ShardInfo.model_validate(self._reply()["info"])
        digest = StreamingChecksum()
        if info.size:
            view = into(info)
            _recv_into(self.sock, view[: info.size], digest)
        got = digest.hexdigest() if info.size else checksum(b"", 0)
        if got != info.checksum:
            raise CheckpointError(f"{self.address}: {job} step {step} rank {rank} checksum mismatch ({info.checksum} != {got})")
        return info

    def shards(self, job: str) -> list[tuple[ShardInfo, bool]]:
        _send_header(self.sock, {"op": "list", "job": job})
        return [(ShardInfo.model_validate(s["info"]), bool(s["held"])) for s in self._reply()["shards"]]

    def catalog(self, job: str) -> RestoreCatalog:
        _send_header(self.sock, {"op": "catalog", "job": job})
        raw = self._reply()["catalog"]
        try:
            return RestoreCatalog.model_validate(raw)
        except ValidationError as exc:
            raise CheckpointError(f"{self.address}: not a restore catalog this unbroken reads: {exc.errors()[0]['msg']}") from None

    def verify(self, job: str) -> list[dict[str, Any]]:
        _send_header(self.sock, {"op": "verify", "job": job})
        results: list[dict[str, Any]] = self._reply()["results"]
        return results
