"""Node heartbeats that do not go through etcd: a signed UDP datagram from each agent to the leader.

Every ``HeartbeatIntervalSeconds`` (1 s) each node agent sends one datagram to
the operator that leads, carrying its ranks' progress (hang detection). The
operator keeps what it heard in memory (:class:`HeartbeatBoard`); the agents'
Leases are written only every ``Kubernetes.LeaseRenewSeconds`` (10 s, the
kubelet's rhythm: KEP-589), as the backstop a new leader reads before the
datagrams reach it. At 10,000 nodes that is 10,000 datagrams a second into one
socket and 1,000 Lease writes a second into etcd, where a Lease a second per
node was 10,000 writes.

Why UDP: no connection per node to keep, nothing to time out, a lost datagram is
one missed beat of the four a node may miss before it is suspect.

Where to: the leader writes its address into the leader Lease
(``unbroken.dev/heartbeat-address``); agents read it with each Lease renewal, so
a new leader hears every node within one renewal.

Signed: HMAC-SHA256 under the node's own key (:func:`node_key`: the HMAC of
its name under a 32-byte master key in the Secret ``unbroken-heartbeat-key``,
which only the operator reads; kubernetes/backend/shared_secret.py). Each agent
is given its node's key by the operator (kubernetes/backend/node_credentials.py)
and so can sign for its node alone: a compromised node cannot keep another one
alive. A datagram whose signature does not verify under the key of the node it
names, that repeats or precedes a sequence number already heard from the same
agent process, or whose sender clock is more than ``MAX_CLOCK_SKEW_SECONDS``
from the operator's is dropped and counted: a forged or replayed datagram cannot
keep a dead node alive.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from dataclasses import fields as dataclass_fields
from typing import Any

import kubernetes

from unbroken.kubernetes.backend import names, shared_secret
from unbroken.state.records import Divergence, RankInfo, StepTiming, WorkerProgress

log = logging.getLogger("unbroken.kubernetes.backend.heartbeats")

KEY_SECRET = "unbroken-heartbeat-key"
KEY_FIELD = "key"
ADDRESS_ANNOTATION = f"{names.PREFIX}/heartbeat-address"
"""On the leader Lease: ``host:port`` where the leading operator hears heartbeats."""
MAX_DATAGRAM = 60_000
"""Below UDP's 65,507 bytes; a beat this large carries no progress (the Lease has it within 10 s)."""
MAX_CLOCK_SKEW_SECONDS = 30.0
AGENT_RESTART_GRACE_SECONDS = 60.0
"""How long an agent's "leaving" beat (SIGTERM) vouches for its node: a DaemonSet pod's restart
(image pull, Python start) fits in it."""
_DIGEST = hashlib.sha256().digest_size
_REMEDY = "delete it; the operator makes a new one when it next leads (restart the operator, then every agent)"


def ensure_key(api: kubernetes.client.ApiClient, namespace: str) -> bytes:
    """The operator's side: the master key, the Secret made first if there is none yet."""
    data = shared_secret.ensure(kubernetes.client.CoreV1Api(api), namespace, KEY_SECRET, (KEY_FIELD,),
                                lambda: {KEY_FIELD: base64.b64encode(secrets.token_bytes(32)).decode()}, remedy=_REMEDY)
    return base64.b64decode(data[KEY_FIELD])


def node_key(master: bytes, node: str) -> bytes:
    """The key ``node``'s beats are signed with: only the holder of the master key (the operator) can make it for
    any node; a node's agent is given its own."""
    return hmac.digest(master, b"unbroken heartbeat key of node " + node.encode(), "sha256")


@dataclass(frozen=True)
class Beat:
    node: str
    sender: str
    """The agent process (random per start): sequence numbers restart with it."""
    seq: int
    sent_at: float
    progress: tuple[WorkerProgress, ...] = ()
    leaving: bool = False
    """The agent stops (SIGTERM): its node is not lost; its successor will beat."""


def encode(key: bytes, beat: Beat) -> bytes:
    body = json.dumps({"node": beat.node, "sender": beat.sender, "seq": beat.seq, "sent_at": beat.sent_at,
                       "progress": [progress_to_json(p) for p in beat.progress], "leaving": beat.leaving}, separators=(",", ":")).encode()
    if len(body) + _DIGEST > MAX_DATAGRAM:
        # Too big: the step timing goes first (advice), then the progress (the Lease carries it every 10 s).
        if any(p.step_timing is not None for p in beat.progress):
            untimed = tuple(replace(p, step_timing=None) for p in beat.progress)
            return encode(key, Beat(beat.node, beat.sender, beat.seq, beat.sent_at, untimed, leaving=beat.leaving))
        return encode(key, Beat(beat.node, beat.sender, beat.seq, beat.sent_at, leaving=beat.leaving))
    return hmac.digest(key, body, "sha256") + body


def decode(key_for: Callable[[str], bytes], datagram: bytes) -> Beat | None:
    """The beat, or None if its signature does not verify under the key of the node it names (``key_for(node)``) or
    the body is not a beat."""
    signature, body = datagram[:_DIGEST], datagram[_DIGEST:]
    try:
        fields = json.loads(body)
        node = str(fields["node"])
    except (ValueError, TypeError, KeyError):
        return None
    if not hmac.compare_digest(signature, hmac.digest(key_for(node), body, "sha256")):
        return None
    try:
        progress = tuple(progress_from_json(dict(p)) for p in fields.get("progress") or ())
        return Beat(node, str(fields["sender"]), int(fields["seq"]), float(fields["sent_at"]), progress,
                    bool(fields.get("leaving", False)))
    except (ValueError, TypeError, KeyError):
        return None


def progress_to_json(progress: WorkerProgress) -> dict[str, Any]:
    """A worker's report as the beat and the Lease annotation carry it (no empty fields: a datagram is 8 KB)."""
    entry = {k: v for k, v in asdict(progress).items() if v is not None and k not in ("step_timing", "divergence")}
    if progress.step_timing is not None:
        entry["step_timing"] = progress.step_timing.to_json()
    if progress.divergence is not None:
        entry["divergence"] = progress.divergence.to_json()
    return entry


def progress_from_json(entry: dict[str, Any]) -> WorkerProgress:
    """A report from a beat or a Lease; fields this operator does not know (a newer agent's) are left out, not fatal:
    agents and the operator are upgraded one after the other."""
    known = {f.name for f in dataclass_fields(WorkerProgress)}
    entry = {k: v for k, v in entry.items() if k in known}
    ranks = tuple(RankInfo(**rank) for rank in entry.pop("ranks", None) or ())
    timing = StepTiming.from_json(entry.pop("step_timing", None))
    raw_divergence = entry.pop("divergence", None)
    divergence = Divergence.from_json(raw_divergence) if raw_divergence is not None else None
    return WorkerProgress(ranks=ranks, step_timing=timing, divergence=divergence, **entry)


def parse_address(text: str) -> tuple[str, int] | None:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


class HeartbeatSender:
    """The agent's end: one socket, a sequence number, the leader's address as last read."""

    def __init__(self, key: bytes, node: str, *, sock: socket.socket | None = None) -> None:
        """``sock``: a UDP socket to send from, shared (benchmarks/scale.py simulates thousands of agents in one
        process); by default one of its own."""
        self.key = key
        self.node = node
        self.sender = uuid.uuid4().hex[:12]
        self.seq = 0
        self.address: tuple[str, int] | None = None
        self._own = sock is None
        self._socket = sock if sock is not None else socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    def send(self, progress: Sequence[WorkerProgress] = (), *, leaving: bool = False) -> bool:
        """One beat to the leader; False when no leader address is known or the send failed (logged)."""
        if self.address is None:
            return False
        self.seq += 1
        datagram = encode(self.key, Beat(self.node, self.sender, self.seq, time.time(), tuple(progress), leaving))
        try:
            self._socket.sendto(datagram, self.address)
        except OSError as exc:  # no route, a refused port answered earlier: the next beat tries again
            log.debug("heartbeat not sent: %s", exc, extra={"node": self.node, "to": self.address})
            return False
        return True

    def close(self) -> None:
        if self._own:
            self._socket.close()


@dataclass(frozen=True)
class Heard:
    at: float
    """When the operator received the node's latest beat (its own clock)."""
    progress: tuple[WorkerProgress, ...]
    leaving: bool = False


class HeartbeatBoard:
    """The operator's end: a thread reading datagrams into a table by node."""

    def __init__(self, host: str, port: int) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)  # a burst of 10,000 nodes' beats
        self._socket.bind((host, port))
        self._socket.settimeout(0.5)
        self.port: int = self._socket.getsockname()[1]
        self.master: bytes | None = None
        """The master key (``ensure_key``): nothing is accepted until the operator has it."""
        self._keys: dict[str, bytes] = {}
        self._heard: dict[str, Heard] = {}
        self._last: dict[str, tuple[str, int]] = {}
        self._lock = threading.Lock()
        self.received = 0
        self.rejected = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeats", daemon=True)
        self._thread.start()

    def heard(self, node: str) -> Heard | None:
        with self._lock:
            return self._heard.get(node)

    def everything(self) -> dict[str, Heard]:
        with self._lock:
            return dict(self._heard)

    def forget(self) -> None:
        """Drop what was heard (this replica stopped leading: a later term starts from the Leases)."""
        with self._lock:
            self._heard.clear()
            self._last.clear()

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                datagram = self._socket.recv(65_536)
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            self.accept(datagram, time.time())

    def accept(self, datagram: bytes, now: float) -> bool:
        """Take one datagram received at ``now``; False (counted) when it is dropped."""
        beat = decode(self._key, datagram) if self.master is not None else None
        with self._lock:
            previous = self._last.get(beat.node) if beat is not None else None
            fresh = (beat is not None and abs(now - beat.sent_at) <= MAX_CLOCK_SKEW_SECONDS
                     and (previous is None or previous[0] != beat.sender or beat.seq > previous[1]))
            if not fresh:
                self.rejected += 1
                return False
            assert beat is not None
            self.received += 1
            if previous is None or previous[0] != beat.sender:
                log.info("hearing a node", extra={"node": beat.node, "sender": beat.sender})  # once per agent process
            self._last[beat.node] = (beat.sender, beat.seq)
            self._heard[beat.node] = Heard(now, beat.progress, beat.leaving)
            return True

    def _key(self, node: str) -> bytes:
        """``node``'s key, made once (10,000 nodes: 10,000 entries of 32 bytes)."""
        key = self._keys.get(node)
        if key is None:
            assert self.master is not None
            key = self._keys[node] = node_key(self.master, node)
        return key

    def close(self) -> None:
        self._stopping.set()
        self._socket.close()
        self._thread.join(timeout=2)
