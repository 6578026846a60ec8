"""One pod's launcher: its node-local torchrun, kept across the job's rounds.

    Standby --"join" 0 (the answer to the hello of a first-round pod)--> Running(0)
    Standby --"stand_by", then "join" N (a spare pod given a place)--> Running(N): its ranks start on the warm spare
    Running(N) --a rank here died, left the group, or "hold" came (its ranks are asked to leave)--> Leaving(N)
    Leaving(N) --every rank here left round N: held--> Ready(N)
    Leaving(N) --a rank here died, or abort_timeout: the torchrun killed--> Ready(N) (replaced at the join)
    Ready(N) --"join" N+1--> Running(N+1): held ranks get the notice (rank/rejoin.py), maybe with a new group rank and
                            size; a replaced torchrun starts again (from the warm spare when there is one)
    Running --every rank exited 0--> done (exit 0)
    any --"give_up", the coordinator lost when it is needed, a torchrun that fails alone--> failed (exit 1)

Every launcher starts in Standby and asks the coordinator (node rank 0's launcher) whether its pod trains
now. A spare pod (a node rank past the job's size, or a lost pod recreated) is told to stand by: it warms
a spare, with no ranks, and says so once the spare is warm (coordinator.py gives it a place).

A failed pod's ranks are killed, not asked to leave: a rank whose sibling died
holds nothing the next round needs (the model comes from the surviving ranks'
memory, else the checkpoint), and a kill takes no time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import signal
import time
from enum import StrEnum
from pathlib import Path

from unbroken.rank import registry as rank_registry, rejoin
from unbroken.supervision import spare_pool, standby_rank, torchrun, warm_spare
from unbroken.supervision.rank_watch import RankDeath, RankWatch
from unbroken.supervision.spare_pool import Spare
from unbroken.config import hang_policy
from unbroken.errors import ConfigError
from unbroken.rank.env import AGENT_SOCKET, ATTEMPT, JOB, GroupPlacement
from unbroken.kubernetes.pod_launcher.arguments import PodRun
from unbroken.kubernetes.pod_launcher.link import CoordinatorLink
from unbroken.kubernetes.pod_launcher.protocol import Kind, Message
from unbroken.kubernetes.pod_launcher.relay import ProgressRelay, relay_path
from unbroken.plumbing.ports import free_port
from unbroken.plumbing.waiting import WaitTimeout, wait_until

log = logging.getLogger("unbroken.kubernetes.pod_launcher")

_RUN_ID_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
"""torchrun makes a folder named after its run id: a job named ``namespace/name`` must not make it two."""
RANK_ENTRYPOINT = "unbroken.kubernetes.pod_launcher.rank"
"""What torchrun starts: the job-wide variables for scripts that do not call unbroken.init(), then the script (rank.py)."""
POLL_SECONDS = 0.01
"""The loop's wait for a message, between looks at the ranks: a restart's latency is a few of these."""
FINISH_GRACE_SECONDS = 30.0
"""How long node rank 0's launcher, done, keeps the coordinator up for the other pods to say they are done too."""
FIRST_WORD_SECONDS = 600.0
"""How long a starting launcher waits for node rank 0's to answer its hello (torchrun's rendezvous waits as long)."""
READY_GRACE_SECONDS = 10.0
"""A member that said ready waits this much longer than the coordinator's gather timeout before it gives up alone."""


class Phase(StrEnum):
    STANDBY = "Standby"
    RUNNING = "Running"
    LEAVING = "Leaving"
    READY = "Ready"


class Failed(Exception):
    """No in-place restart: the launcher exits 1 and the operator recreates the pods."""


class Stopped(Exception):
    """SIGTERM: the pod is being deleted (a restart by the operator, the job's end)."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise Stopped()


class PodLauncher:
    def __init__(self, run: PodRun, run_dir: Path, link: CoordinatorLink, *, gather_timeout: float, relay: ProgressRelay) -> None:
        self.run = run
        self.run_dir = run_dir
        self.link = link
        self.gather_timeout = gather_timeout
        self.attempt = int(os.environ.get(ATTEMPT) or "0")
        """The operator's attempt, from the pod (its annotation): the same in every round."""
        self.round = 0
        self.group_rank = run.node_rank
        self.nnodes = run.nnodes
        """This pod's place in the current round and the round's size (the coordinator's word after round 0)."""
        self.phase = Phase.STANDBY
        self._spare_pod = False
        """The coordinator said this pod has no place now: it keeps a warm spare and waits for one."""
        self._announced = False
        """A spare pod said it stands by (once its warm spare is ready)."""
        self._hang_backoff = 1.0
        """The hang timeout's multiplier: doubled by every hang this launcher declares (``_hung``)."""
        self.ranks: torchrun.RunningWorker | None = None
        self.spare: Spare | None = None
        self._phase_started = time.monotonic()
        self._round_started = time.time()
        """Wall clock, as the ranks stamp their progress (relay.py)."""
        self.relay = relay
        self._deaths: queue.Queue[RankDeath] = queue.Queue()
        self._watch = RankWatch(self._deaths.put)
        # torchrun reads PET_* as its defaults; each pod's torchrun runs alone (the ranks meet at the rounds' stores).
        # PYTHONUNBUFFERED unless the pod says otherwise: torchrun copies its ranks' output to its stdout (the pod's
        # log) without flushing, so in an image that does not set it `kubectl logs` showed no rank's line until the
        # torchrun exited (tests/integration/test_unbroken_run.py runs its pods without it).
        self._base_env = {"PYTHONUNBUFFERED": "1", **{k: v for k, v in os.environ.items() if not k.startswith("PET_")}}

    def main(self) -> int:
        try:
            while True:
                message = self._next_message()
                done = self._step(message)
                if done:
                    self.link.send(Message(Kind.DONE))
                    return 0
        except Failed as exc:
            log.error("no in-place restart: %s; exiting for a full restart by the operator", exc,
                      extra={"round": self.round, "node_rank": self.run.node_rank})
            return 1
        except Stopped:
            log.info("stopped (SIGTERM: the pod is being deleted); stopping this pod's ranks", extra={"round": self.round})
            return 128 + signal.SIGTERM
        finally:
            self._stop_everything()

    # -- the state machine --------------------------------------------------------------

    def _step(self, message: Message | None) -> bool:
        """One look at the ranks and at ``message``; True once every rank here exited 0."""
        if message is not None and message.kind is Kind.GIVE_UP:
            raise Failed(f"the coordinator gave up: {message.why}")
        if self.phase is Phase.RUNNING:
            return self._running(message)
        if self.phase is Phase.STANDBY:
            if message is not None and message.kind is Kind.DONE:
                log.info("the job is done: this spare pod ends unused")
                return True
            self._standby(message)
        elif self.phase is Phase.LEAVING:
            self._leaving()
        else:
            self._ready(message)
        return False

    def _running(self, message: Message | None) -> bool:
        assert self.ranks is not None
        death = self._death()
        code = self.ranks.exited()
        if death is None and code == 0:
            log.info("round %d: every rank of this pod exited 0; this pod is done", self.round, extra={"round": self.round})
            return True
        if death is not None or code is not None:
            why = self._describe(death, code)
            log.warning("round %d: %s; replacing this pod's ranks", self.round, why, extra={"round": self.round})
            self.ranks.kill()
            self._leave(why, fault=True)
            return False
        if (lingering := self._lingering()) is not None:
            log.warning("round %d: %s: ending them; this pod is done", self.round, lingering, extra={"round": self.round})
            self.ranks.kill()
            return True
        left = self._left()
        if left:
            self._leave(left[min(left)], fault=False)
        elif message is not None and message.kind is Kind.HOLD and message.round == self.round:
            # the round ends elsewhere (a peer failed, a pod is lost, a hang, the job grows): the ranks are asked to
            # leave, and do at once (a rank blocked in a collective) or at their next collective (one computing)
            self._ask_to_leave(message.why)
            self._enter(Phase.LEAVING)
        elif (hung := self._hung()) is not None:
            log.warning("round %d: %s", self.round, hung, extra={"round": self.round})
            self._leave(hung, fault=False)
        return False

    def _lingering(self) -> str | None:
        """Why this pod counts as done though its torchrun tree is still there, or None: every rank said it finished
        (``ctx.finished``) longer ago than the grace, and something of theirs has not exited: a teardown stuck in a
        library. CI saw the Master pod of a finished job stay Running for minutes on real nodes after a spare pod took
        a lost node's place (most likely a rank that kept its process across rounds, its exit waiting on the lost
        node's peer, whose packets a dead link drops rather than refuses). The node agent ends such ranks the same
        way (agent/workers.py)."""
        finished = self.relay.clock.all_finished_at(self.run.nproc_per_node)
        grace = hang_policy.finished_exit_grace(self.run.hang_timeout)
        if finished is None or time.time() - finished <= grace:
            return None
        return f"every rank of this pod said it finished {time.time() - finished:.0f} s ago and its torchrun tree has not exited"

    def _hung(self) -> str | None:
        """Why this pod's ranks are hung (silent past the hang timeout, hang.py), or None."""
        if not self.run.hang_in_place:
            return None
        clock = self.relay.clock
        timeout, silent = clock.timeout(self.run.hang_timeout), clock.silent_for(time.time())
        if timeout is None or silent is None or silent <= timeout * self._hang_backoff:
            return None
        timeout *= self._hang_backoff
        # A pause this launcher had not seen yet (a first long checkpoint) may be taken for a hang: that round costs
        # little (no step lost) but must not repeat at every such pause, so each hang seen doubles the next timeout.
        self._hang_backoff *= 2
        source = "the job" if self.run.hang_timeout else "the ranks' step times"
        return (f"no step from this pod's ranks for {silent:.1f} s (a hang: the launchers' timeout is {timeout:.1f} s, "
                f"from {source})")

    def _ask_to_leave(self, why: str) -> None:
        if self.ranks is not None and self.ranks.rejoin_dir is not None and self.ranks.exited() is None:
            rejoin.request_leave(self.ranks.rejoin_dir, self.round, why)

    def _standby(self, message: Message | None) -> None:
        if message is not None and message.kind is Kind.JOIN and message.port and message.round is not None:
            self.round, self.group_rank = message.round, message.group_rank or 0
            self.nnodes = message.nnodes or self.nnodes
            if self._spare_pod:
                log.info("round %d: this spare pod takes group rank %d of %d", self.round, self.group_rank, self.nnodes,
                         extra={"round": self.round})
            self._start_ranks(f"{self.run.master_addr}:{message.port}")
            self._begin_round()
            self._enter(Phase.RUNNING)
        elif message is not None and message.kind is Kind.STAND_BY and not self._spare_pod:
            self._spare_pod = True
            log.info("spare pod (node rank %d): no place in the job now; warming a spare, no ranks until one is free",
                     self.run.node_rank)
        elif self.link.lost.is_set():
            raise Failed("the coordinator is gone (node rank 0's pod)")
        elif self._spare_pod and not self._announced and (self.spare is None or self.spare.ready()) \
                and (self.spare is not None or not self.run.warm_spare):
            self.link.send(Message(Kind.STANDBY))
            self._announced = True
        elif not self._spare_pod and time.monotonic() - self._phase_started > FIRST_WORD_SECONDS:
            raise Failed(f"no word from the coordinator at {self.link.host}:{self.link.port} (node rank 0's pod) within "
                         f"{FIRST_WORD_SECONDS:g} s")

    def _leave(self, why: str, *, fault: bool) -> None:
        """Round ``self.round`` broke here: say why, and whether a rank of this pod failed (``fault``) or its
        ranks only saw the group fail (a peer elsewhere did)."""
        if self.link.lost.is_set():
            raise Failed(f"{why}; and the coordinator is gone")
        self._ask_to_leave(why)  # this pod's other ranks, maybe blocked on the failed one, leave now
        self.link.send(Message(Kind.BROKEN, round=self.round, why=why, fault=fault))
        self._enter(Phase.LEAVING)

    def _leaving(self) -> None:
        assert self.ranks is not None
        if self.ranks.exited() is not None:
            self.ranks = None  # replaced at the join
        elif (death := self._death()) is not None:
            log.warning("round %d: %s while leaving; replacing this pod's ranks", self.round, self._describe(death, None))
            self.ranks.kill()
            self.ranks = None
        elif len(self._left()) == self.run.nproc_per_node:
            log.info("round %d: this pod's %d ranks left the process group and are held", self.round, self.run.nproc_per_node)
        elif time.monotonic() - self._phase_started > (limit := self.relay.clock.leave_timeout(self.run.abort_timeout)):
            log.warning("round %d: local ranks %s of %d left the process group, the others not within %.2f s (a few "
                        "steps, at most --abort-timeout); replacing them", self.round, sorted(self._left()),
                        self.run.nproc_per_node, limit, extra={"round": self.round})
            self.ranks.kill()
            self.ranks = None
        else:
            return
        self.link.send(Message(Kind.READY, round=self.round))
        self._enter(Phase.READY)

    def _ready(self, message: Message | None) -> None:
        if self.ranks is not None and self.ranks.exited() is not None:
            self.ranks = None  # a held rank gave up waiting: start this pod's ranks again at the join
        if message is not None and message.kind is Kind.JOIN and message.round == self.round + 1 and message.port:
            rendezvous = f"{self.run.master_addr}:{message.port}"
            self.round += 1
            if message.group_rank is not None and message.nnodes is not None:
                self.group_rank, self.nnodes = message.group_rank, message.nnodes
            if self.ranks is not None:
                assert self.ranks.rejoin_dir is not None
                self._watch_ranks()
                rejoin.post_notice(self.ranks.rejoin_dir, rejoin.RejoinNotice(
                    attempt=self.attempt, group_rank=self.group_rank, nnodes=self.nnodes, rendezvous=rendezvous,
                    round=self.round))
                log.info("round %d: the held ranks rejoin at %s as group rank %d of %d", self.round, rendezvous,
                         self.group_rank, self.nnodes, extra={"round": self.round})
            else:
                self._start_ranks(rendezvous)
            self._begin_round()
            self._enter(Phase.RUNNING)
        elif self.link.lost.is_set():
            raise Failed("the coordinator is gone (node rank 0's pod) before the next round began")
        elif time.monotonic() - self._phase_started > self.gather_timeout + READY_GRACE_SECONDS:
            raise Failed(f"no next round within {self.gather_timeout + READY_GRACE_SECONDS:g} s")

    def _begin_round(self) -> None:
        self._round_started = time.time()
        self.relay.clock.new_round(self._round_started)

    def _enter(self, phase: Phase) -> None:
        log.info("round %d: %s -> %s", self.round, self.phase, phase, extra={"round": self.round})
        self.phase = phase
        self._phase_started = time.monotonic()

    # -- the ranks ----------------------------------------------------------------------

    def _start_ranks(self, rendezvous: str) -> None:
        """This pod's torchrun for ``self.round``: the warm spare if there is one, else a new one."""
        log_dir = self.run_dir / f"round-{self.round}"
        log_dir.mkdir(parents=True, exist_ok=True)
        group = GroupPlacement(group_rank=self.group_rank, nnodes=self.nnodes, rendezvous=rendezvous,
                               rejoin_dir=log_dir / "rejoin", collective_timeout=self.run.collective_timeout, round=self.round)
        spare, self.spare = self.spare, None
        if spare is not None and not spare.alive():
            spare = None
        process, warm = torchrun.start_torchrun(
            self._torchrun_args(log_dir), {**group.to_environ(), AGENT_SOCKET: str(self.relay.path)}, working_dir=os.getcwd(), log_dir=log_dir, log="/dev/stdout",
            spare=spare, base_env=self._base_env)
        self.ranks = torchrun.RunningWorker(worker_id=self.round - 1, process=process, log_dir=log_dir, warm=warm,
                                            rejoin_dir=group.rejoin_dir, ranks=self.run.nproc_per_node,
                                            abort_timeout=self.run.abort_timeout)
        self._watch_ranks()  # forgets round - 1's: the torchrun this one replaces
        log.info("round %d: started this pod's %d ranks%s as group rank %d of %d (store %s)", self.round,
                 self.run.nproc_per_node, " on the warm spare" if warm else "", self.group_rank, self.nnodes, rendezvous,
                 extra={"round": self.round, "pid": process.pid})

    def _watch_ranks(self) -> None:
        """Watch the current torchrun's ranks under this round's number (``_death`` lets older rounds' deaths go)."""
        assert self.ranks is not None
        self._watch.forget(self.ranks.worker_id)
        self.ranks.worker_id = self.round
        self._watch.track(self.round, self.ranks.process.pid, self.run.nproc_per_node,
                          self.ranks.log_dir / "ranks" if self.ranks.warm else None)

    def _torchrun_args(self, log_dir: Path) -> list[str]:
        return ["--nnodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                "--nproc-per-node", str(self.run.nproc_per_node), "--rdzv-backend", "static",
                "--rdzv-id", _RUN_ID_UNSAFE.sub("-", os.environ.get(JOB) or "unbroken-run"), "--max-restarts", "0",
                "--monitor-interval", "0.2", "--log-dir", str(log_dir / "torchrun"), "--tee", "3",
                "--module", RANK_ENTRYPOINT, *self.run.command]

    def _left(self) -> dict[int, str]:
        """This pod's ranks that said they left the current round, with why."""
        assert self.ranks is not None and self.ranks.rejoin_dir is not None
        return rejoin.acknowledged(self.ranks.rejoin_dir, self.round, self.run.nproc_per_node)

    def _death(self) -> RankDeath | None:
        """A rank of the current torchrun that exited non-zero (others, and older rounds', are let go)."""
        while True:
            try:
                death = self._deaths.get_nowait()
            except queue.Empty:
                return None
            if death.rank.worker_id == self.round and death.exit_code != 0:
                return death

    def _describe(self, death: RankDeath | None, code: int | None) -> str:
        assert self.ranks is not None
        if death is not None:
            # the watch may have named the rank by torchrun's node-local RANK before it registered its global one
            assert self.ranks.rejoin_dir is not None
            identity = rank_registry.identify(death.rank.pid, {rank_registry.IN_PROCESS_REGISTRY: str(self.ranks.rejoin_dir)}, None)
            rank = identity.rank if identity is not None else death.rank.rank
            return torchrun.rank_exit_message(rank, death.rank.local_rank, death.exit_code, self.ranks.log_dir)
        return torchrun.describe_exit(code or 1, self.ranks.log_dir)[1]

    def keep_spare(self) -> None:
        """Start the warm spare once every rank of this pod has stepped in this round (relay.py): warming imports
        torch, which must not slow a round's startup."""
        stepped = self.relay.stepped_since(self._round_started)  # read every pass: it empties the relay's queue
        if not self.run.warm_spare or (self.spare is not None and self.spare.alive()):
            return
        spare_pod = self.phase is Phase.STANDBY and self._spare_pod
        if not spare_pod and (self.phase is not Phase.RUNNING or self.ranks is None or stepped < self.run.nproc_per_node):
            return
        ready_file = self.run_dir / f"spare-{time.monotonic_ns()}.ready"
        self.spare = spare_pool.start_spare(f"pod-{self.run.node_rank}", torchrun.TRAMPOLINE,
                                            {**self._base_env, warm_spare.READY_FILE: str(ready_file),
                                             standby_rank.LOCAL_RANKS: str(self.run.nproc_per_node)},
                                            cwd=os.getcwd(), out=None, ready_file=ready_file)
        log.info("warm spare started: it imports torch, then prints that it is ready", extra={"pid": self.spare.process.pid})

    def _next_message(self) -> Message | None:
        self.keep_spare()
        try:
            return self.link.inbox.get(timeout=POLL_SECONDS)
        except queue.Empty:
            return None

    def _stop_everything(self) -> None:
        self._watch.close()
        if self.ranks is not None and self.ranks.exited() is None:
            # Killed, not asked: the pod is going (its name, which the next attempt's pod takes, stays in use until
            # its processes are gone), and the ranks' state is in the checkpoint tiers already.
            self.ranks.kill()
        if self.spare is not None:
            spare_pool.release(self.spare)
        self.link.close()


def serve(run: PodRun, run_dir: Path) -> int:
    """The launcher's life: node rank 0 also serves the coordinator (in a thread of this process)."""
    from unbroken.kubernetes.pod_launcher.coordinator import Coordinator

    gather_timeout = run.abort_timeout + 20.0  # the ranks' leaving, then a replacement's kill and a message each way
    coordinator = None
    if run.node_rank == 0:
        try:
            coordinator = Coordinator(run.nnodes, run.coordinator_port, max_restarts=run.max_restarts,
                                      gather_timeout=gather_timeout, fewest=run.fewest, first_port=run.master_port,
                                      spare_pods=run.spare_pods)
        except OSError as exc:
            raise ConfigError(f"unbroken run --coordinator-port {run.coordinator_port}: cannot listen there ({os.strerror(exc.errno) if exc.errno else exc}); "
                              "give a free port (default: --master-port + 1)") from exc
        coordinator.start()
    link = CoordinatorLink(run.master_addr if coordinator is None else "127.0.0.1", run.coordinator_port, run.node_rank)
    link.start()
    signal.signal(signal.SIGTERM, _on_sigterm)
    agent_socket = os.environ.get(AGENT_SOCKET)
    relay = ProgressRelay(relay_path(run_dir), Path(agent_socket) if agent_socket else None)
    try:
        code = PodLauncher(run, run_dir, link, gather_timeout=gather_timeout, relay=relay).main()
        if code == 0 and coordinator is not None:
            # the other pods (spare pods above all) hear that the job is over from this coordinator: let them
            with contextlib.suppress(WaitTimeout):
                wait_until(lambda: coordinator.state.finished, FINISH_GRACE_SECONDS, "every pod done")
        return code
    finally:
        relay.close()
        if coordinator is not None:
            coordinator.close()
