"""``unbroken run``'s command line: torchrun's, read the way torchrun reads it, plus a few of its own.

torchrun takes each option from the command line, else from ``PET_<OPTION>``
(what training-operator and the Kubeflow Trainer set in a pod: ``PET_NNODES``,
``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``),
else its default; ``unbroken run`` does the same, so a pod's command changes from
``torchrun train.py`` to ``unbroken run train.py`` and nothing else. Options of
torchrun's that an in-place restart decides for itself (the rendezvous, the
monitor interval, the log redirects) are accepted and ignored.

Sizes. ``--nnodes N``: N pods train; ``--spare-pods S`` among them stand by
(PET_NNODES counts every replica: the job trains on N - S, and the pods of node
rank N - S and above are spare pods). ``--nnodes MIN:MAX`` (what training-operator
sets for an ``elasticPolicy``): an elastic job, MAX pods train while they can,
never fewer than MIN; pods past MAX are spare pods. Node rank 0 hosts the job's
coordinator, so every pod needs its PET_NODE_RANK: a PyTorchJob with a Master.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass

from unbroken.config.job import HANG_TIMEOUT_FALLBACK_S
from unbroken.errors import ConfigError

DEFAULT_MASTER_PORT = 29500
DEFAULT_MAX_RESTARTS = 10
"""In-place restarts per pod lifetime before a full restart (HyperPod's ``numRestartBeforeFullJobRestart``)."""

# torchrun's options whose values unbroken run replaces: accepted (a pod's command may carry them), not used.
_IGNORED = ("rdzv-backend", "rdzv-endpoint", "rdzv-id", "rdzv-conf", "monitor-interval", "start-method", "role",
            "log-dir", "redirects", "tee", "local-ranks-filter", "logs-specs", "local-addr")


@dataclass(frozen=True)
class PodRun:
    nnodes: int
    """The most pods that train (an elastic job's max, a job with spare pods' replicas less its spares)."""
    nproc_per_node: int
    node_rank: int
    master_addr: str
    master_port: int
    command: list[str]
    """What torchrun runs: ``script.py args`` or ``-m module args``."""
    max_restarts: int
    warm_spare: bool
    abort_timeout: float
    collective_timeout: float
    coordinator_port: int
    fewest: int = 0
    """The fewest pods the job trains on (an elastic job's min); 0: ``nnodes``."""
    spare_pods: int = 0
    """Pods past ``nnodes`` that stand by (``--spare-pods``); they may also take the place of one not there at the start."""
    hang_timeout: float | None = None
    """The job's own hang timeout (None: from the ranks' step times); used only with ``hang_in_place``."""
    hang_in_place: bool = True
    """The launchers restart a hang in place (hang.py); off: hangs are left to the operator."""

    def __post_init__(self) -> None:
        if not self.fewest:
            object.__setattr__(self, "fewest", self.nnodes)


def _env_default(env: Mapping[str, str], name: str, default: str | None) -> str | None:
    return env.get(f"PET_{name.upper().replace('-', '_')}", default)


def parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    env = os.environ if env is None else env
    p = argparse.ArgumentParser(
        prog="unbroken run",
        description="Run a training script in a Kubernetes pod as torchrun does, restarting failed ranks in place: "
                    "the pod stays, the other pods' ranks are held, a warm spare replaces the failed rank, and the "
                    "model comes from the surviving ranks' memory. The script trains inside ctx.run(train) "
                    "(unbroken.init()); a plain script runs as under torchrun.",
        epilog="Example (a PyTorchJob's container command):  unbroken run --nproc-per-node 8 train.py --lr 3e-4\n"
               "Every torchrun option may come from PET_<OPTION> (training-operator sets them).",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--nnodes", default=_env_default(env, "nnodes", "1"),
                   help="pods in the job: N, or MIN:MAX for an elastic job that goes on with fewer pods after a loss "
                        "(never fewer than MIN) and grows back when pods return")
    p.add_argument("--spare-pods", dest="spare_pods", type=int, default=0,
                   help="of the --nnodes pods, how many stand by with a warm spare and no ranks, to take a lost pod's "
                        "place without a scheduling pass (the pods of the highest node ranks)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node",
                   default=_env_default(env, "nproc_per_node", "1"), help="ranks in this pod")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank",
                   default=_env_default(env, "node_rank", None),
                   help="this pod's place among --nnodes")
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default=_env_default(env, "master_addr", "127.0.0.1"),
                   help="the address of node rank 0's pod")
    p.add_argument("--master-port", "--master_port", dest="master_port",
                   default=_env_default(env, "master_port", str(DEFAULT_MASTER_PORT)),
                   help="node rank 0's store port for the first round")
    p.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", default=str(DEFAULT_MAX_RESTARTS),
                   help="in-place restarts before the pods exit for a full restart by the operator (torchrun's "
                        "PET_MAX_RESTARTS is not read: training-operator sets it for its own elastic restarts)")
    p.add_argument("--standalone", action="store_true", help="accepted for torchrun's sake; a pod is never standalone here")
    p.add_argument("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    p.add_argument("--no-python", "--no_python", dest="no_python", action="store_true",
                   help="refused: the ranks must be Python processes to restart in place")
    p.add_argument("--warm-spares", dest="warm_spares", type=int, choices=(0, 1), default=1,
                   help="keep one torchrun with torch imported in the pod to replace failed ranks (costs a few "
                        "hundred MB of host memory)")
    p.add_argument("--abort-timeout", dest="abort_timeout", type=float, default=10.0,
                   help="seconds the surviving ranks have to leave a broken process group before their pod's ranks "
                        "are replaced too")
    p.add_argument("--collective-timeout", dest="collective_timeout", type=float, default=HANG_TIMEOUT_FALLBACK_S,
                   help="seconds a rank waits in a collective for a silent peer (a hang) before it leaves the group")
    p.add_argument("--hang-timeout", dest="hang_timeout", default="auto",
                   help="restart a hang in place: the hung ranks are replaced from the warm spare, the others keep "
                        "their state. 'auto' (default): the timeout is half the operator's, from the ranks' step times "
                        "(at least 1.5 s); SECONDS: the job's hang timeout (the launchers act at half of it); 'off': "
                        "hangs are left to the operator, which recreates the pods")
    p.add_argument("--coordinator-port", dest="coordinator_port", type=int, default=None,
                   help="where node rank 0's launcher agrees the rounds (default: --master-port + 1)")
    for name in _IGNORED:
        p.add_argument(f"--{name}", f"--{name.replace('-', '_')}", dest=f"ignored_{name.replace('-', '_')}", default=None,
                       help=argparse.SUPPRESS)
    p.add_argument("script", help="the training script (or module, with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def parse(argv: list[str], env: Mapping[str, str] | None = None) -> PodRun:
    """Raises ConfigError naming the option, its value and what would be valid."""
    args = parser(env).parse_args(argv)
    if args.no_python:
        raise ConfigError("unbroken run --no-python: the ranks must be Python processes running unbroken.init(); "
                          "use torchrun for other programs")
    fewest, nnodes, pods = _sizes(str(args.nnodes), args.spare_pods)
    nproc = _whole("--nproc-per-node", args.nproc_per_node, 1)
    if args.node_rank is None and pods is not None:
        args.node_rank = "0"  # torchrun's default
    if args.node_rank is None:
        raise ConfigError("unbroken run: no --node-rank and no PET_NODE_RANK: node rank 0 hosts the job's coordinator, "
                          "so every pod needs its rank (a PyTorchJob sets it when it has a Master replica: add "
                          "'Master: {replicas: 1}')")
    node_rank = _whole("--node-rank", args.node_rank, 0)
    if pods is not None and node_rank >= pods:
        raise ConfigError(f"unbroken run --node-rank {node_rank}: must be below --nnodes {pods}")
    master_port = _whole("--master-port", args.master_port, 1)
    for name, value in (("--abort-timeout", args.abort_timeout), ("--collective-timeout", args.collective_timeout)):
        if value <= 0:
            raise ConfigError(f"unbroken run {name} {value:g}: must be a number of seconds above 0")
    hang_in_place, hang_timeout = _hang(str(args.hang_timeout))
    command = (["-m", args.script] if args.module else [args.script]) + list(args.script_args)
    return PodRun(nnodes=nnodes, nproc_per_node=nproc, node_rank=node_rank, master_addr=args.master_addr,
                  master_port=master_port, command=command, max_restarts=_whole("--max-restarts", args.max_restarts, 0),
                  warm_spare=bool(args.warm_spares), abort_timeout=args.abort_timeout,
                  collective_timeout=args.collective_timeout,
                  coordinator_port=args.coordinator_port or master_port + 1, fewest=fewest, spare_pods=args.spare_pods,
                  hang_timeout=hang_timeout,
                  hang_in_place=hang_in_place)


def _hang(value: str) -> tuple[bool, float | None]:
    """``--hang-timeout`` as (in place, the job's timeout or None for one from step times)."""
    if value in ("off", "auto"):
        return value == "auto", None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ConfigError(f"unbroken run --hang-timeout {value}: must be off, auto, or a number of seconds above 0")
    return True, seconds


def _sizes(value: str, spare_pods: int) -> tuple[int, int, int | None]:
    """(fewest, most) pods that train, and the pods there are if known (a fixed --nnodes), from ``--nnodes`` and
    ``--spare-pods``."""
    if spare_pods < 0:
        raise ConfigError(f"unbroken run --spare-pods {spare_pods}: must be 0 or more")
    low, colon, high = value.partition(":")
    if colon:
        fewest, most = _whole("--nnodes", low, 1), _whole("--nnodes", high, 1)
        if fewest > most:
            raise ConfigError(f"unbroken run --nnodes {value}: MIN is more than MAX (valid: e.g. 2:4)")
        if spare_pods:
            raise ConfigError(f"unbroken run --spare-pods {spare_pods} with --nnodes {value}: an elastic job's spare "
                              "pods are its replicas past MAX (elasticPolicy.maxReplicas); leave --spare-pods out")
        return fewest, most, None
    pods = _whole("--nnodes", value, 1)
    if spare_pods >= pods:
        raise ConfigError(f"unbroken run --spare-pods {spare_pods}: must be fewer than --nnodes {pods} (some pod must train)")
    return pods - spare_pods, pods - spare_pods, pods


def _whole(option: str, value: object, minimum: int) -> int:
    try:
        number = int(str(value))
    except ValueError:
        number = minimum - 1
    if number < minimum:
        raise ConfigError(f"unbroken run {option} {value}: must be a whole number, at least {minimum}")
    return number
