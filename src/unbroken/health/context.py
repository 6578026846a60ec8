"""What a check knows about where it runs; crosses into the check's child process as JSON."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unbroken.config.health import HealthSettings, Profile


@dataclass(frozen=True)
class Peer:
    """A node taking part in a multi-node check: where to start its process and how to reach it."""

    name: str
    address: str
    netns: str | None = None


@dataclass(frozen=True)
class CheckContext:
    node: str
    instance_type: str
    profile: Profile
    settings: HealthSettings
    node_dir: Path
    cluster_dir: Path | None = None
    storage_dir: Path | None = None
    """The checkpoint filesystem the storage check writes to (default: the cluster's checkpoints/)."""
    peers: tuple[Peer, ...] = ()
    """Nodes of a multi-node check, this node first."""
    params: dict[str, Any] = field(default_factory=dict)
    """Per-run knobs (sweep sizes, iterations) from the CLI."""

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["profile"] = self.profile.model_dump()
        data["settings"] = self.settings.model_dump(mode="json")
        return json.dumps(data, default=str)

    @classmethod
    def from_json(cls, text: str) -> "CheckContext":
        data = json.loads(text)
        return cls(
            node=data["node"], instance_type=data["instance_type"],
            profile=Profile.model_validate(data["profile"]), settings=HealthSettings.model_validate(data["settings"]),
            node_dir=Path(data["node_dir"]),
            cluster_dir=Path(data["cluster_dir"]) if data.get("cluster_dir") else None,
            storage_dir=Path(data["storage_dir"]) if data.get("storage_dir") else None,
            peers=tuple(Peer(**p) for p in data.get("peers") or ()),
            params=dict(data.get("params") or {}),
        )
