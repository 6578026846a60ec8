"""The local backend: every node is an agent process on this machine.

Agents and the controller run detached (their own session) with logs and pid
files under the cluster directory, and ``UNBROKEN_CLUSTER_DIR`` +
``UNBROKEN_NODE`` in their environment, which every process they start
inherits. That environment tag is how ``stop_node`` and ``cluster down`` find
every process of a node or cluster, orphans included.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from unbroken import procs
from unbroken.backends import netns_launch
from unbroken.launch_env import CLUSTER_DIR, NODE
from unbroken.layout import ClusterLayout


class LocalBackend:
    def __init__(self, layout: ClusterLayout) -> None:
        self.layout = layout

    def start_node(self, name: str) -> None:
        node_dir = self.layout.node_dir(name)
        node_dir.mkdir(parents=True, exist_ok=True)
        prefix, env = netns_launch.prepare(self.layout, name, self._env(node=name))
        pid = _spawn(
            [*prefix, sys.executable, "-m", "unbroken.agent", "--dir", str(self.layout.root), "--node", name],
            log=self.layout.agent_log(name), env=env,
        )
        _write_pid(self.layout.agent_pid(name), pid)

    def stop_node(self, name: str) -> None:
        """Hard stop: SIGKILL the agent and everything of the node in one sweep."""
        procs.kill_now(self.node_processes(name))
        procs.wait_gone(self.node_processes(name), 5.0)

    def node_processes(self, name: str):
        members = procs.tree(_read_pid(self.layout.agent_pid(name)) or 0)
        tagged = [p for p in procs.cluster_processes(self.layout.root) if _env_of(p).get(NODE) == name]
        seen = {p.pid for p in members}
        return members + [p for p in tagged if p.pid not in seen]

    def start_controller(self) -> int:
        pid = _spawn(
            [sys.executable, "-m", "unbroken.controller", "--dir", str(self.layout.root)],
            log=self.layout.controller_log, env=self._env(node=None),
        )
        _write_pid(self.layout.controller_pid, pid)
        return pid

    def controller_pid(self) -> int | None:
        pid = _read_pid(self.layout.controller_pid)
        return pid if procs.alive(pid) else None

    def stop_cluster(self, timeout: float = 10.0) -> list[int]:
        """SIGTERM then SIGKILL every process of the cluster; returns pids still alive (should be none)."""
        members = procs.cluster_processes(self.layout.root)
        controller = self.controller_pid()
        if controller:
            members += [p for p in procs.tree(controller) if p.pid not in {m.pid for m in members}]
        procs.kill_now(members)
        left = procs.wait_gone(members, timeout)
        left += [p for p in procs.cluster_processes(self.layout.root) if p.pid not in {q.pid for q in left}]
        return [p.pid for p in left]

    def _env(self, *, node: str | None) -> dict[str, str]:
        env = {**os.environ, CLUSTER_DIR: str(self.layout.root), "PYTHONUNBUFFERED": "1"}
        if node:
            env[NODE] = node
        else:
            env.pop(NODE, None)
        return env


def _spawn(argv: list[str], *, log: Path, env: dict[str, str]) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        process = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
    return process.pid


def _write_pid(path: Path, pid: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{pid}\n")
    os.replace(tmp, path)


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _env_of(proc) -> dict[str, str]:
    try:
        return proc.environ()
    except Exception:  # noqa: BLE001 - the process may vanish or be unreadable mid-scan
        return {}
