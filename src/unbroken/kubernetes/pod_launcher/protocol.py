"""The messages between a pod's launcher (member.py) and the job's coordinator (coordinator.py).

One JSON object per line over TCP. A member says who it is once, then reports
what it sees; the coordinator answers with what every member does next:

| from | message | says |
|---|---|---|
| member | ``hello`` (node_rank) | "I am the launcher of this pod" (node_rank: its PET_NODE_RANK, the pod's identity) |
| member | ``standby`` | "I am a spare pod with a warm spare, no ranks: give me a place" |
| member | ``broken`` (round, why, fault) | "round N's process group broke here": a rank of mine failed (fault), or my ranks left the failed group |
| member | ``ready`` (round) | "my ranks left round N (held) or are gone (replaced): I can join the next one" |
| member | ``done`` | "my ranks all exited 0" |
| coordinator | ``stand_by`` | "no place for your pod now: warm a spare and say ``standby``" (the answer to a hello that gets no ``join``) |
| coordinator | ``hold`` (round, why) | "round N is over: leave it and say ready" |
| coordinator | ``join`` (round, port, group_rank, nnodes) | (round 0's too: the answer to the hello of a pod of the first round) |
| coordinator | ``join`` (round, port, group_rank, nnodes) | "form round N's process group of nnodes pods, this pod's ranks as group rank G; global rank 0 hosts its store on this port" |
| coordinator | ``done`` | (to a spare pod) "every training pod is done: the job is over, exit 0" |
| coordinator | ``give_up`` (why) | "no in-place restart: stop and exit 1 (the operator recreates the pods)" |
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any


class Kind(StrEnum):
    HELLO = "hello"
    STANDBY = "standby"
    BROKEN = "broken"
    READY = "ready"
    DONE = "done"
    STAND_BY = "stand_by"
    HOLD = "hold"
    JOIN = "join"
    GIVE_UP = "give_up"


@dataclass(frozen=True)
class Message:
    kind: Kind
    node_rank: int | None = None
    round: int | None = None
    port: int | None = None
    group_rank: int | None = None
    nnodes: int | None = None
    why: str = ""
    fault: bool = False

    def line(self) -> bytes:
        data: dict[str, Any] = {k: v for k, v in asdict(self).items() if v is not None and v != "" and v is not False}
        return (json.dumps(data) + "\n").encode()

    @classmethod
    def parse(cls, line: bytes) -> Message:
        """Raises ValueError for anything that is not a message of this protocol."""
        try:
            data = json.loads(line)
            return cls(kind=Kind(data["kind"]), node_rank=_int(data.get("node_rank")), round=_int(data.get("round")),
                       port=_int(data.get("port")), group_rank=_int(data.get("group_rank")),
                       nnodes=_int(data.get("nnodes")), why=str(data.get("why", "")), fault=data.get("fault") is True)
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a launcher message: {line[:200]!r}") from exc


def _int(value: Any) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"not a whole number: {value!r}")
    return value
