"""The local backend's worker runner in each agent: what a kubelet is to its pods.

It reads the worker rows of its node (what the controller, through the local
backend, wants run or stopped), launches and stops ``torchrun`` groups to
match, and writes back what it sees: Running with a pid, then Succeeded,
Failed (with the failing rank and its exit code) or Stopped. It keeps only the
``Popen`` handles of the workers it started: after an agent restart, workers
it cannot see are stopped and reported lost.

A rank that dies of its own accord fails its worker at once (``rank_died``,
from the rank watch: supervision/rank_watch.py) and rings the controller's doorbell,
without waiting for torchrun to notice, stop the other ranks and exit; the row
is then closed, so the next pass stops what is left of the group. Every other
closing write (stopped, succeeded, failed at torchrun's exit) rings it too.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from unbroken.plumbing import doorbell, procs
from unbroken.rank import rejoin
from unbroken.agent import held
from unbroken.supervision import torchrun
from unbroken.agent.progress import ProgressBook
from unbroken.supervision.rank_watch import RankDeath, RankWatch
from unbroken.supervision.spare_pool import SparePool
from unbroken.config import hang_policy
from unbroken.config.job import JobSpec
from unbroken.errors import NotFoundError
from unbroken.rank.env import LaunchEnv
from unbroken.plumbing.layout import ClusterLayout
from unbroken.state.phases import NodeState, WorkerPhase
from unbroken.state.records import Desired, EventType, Worker, WorkerProgress
from unbroken.state.store import ClusterStore
from unbroken.state.updates import WorkerUpdate
from unbroken.state.worker_table import WorkerTable

log = logging.getLogger("unbroken.agent.workers")

def finished_exit_grace(spec: JobSpec | None) -> float:
    """hang_policy's grace for the job's hang timeout."""
    return hang_policy.finished_exit_grace(spec.resilience.hang_timeout if spec is not None else None)


JOBS_READ_SECONDS = 2.0
"""How often an agent looks for running jobs it could keep a warm spare for (a SQLite read)."""


class WorkerRunner:
    def __init__(self, node: str, table: WorkerTable, store: ClusterStore, layout: ClusterLayout, book: ProgressBook,
                 launch_settings: Callable[[], torchrun.NodeSettings]) -> None:
        self.node = node
        self.table = table
        self.store = store
        self.layout = layout
        self.book = book
        self.launch_settings = launch_settings
        """Where this node's ranks find their agent (socket, shard server) and its address, read at launch."""
        self.running: dict[int, torchrun.RunningWorker] = {}
        self._lock = threading.Lock()
        """Held by a pass and by ``rank_died`` (the watch's thread): one writer of a worker's closing row."""
        self.watch = RankWatch(self.rank_died)
        self.spares = SparePool(node, layout.node_dir(node), torchrun.TRAMPOLINE)
        self._spare_wants: dict[int, tuple[JobSpec, dict[str, str]]] = {}
        """By worker id, for the running workers whose job keeps warm spares: its spec and environment."""
        self._jobs_wanting: dict[str, tuple[JobSpec, dict[str, str]]] = {}
        self._jobs_read_at = float("-inf")
        self.held = held.HeldWorkers()
        """Workers kept for the next attempt of their job (in-process restarts), by job."""
        self._unread_deaths: dict[int, RankDeath] = {}
        """By worker id: its first rank that ended with a status torchrun reaped before the watch read it."""

    def reconcile(self) -> None:
        with self._lock:
            self._reconcile()

    def rank_died(self, death: RankDeath) -> None:
        """A rank of a running worker exited non-zero on its own: the worker has failed; say so now."""
        if death.exit_code == 0:
            return
        if death.exit_code is None and not death.warm:
            # torchrun reaped it before we read how it ended (a busy node): maybe a clean exit.
            # If torchrun now stops the others with SIGTERM, this one failed first: name it, not them.
            with self._lock:
                self._unread_deaths.setdefault(death.rank.worker_id, death)
            return
        with self._lock:
            first = self._unread_deaths.pop(death.rank.worker_id, None)
            if first is not None and death.exit_code == -signal.SIGTERM:
                death = first
            running = self.running.get(death.rank.worker_id)
            if running is None or running.stop_started is not None or running.reported:
                return
            worker = next((w for w in self.table.list_workers(node=self.node, active=True) if w.id == death.rank.worker_id), None)
            if worker is None:
                return
            running.reported = True
            running.reported_unread = death.exit_code is None or death.exit_code == -signal.SIGTERM
            message = torchrun.rank_exit_message(death.rank.rank, death.rank.local_rank, death.exit_code, running.log_dir)
            last = _progress_update(self.book.take(worker.job, worker.attempt))
            self.table.update_worker(worker.id, WorkerUpdate(phase=WorkerPhase.FAILED, exit_code=death.exit_code, ended_at=time.time(),
                                                             message=message, **last))
        doorbell.ring(self.layout.controller_doorbell)
        log.warning("worker failed: %s (seen by the agent; torchrun is stopping the other ranks)", message,
                    extra={"node": self.node, "job": worker.job, "attempt": worker.attempt, "pid": death.rank.pid})

    def close(self) -> None:
        self.watch.close()
        self.spares.close()

    def _reconcile(self) -> None:
        active = self.table.list_workers(node=self.node, active=True)
        self._stop_unwanted({w.id for w in active})
        for worker in active:
            running = self.running.get(worker.id)
            if running is None:
                self._reconcile_unstarted(worker)
                continue
            code = running.exited()
            if code is not None:
                self._record_exit(worker, running, code)
            elif worker.desired is Desired.RUN and running.stop_started is None and self._lingers(worker, running):
                self._end_lingering(worker, running)
            elif worker.desired is Desired.HOLD and running.rejoin_dir is not None and running.stop_started is None:
                self._hold(worker, running)
            elif worker.desired is Desired.RUN and worker.phase is WorkerPhase.RUNNING and running.rejoin_dir is not None:
                self._notice_interruption(worker, running)
            elif worker.desired is not Desired.RUN:  # Stop, or Hold of a worker that cannot be held
                running.begin_stop()
                running.continue_stop()
        if self.held:
            self.held.expire(self._job_over)
        self._keep_spares(active)

    def _hold(self, worker: Worker, running: torchrun.RunningWorker) -> None:
        """An in-process restart (agent/held.py): keep the worker once its ranks left their process group."""
        verdict, left = held.leaving(running, worker.attempt, time.monotonic())
        extra = {"node": self.node, "job": worker.job, "attempt": worker.attempt, "pid": running.process.pid}
        if verdict is held.Leaving.TIMED_OUT:
            log.warning("in-process restart: local ranks %s of %d did not leave the process group within %g s; "
                        "stopping the worker (full restart)", sorted(left), running.ranks, running.abort_timeout, extra=extra)
            running.begin_stop()
            return
        if verdict is held.Leaving.WAITING:
            return
        self._forget(worker.id)
        self.held.keep(worker.job, running, worker.attempt)
        last = _progress_update(self.book.take(worker.job, worker.attempt))
        self.table.update_worker(worker.id, WorkerUpdate(
            phase=WorkerPhase.STOPPED, ended_at=time.time(), exit_code=None,
            message=f"held for an in-process restart: its {running.ranks} ranks left the process group", **last))
        doorbell.ring(self.layout.controller_doorbell)
        log.info("in-process restart: worker held for the next attempt", extra=extra)

    def _lingers(self, worker: Worker, running: torchrun.RunningWorker) -> bool:
        """Every rank of the worker said it finished, and the worker is still there past the grace."""
        done = self.book.finished_at(worker.job, worker.attempt, running.ranks)
        return done is not None and time.time() - done > finished_exit_grace(self._spec_of(worker))

    def _end_lingering(self, worker: Worker, running: torchrun.RunningWorker) -> None:
        """Ranks that said they finished and did not exit (a teardown stuck in a library, a torchrun waiting for a
        value that never comes): nobody would time them, and the job would stay Running. End them; the worker is
        judged on what its ranks reported, with an Event that says so."""
        grace = finished_exit_grace(self._spec_of(worker))
        message = (f"every rank of the worker said it finished, and {running.ranks} rank(s) or their torchrun had not exited "
                   f"{grace:g} s later: ended them, and the worker counts as succeeded")
        self.store.add_event("Job", worker.job, "RanksEndedAfterFinishing", f"{message} (node {self.node})", type=EventType.WARNING)
        log.warning(message, extra={"node": self.node, "job": worker.job, "attempt": worker.attempt, "pid": running.process.pid})
        running.finished_lingering = True
        running.begin_stop()

    def _spec_of(self, worker: Worker) -> JobSpec | None:
        try:
            return self.store.get_job(worker.job).spec()
        except NotFoundError:
            return None

    def _notice_interruption(self, worker: Worker, running: torchrun.RunningWorker) -> None:
        """A rank that left its process group (in-process restarts) means the attempt is broken: say so now.
        When a whole node is lost nobody else reports the dead ranks until the node is declared lost."""
        assert running.rejoin_dir is not None
        left = rejoin.acknowledged(running.rejoin_dir, worker.attempt, running.ranks)
        if not left:
            return
        why = left[min(left)]
        self.table.update_worker(worker.id, WorkerUpdate(phase=WorkerPhase.INTERRUPTED,
                                                         message=f"ranks left the process group: {why}"))
        doorbell.ring(self.layout.controller_doorbell)
        log.warning("worker interrupted: %s", why, extra={"node": self.node, "job": worker.job, "attempt": worker.attempt})

    def _job_over(self, job: str) -> bool:
        try:
            return self.store.get_job(job).phase.is_terminal
        except NotFoundError:
            return True

    def _keep_spares(self, active: list[Worker]) -> None:
        """Warm spares for the unfinished jobs that want them: those that run here, and, on a
        Schedulable node, the others (a lost node's replacement then starts warm too; and a job
        between two attempts keeps its spares here). New ones only once every worker here has
        stepped: warming never competes with a startup for the node's cores."""
        wanted = dict(self._jobs_wanting_spares())
        starting = False
        for worker in active:
            if worker.id not in self.running:
                continue
            if worker.desired is not Desired.STOP:
                starting = starting or not self.book.stepped(worker.job, worker.attempt)
            if worker.id in self._spare_wants:
                wanted[worker.job] = self._spare_wants[worker.id]
        self.spares.keep(wanted, may_start=not starting)

    def _jobs_wanting_spares(self) -> dict[str, tuple[JobSpec, dict[str, str]]]:
        """The unfinished jobs with warm spares, if this node is Schedulable: read every few seconds, not every pass."""
        now = time.monotonic()
        if now - self._jobs_read_at < JOBS_READ_SECONDS:
            return self._jobs_wanting
        self._jobs_read_at = now
        self._jobs_wanting = {}
        if self.store.get_node(self.node).state is NodeState.SCHEDULABLE:
            for job in self.store.list_jobs():
                if job.phase.is_terminal:
                    continue
                spec = job.spec()
                if spec.resilience.warm_spares:
                    self._jobs_wanting[job.name] = (spec, torchrun.job_environ(spec, self._launch_env(spec, job.name, job.attempt)))
        return self._jobs_wanting

    def stop_orphans(self) -> None:
        """Workers this node ran before the agent restarted are gone or unmanageable: stop them."""
        for worker in self.table.list_workers(node=self.node, active=True):
            if worker.phase in (WorkerPhase.RUNNING, WorkerPhase.INTERRUPTED) and worker.pid and procs.alive(worker.pid):
                procs.terminate_tree(worker.pid, grace=1.0)

    def kill_all(self) -> None:
        for running in list(self.running.values()):
            running.kill()
        self.held.kill_all()

    def _stop_unwanted(self, active_ids: set[int]) -> None:
        """Stop processes whose worker row was closed by someone else (the controller
        gave them up as lost): a row that says Stopped must not hide a live process."""
        for worker_id, running in list(self.running.items()):
            if worker_id in active_ids:
                continue
            if running.exited() is not None:
                if running.reported_unread:
                    self._name_the_unread_exit(worker_id, running)
                self._forget(worker_id)
            else:
                running.begin_stop()
                running.continue_stop()

    def _name_the_unread_exit(self, worker_id: int, running: torchrun.RunningWorker) -> None:
        """The failure this worker reported named a rank torchrun reaped before we read how it ended, or
        one it stopped with SIGTERM (maybe its teardown after a rank we never watched). torchrun's root
        cause, written as it exits, says how: the row gets it, and the controller names it in a
        JobRestartCause event (the restart was not delayed for it)."""
        cause = torchrun.root_cause(running.log_dir)
        if cause is None or cause[0] == -signal.SIGTERM:  # torchrun knows no better
            return
        exit_code, message = cause
        self.table.update_worker(worker_id, WorkerUpdate(exit_code=exit_code, message=message))
        doorbell.ring(self.layout.controller_doorbell)
        log.info("worker failure named: %s (from torchrun's root cause)", message, extra={"node": self.node, "pid": running.process.pid})

    def _forget(self, worker_id: int) -> None:
        """The worker's processes are no longer ours to run (exited, held, or given up): drop what we track of them."""
        del self.running[worker_id]
        self._unread_deaths.pop(worker_id, None)
        self._spare_wants.pop(worker_id, None)
        self.watch.forget(worker_id)

    def _reconcile_unstarted(self, worker: Worker) -> None:
        if worker.desired is Desired.STOP:
            self.table.update_worker(worker.id, WorkerUpdate(phase=WorkerPhase.STOPPED, ended_at=time.time(),
                                                             message="stopped before launch"))
        elif worker.phase is WorkerPhase.PENDING:
            kept = self.held.take(worker.job)
            if kept is not None:
                self._adopt(worker, kept)
            else:
                self._launch(worker)
        else:  # Running but not ours: launched by a previous incarnation of this agent
            if worker.pid:
                procs.terminate_tree(worker.pid, grace=1.0)
            self.table.update_worker(worker.id, WorkerUpdate(phase=WorkerPhase.STOPPED, ended_at=time.time(),
                                                             message="lost: node agent restarted"))

    def _launch(self, worker: Worker) -> None:
        job = self.store.get_job(worker.job)
        spec = job.spec()
        # The attempt's placement is its size: an elastic job runs on fewer nodes than spec.nodes.
        nnodes = len(job.nodes) if job.attempt == worker.attempt and job.nodes else spec.nodes
        log_dir = self.layout.worker_log_dir(worker.job, worker.attempt, self.node)
        checkpoint_dir = spec.checkpoint.dir or self.layout.checkpoint_dir(worker.job)
        spare = self.spares.take(worker.job)
        try:
            running = torchrun.launch(spec, worker, cluster_dir=self.layout.root, node=self.node, log_dir=log_dir,
                                      checkpoint_dir=checkpoint_dir, settings=self.launch_settings(), nnodes=nnodes, spare=spare)
        except OSError as exc:
            # e.g. the working_dir was deleted: the job's fault, not the node's. Report it
            # as a failed worker instead of letting the agent die and the node look lost.
            message = f"cannot start torchrun in {spec.working_dir}: {exc.strerror or exc}"
            self.table.update_worker(worker.id, WorkerUpdate(phase=WorkerPhase.FAILED, ended_at=time.time(), exit_code=127,
                                                             message=message))
            log.error(message, extra={"node": self.node, "job": worker.job})
            return
        self.running[worker.id] = running
        if spec.resilience.warm_spares:
            self._spare_wants[worker.id] = (spec, torchrun.job_environ(spec, self._launch_env(spec, worker.job, worker.attempt)))
        self.watch.track(worker.id, running.process.pid, spec.procs_per_node, log_dir / "ranks" if running.warm else None)
        self.table.update_worker(worker.id, WorkerUpdate(phase=WorkerPhase.RUNNING, pid=running.process.pid,
                                                         started_at=time.time(), log_dir=str(log_dir)))
        log.info("launched worker%s", " on a warm spare" if running.warm else "",
                 extra={"node": self.node, "job": worker.job, "attempt": worker.attempt, "pid": running.process.pid})

    def _adopt(self, worker: Worker, kept: held.Held) -> None:
        """The next attempt takes the worker held here: its ranks get the notice and re-form the group."""
        job = self.store.get_job(worker.job)
        running = kept.running
        assert running.rejoin_dir is not None
        rejoin.post_notice(running.rejoin_dir, rejoin.RejoinNotice(
            attempt=worker.attempt, group_rank=worker.node_rank, nnodes=len(job.nodes) if job.nodes else job.spec().nodes,
            rendezvous=worker.rdzv_endpoint))
        running.worker_id = worker.id
        self.running[worker.id] = running
        self.watch.track(worker.id, running.process.pid, running.ranks, running.log_dir / "ranks" if running.warm else None)
        spec = job.spec()
        if spec.resilience.warm_spares:
            self._spare_wants[worker.id] = (spec, torchrun.job_environ(spec, self._launch_env(spec, worker.job, worker.attempt)))
        # The logs stay where the process writes them: the folder of the attempt that launched it.
        self.table.update_worker(worker.id, WorkerUpdate(phase=WorkerPhase.RUNNING, pid=running.process.pid,
                                                         started_at=time.time(), log_dir=str(running.log_dir)))
        log.info("in-process restart: the held worker of attempt %d joins attempt %d as node rank %d", kept.attempt,
                 worker.attempt, worker.node_rank, extra={"node": self.node, "job": worker.job, "attempt": worker.attempt,
                                                          "pid": running.process.pid})

    def _launch_env(self, spec: JobSpec, job: str, attempt: int) -> LaunchEnv:
        checkpoint_dir = spec.checkpoint.dir or self.layout.checkpoint_dir(job)
        return torchrun.launch_environ(spec, job, attempt, cluster_dir=self.layout.root, node=self.node,
                                       checkpoint_dir=checkpoint_dir, settings=self.launch_settings())

    def _record_exit(self, worker: Worker, running: torchrun.RunningWorker, code: int) -> None:
        self._forget(worker.id)
        # Stopped only if we stopped it: a worker that died on its own before the stop request
        # reached it keeps its real exit, which is what names the cause of a restart.
        if running.finished_lingering:
            phase, exit_code, message = WorkerPhase.SUCCEEDED, 0, "every rank reported finished; ended after it did not exit"
        elif running.stop_started is not None:
            phase, exit_code, message = WorkerPhase.STOPPED, code, "stopped by the controller"
        elif code == 0:
            phase, exit_code, message = WorkerPhase.SUCCEEDED, 0, "all ranks exited 0"
        else:
            phase = WorkerPhase.FAILED
            exit_code, message = torchrun.describe_exit(code, running.log_dir)
        # The worker's last steps go with its closing write, not with the next lease renewal.
        last = _progress_update(self.book.take(worker.job, worker.attempt))
        self.table.update_worker(worker.id, WorkerUpdate(phase=phase, exit_code=exit_code, ended_at=time.time(), message=message,
                                                         **last))
        # A restart waits for every stopped worker of the attempt, a finished job for its last one:
        # the controller's next pass should not wait out its sleep to see it.
        doorbell.ring(self.layout.controller_doorbell)
        level = logging.WARNING if phase is WorkerPhase.FAILED else logging.INFO
        log.log(level, "worker %s: %s", phase.value, message, extra={"node": self.node, "job": worker.job, "attempt": worker.attempt})


def _progress_update(progress: WorkerProgress | None) -> dict[str, Any]:
    if progress is None:
        return {}
    fields = ("ranks", "first_step", "first_progress_at", "last_step", "last_progress_at", "restored_step", "checkpoint_stall_s", "saved_step",
              "divergence", "finished_at")
    return {name: value for name in fields if (value := getattr(progress, name)) is not None}

