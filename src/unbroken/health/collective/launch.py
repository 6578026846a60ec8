"""Start one sweep worker per rank on the nodes being checked and return rank 0's report.

A worker of node X is started the way X's own processes are: in X's network
namespace when the cluster has them, tagged with X's name so that stopping X
stops it too. Ranks are laid out node by node, ``procs_per_node`` each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from unbroken.plumbing import procs
from unbroken.errors import BackendError
from unbroken.health.collective.worker import RESULT_MARK
from unbroken.health.context import Peer
from unbroken.rank.env import NODE
from unbroken.plumbing.netns import INNER_IFNAME
from unbroken.plumbing.ports import free_port


def _env(peer: Peer, local_rank: int) -> dict[str, str]:
    env = {**os.environ, NODE: peer.name, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    ifname = INNER_IFNAME if peer.netns else ("lo" if peer.address.startswith("127.") else None)
    if ifname:
        env.update(GLOO_SOCKET_IFNAME=ifname, NCCL_SOCKET_IFNAME=ifname)
    env["LOCAL_RANK"] = str(local_rank)
    return env


def run_sweep(peers: tuple[Peer, ...], plan: dict[str, Any], *, procs_per_node: int = 1, timeout: float = 180.0,
              share: int | None = None, port: int | None = None) -> dict[str, Any] | None:
    """Run the sweep across ``peers`` and return rank 0's report.

    ``share``: start only the workers of ``peers[share]`` (a Kubernetes Indexed Job's pod runs its own
    node's share; the pods of the other nodes run theirs), rendezvousing at ``peers[0]``'s address on
    ``port``; the report comes back only to the share that holds rank 0 (None elsewhere).
    """
    world = len(peers) * procs_per_node
    port = port if port is not None else free_port(peers[0].address)
    init = f"tcp://{peers[0].address}:{port}"
    node_ranks = {p.name: [i * procs_per_node + k for k in range(procs_per_node)] for i, p in enumerate(peers)}
    children: dict[int, subprocess.Popen[str]] = {}
    with tempfile.TemporaryDirectory(prefix="unbroken-sweep-") as tmp:
        try:
            for i, peer in enumerate(peers):
                if share is not None and i != share:
                    continue
                for local in range(procs_per_node):
                    rank = i * procs_per_node + local
                    prefix = ["ip", "netns", "exec", peer.netns] if peer.netns else []
                    argv = [*prefix, sys.executable, "-m", "unbroken.health.collective.worker",
                            "--rank", str(rank), "--world", str(world), "--init", init]
                    with open(f"{tmp}/{rank}.out", "w") as out, open(f"{tmp}/{rank}.err", "w") as err:
                        child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=err, text=True,
                                                 env=_env(peer, local))
                    children[rank] = child
                    assert child.stdin is not None
                    child.stdin.write(json.dumps({**plan, "node_ranks": node_ranks, "local_rank": local}))
                    child.stdin.close()
            deadline = time.monotonic() + timeout
            for child in children.values():
                try:
                    child.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise BackendError(f"collective sweep did not finish within {timeout:g} s") from None
            failed = [f"{peers[r // procs_per_node].name} rank {r}: "
                      f"{' '.join(Path(f'{tmp}/{r}.err').read_text().strip().splitlines()[-1:]) or 'exit ' + str(c.returncode)}"
                      for r, c in children.items() if c.returncode != 0]
            if 0 not in children:
                if failed:
                    raise BackendError(f"collective sweep failed: {'; '.join(failed)}")
                return None
            text = Path(f"{tmp}/0.out").read_text()
            line = next((ln for ln in text.splitlines() if ln.startswith(RESULT_MARK)), None)
            if line is None:
                raise BackendError(f"collective sweep failed: {'; '.join(failed) or 'rank 0 printed no report'}")
            report: dict[str, Any] = json.loads(line[len(RESULT_MARK):])
            return report
        finally:
            for child in children.values():
                if child.poll() is None:
                    procs.kill_now(procs.tree(child.pid))
                    child.wait()
