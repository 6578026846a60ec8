"""A launcher that is its PID namespace's init: what a container's command is.

On a real node (tests/integration/test_deploy_on_real_nodes.py's cluster) every rank of a PyTorchJob whose
container command is torchrun killed itself at ``unbroken.init()``: the rank asked to die with its parent, then
took "my parent is PID 1" to mean its parent had died, but torchrun, the container's command, *is* PID 1 there.
The trampoline that starts torchrun under ``unbroken run`` judged the same way, and ``unbroken run`` is a pod's
PID 1. Here each runs in a new PID namespace (``unshare --pid``, as root), as in a container.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from unbroken.plumbing.trampoline import TRAMPOLINE
from unbroken.plumbing.waiting import wait_until

RANK = """
import os, unbroken
ctx = unbroken.init()
print(f"rank alive, parent {os.getppid()}", flush=True)
ctx.finished()
"""


def in_new_pid_namespace(*command: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", *command], capture_output=True, text=True,
                          timeout=300, env=env)


def test_the_trampoline_runs_a_child_of_pid_one_and_ends_one_whose_parent_is_gone() -> None:
    parent = ("import subprocess, sys; from unbroken.plumbing import trampoline; "
              "sys.exit(subprocess.run(trampoline.command('-c', 'import os; print(\"child of\", os.getppid())')).returncode)")
    result = in_new_pid_namespace(sys.executable, "-c", parent)
    assert result.returncode == 0 and "child of 1" in result.stdout, result
    # a parent that is not ours any more (its pid given, another one now): the child ends before it runs anything
    orphan = subprocess.run([sys.executable, "-c", TRAMPOLINE, "4194304", "-c", "print('ran')"], capture_output=True, text=True)
    assert orphan.returncode == 137 and "ran" not in orphan.stdout, orphan


def test_a_managed_rank_under_a_torchrun_that_is_pid_one_lives(tmp_path: Path) -> None:
    (tmp_path / "rank.py").write_text(RANK)
    env = {**os.environ, "UNBROKEN_CLUSTER_DIR": str(tmp_path / "cluster"), "UNBROKEN_JOB": "j"}
    result = in_new_pid_namespace(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                                  str(tmp_path / "rank.py"), env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "rank alive, parent 1" in result.stdout, result.stdout[-2000:]


def test_a_rank_reparented_to_a_hosts_init_before_it_began_knows_its_launcher_is_gone() -> None:
    from unbroken.train import launcher_gone

    # this machine's PID 1 is its init, which launches no rank: a rank whose parent is PID 1 here was orphaned
    pid_one = Path("/proc/1/cmdline").read_bytes()
    assert b"torch" not in pid_one and b"unbroken" not in pid_one, pid_one
    assert launcher_gone(1) is True
    assert launcher_gone(os.getppid()) is False
    assert launcher_gone(4194304) is True


def test_the_kubernetes_agent_as_pid_one_ends_on_a_sigterm_while_it_starts(tmp_path: Path) -> None:
    """A DaemonSet's agent is its container's PID 1, which never gets a signal it has no handler for. Its start (the
    watch caches) can take seconds; a SIGTERM then (a rolling update right after the pod began) was lost, the pod
    ran out its 30 s grace, beating, and was SIGKILLed without its "leaving" beat. Here the API server accepts the
    connection and never answers, so the start never ends: the agent must still end on SIGTERM."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections complete in the kernel's backlog; nothing ever answers them
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{silent.getsockname()[1]}",
                                               "insecure-skip-tls-verify": True}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}], "users": [{"name": "u", "user": {"token": "t"}}]}))
    launcher = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "unbroken", "agent",
                                "--kubernetes", "--node", "n", "--kubeconfig", str(kubeconfig), "--state-dir", str(tmp_path / "state"),
                                "--socket-dir", str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    agent: list[int] = []  # its pid here, once it runs
    try:
        def agent_catches_sigterm() -> bool:
            if not agent:
                agent.extend(int(pid) for pid in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split())
                return False
            status = Path(f"/proc/{agent[0]}/status").read_text()
            caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
            return bool(caught & (1 << (signal.SIGTERM - 1)))
        wait_until(agent_catches_sigterm, 60, "the agent (PID 1 of its namespace) to handle SIGTERM in its start")
        os.kill(agent[0], signal.SIGTERM)
        launcher.wait(timeout=10)
    finally:
        for pid in agent:  # PID 1 of its namespace: SIGKILLed, it takes the namespace with it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        launcher.kill()
        output = launcher.communicate(timeout=30)[0].decode(errors="replace")
        silent.close()
    assert launcher.returncode == 128 + signal.SIGTERM, output[-3000:]
