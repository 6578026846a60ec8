"""Applies job decisions: read → decide → write the decision (versioned) → have the backend carry it out.

The decision is committed first, as a conditional write of the job: its new
phase, attempt and placement. The backend's part (launch or stop an attempt) is
idempotent and also re-applied level-triggered on every pass (a Running job
whose attempt has no workers is launched again; workers nobody wants are
stopped), so a controller killed between the two loses nothing.
"""

from __future__ import annotations

import logging

from unbroken.backends.base import Backend
from unbroken.config.job import JobSpec, StragglerPolicy
from unbroken.controller import divergence, hang_timeout, job_decisions, stragglers
from unbroken.health import faults
from unbroken.health.result import FaultAction
from unbroken.state.catalog import CheckpointCatalog
from unbroken.controller.job_decisions import Action, Decision
from unbroken.errors import StoreUnavailable, UnbrokenError
from unbroken.state.phases import JobPhase, NodeState, WorkerPhase
from unbroken.state.records import Desired, EventType, Job, Node, Worker
from unbroken.state.store import ClusterStore, StaleUpdate
from unbroken.state.updates import JobUpdate, NodeUpdate

log = logging.getLogger("unbroken.controller.jobs")

LAUNCH_FOLLOW_SECONDS = 20.0
"""How long after an attempt's launch none of its workers may still be waiting before unbroken says what for (and,
where nothing of it exists, launches it once more). Pods pulling a large image take longer: waiting on that is not
reported (Backend.attempt_waits_for)."""
STRAGGLER = "Straggler"
"""The fault type of a node taken out for being slow (``straggler_policy: replace``)."""

_STOPPED = {Action.RESTART: (JobPhase.RESTARTING, "JobRestarting"), Action.FAIL: (JobPhase.FAILED, "JobFailed"),
            Action.CANCEL: (JobPhase.CANCELLED, "JobCancelled"), Action.RESIZE: (JobPhase.RESTARTING, "JobResizing")}


class JobReconciler:
    def __init__(self, store: ClusterStore, backend: Backend, *, silent_after: float, catalog: CheckpointCatalog | None = None) -> None:
        self.store = store
        self.backend = backend
        self.catalog = catalog
        """Where a divergence's untrusted checkpoint steps are marked (None: a test's reconciler without checkpoints)."""
        self.silent_after = silent_after
        self._warned: dict[str, str] = {}
        """job -> the last reconcile failure warned about in an Event (memory only: a new controller warns once again)."""
        self.stragglers = stragglers.StragglerWatch()
        self._hang_timeouts: dict[str, hang_timeout.HangTimeout] = {}
        """job -> its last hang timeout measured from step times (memory only: a new controller measures again)."""
        self._launch_waits: dict[tuple[str, int], str] = {}
        """(job, attempt) -> what it was last reported waiting for (memory only: a new controller reports once again)."""
        self._nudged: set[tuple[str, int]] = set()
        """Attempts launched once more (at most once each)."""
        self._startups: dict[str, float] = {}
        """job -> the slowest launch-to-first-step seen among its attempts (memory only, as above)."""
        self._grow_noticed: dict[tuple[str, int], int] = {}
        """(job, attempt) of an elastic job that could grow → the step it had saved when first seen
        so; it grows after a newer one. Memory only: a new controller notices again, one checkpoint later."""

    def reconcile_all(self, now: float) -> None:
        """One pass: nodes and busy nodes are read once and shared by every job. Where the backend's scheduler
        places the workers (Kubernetes), no node is busy: the scheduler knows what fits, unbroken does not."""
        nodes = {n.name: n for n in self.store.list_nodes()}
        jobs = self.store.list_jobs()
        active = self.release_workers_on_lost_nodes(now, nodes)
        self.stop_unwanted(active, {j.name: j for j in jobs})
        places = self.backend.places_workers
        busy = set() if places else {w.node for w in active}
        for job in jobs:
            if not job.phase.is_terminal:
                try:
                    decision = self.reconcile(now, job, nodes, busy)
                except StaleUpdate:
                    continue  # changed under us (e.g. cancel); the next pass sees the new state
                except StoreUnavailable:
                    raise  # the store is away, not this job: the whole pass waits for it
                except UnbrokenError as exc:
                    self._warn(job, exc)  # this job's own trouble: it waits, every other job goes on
                    continue
                self._warned.pop(job.name, None)
                if not places:
                    busy.update(decision.nodes)  # so the next job in this pass cannot take them

    def _warn(self, job: Job, exc: UnbrokenError) -> None:
        """One Warning Event per distinct failure of one job's reconcile, naming the job and why."""
        message = f"{type(exc).__name__}: {exc}"
        log.warning("job %s: reconcile failed, skipped this pass: %s", job.name, message, extra={"job": job.name})
        if self._warned.get(job.name) != message:
            self._warned[job.name] = message
            self.store.add_event("Job", job.name, "JobReconcileFailed",
                                 f"{job.name} could not be reconciled and waits; every other job goes on: {message}",
                                 type=EventType.WARNING)

    def reconcile(self, now: float, job: Job, nodes: dict[str, Node], busy: set[str]) -> Decision:
        if job.phase is JobPhase.PENDING and not job.cancel_requested and (held := self.backend.held(job.name)) is not None:
            # Not unbroken's to start (a queue has not admitted it): it waits, saying why, and is never unsuspended.
            if job.reason != held:
                self.store.add_event("Job", job.name, "JobHeld", held)
            decision = Decision(Action.WAIT, held)
            self._apply(now, job, decision, nodes)
            return decision
        spec = job.spec()
        workers = self.backend.observe_attempt(job.name, job.attempt)
        if job.phase is JobPhase.RUNNING and not workers and job.nodes:
            # Placed, but the launch never happened (the controller died in between): launch it now.
            self.backend.launch_attempt(job, job.attempt, [nodes[n] for n in job.nodes if n in nodes])
            workers = self.backend.observe_attempt(job.name, job.attempt)
        # The job's own current workers do not make a node busy for it: on Kubernetes a job that
        # is adopted already has pods (placed by the scheduler) before its first decision.
        taken = busy - {w.node for w in workers}
        free = [n.name for n in nodes.values()
                if n.name not in taken and job_decisions.eligible(n, spec, now, self.silent_after)]
        if spec.resilience.in_process_restart and job.phase is JobPhase.RESTARTING:
            # the last attempt's nodes first: their agents hold its workers, which the next attempt adopts
            free.sort(key=lambda name: name not in job.nodes)
        hang = hang_timeout.in_force(spec, workers, previous=self._hang_timeouts.get(job.name))
        if hang.measured:
            self._hang_timeouts[job.name] = hang
        seen = hang_timeout.observed_startup(workers)
        if seen is not None and seen > self._startups.get(job.name, 0.0):
            self._startups[job.name] = seen
        startup = hang_timeout.startup_in_force(spec, self._startups.get(job.name))
        decision = job_decisions.decide(now, job, spec, workers, nodes, free, silent_after=self.silent_after,
                                        grow_after=self._noticed_growth(job, spec, workers, free), hang=hang, startup=startup)
        if decision.action is not Action.WAIT:
            log.info("job %s: %s: %s", job.name, decision.action.value, decision.reason, extra={"job": job.name})
        # A resume the attempt reported goes before what this pass decides: when an attempt's
        # first step and its failure arrive together, the events still read in the order they happened.
        self._note_resume(job, workers)
        self._note_cause(job, workers)
        if job.phase is JobPhase.RUNNING and decision.action is Action.WAIT:
            self._follow_launch(now, job, workers)
            if self._watch_stragglers(now, job, spec, workers, nodes, free):
                # a straggler was taken out (``nodes`` holds its new state): restart now, naming it as the
                # cause, rather than a pass later on its peers' broken connections
                decision = job_decisions.decide(now, job, spec, workers, nodes, free, silent_after=self.silent_after, hang=hang,
                                                startup=startup)
        elif decision.action is not Action.WAIT:
            self.stragglers.forget(job.name)  # a new attempt is scored afresh
        if decision.action in (Action.FAIL, Action.SUCCEED, Action.CANCEL):
            self._hang_timeouts.pop(job.name, None)
            self._startups.pop(job.name, None)
            self._launch_waits = {key: why for key, why in self._launch_waits.items() if key[0] != job.name}
            self._nudged = {key for key in self._nudged if key[0] != job.name}
        if decision.action in (Action.RESTART, Action.FAIL) or job.phase is JobPhase.RESTARTING:
            self._answer_divergence(job, workers, nodes, first=job.phase is JobPhase.RUNNING)
        self._apply(now, job, decision, nodes)
        return decision

    def _answer_divergence(self, job: Job, workers: list[Worker], nodes: dict[str, Node], *, first: bool) -> None:
        """The attempt's replicas diverged: mark its checkpoints after the agreed step untrusted (on every pass until
        the next attempt is placed: a commit may race the first mark), and on the first pass take the suspects out."""
        found = divergence.find(workers)
        if found is None:
            return
        why = divergence.reason(found)
        marked = divergence.distrust(self.catalog, job.name, found.divergence, job.attempt, why) if self.catalog is not None else []
        if not first:
            if marked:
                self.store.add_event("Job", job.name, "CheckpointsUntrusted", f"steps {_steps(marked)} marked untrusted (committed "
                                     "after the first mark)", type=EventType.WARNING)
            return
        outcome = [self._take_out(name, found, why) for name in found.suspect_nodes]
        untrusted = f"checkpoint steps {_steps(marked)} marked untrusted" if marked else "no checkpoint after it to untrust"
        self.store.add_event("Job", job.name, faults.SILENT_DATA_CORRUPTION,
                             f"{why}; {untrusted}; " + ("; ".join(o for o in outcome if o) or "no suspect node to take out"),
                             type=EventType.WARNING)

    def _take_out(self, name: str, found: divergence.Found, why: str) -> str:
        """Outvoted: replace the node now. No majority: cordon it for its agent's known-answer check."""
        for _ in range(3):
            node = self.store.get_node(name)
            if found.divergence.majority:
                target = faults.decide(node, FaultAction.REPLACE, why, faults.SILENT_DATA_CORRUPTION).target
                fault_type, said = faults.SILENT_DATA_CORRUPTION, f"node {name} taken out ({faults.SILENT_DATA_CORRUPTION})"
            else:
                target = NodeState.UNSCHEDULABLE if node.state is NodeState.SCHEDULABLE else None
                fault_type, said = faults.SDC_SUSPECT, f"node {name} cordoned until its known-answer check"
            if target is None:
                return f"node {name} already {node.state.value}"
            try:
                self.store.update_node(name, NodeUpdate(state=target, fault_type=fault_type, fault_reason=why[:200]),
                                       expect_version=node.version)
            except StaleUpdate:
                continue
            self.store.add_event("Node", name, fault_type, why, type=EventType.WARNING)
            return said
        return f"node {name} kept changing; not taken out"

    def _watch_stragglers(self, now: float, job: Job, spec: JobSpec, workers: list[Worker], nodes: dict[str, Node],
                          free: list[str]) -> bool:
        """Score the attempt's nodes; an Event when one becomes (or stops being) a straggler, and under
        ``replace`` the node taken out when a spare is free and it is worth a restart (True)."""
        policy = spec.resilience.straggler_policy
        if policy is StragglerPolicy.OFF:
            return False
        steps = [w.last_step for w in workers if not w.phase.is_terminal]
        step = min(s for s in steps if s is not None) if steps and None not in steps else None
        scored = stragglers.scores(workers)
        for change in self.stragglers.observe(job.name, job.attempt, step, scored,
                                              spec.resilience.straggler_threshold):
            score = change.score
            if not change.straggler:
                self.store.add_event("Job", job.name, "StragglerRecovered",
                                     f"node {change.node} keeps pace again: {stragglers.describe(score)} at step {step}")
                continue
            log.warning("job %s: node %s is a straggler: %s", job.name, change.node, stragglers.describe(score),
                        extra={"job": job.name, "node": change.node, "score": score.score})
            self.store.add_event("Job", job.name, "StragglerDetected",
                                 f"node {change.node} is a straggler: {stragglers.describe(score)} against the job's other "
                                 f"nodes (threshold {spec.resilience.straggler_threshold:g}) at step {step}; policy "
                                 f"{policy.value}", type=EventType.WARNING)
        if policy in (StragglerPolicy.REPLACE, StragglerPolicy.SHADOW):
            return self._replace_stragglers(now, job, spec, workers, nodes, free, scored)
        return False

    def _replace_stragglers(self, now: float, job: Job, spec: JobSpec, workers: list[Worker], nodes: dict[str, Node],
                            free: list[str], scored: dict[str, stragglers.NodeScore]) -> bool:
        own = {w.node for w in workers}
        spares = [n for n in free if n not in own]
        started = [w.first_progress_at for w in workers if w.first_progress_at is not None]
        running = now - min(started) if started else 0.0
        cost = spec.resilience.straggler_restart_cost
        replaced = False
        for name in self.stragglers.stragglers(job.name, job.attempt):
            node, score = nodes.get(name), scored.get(name)
            if node is None or score is None or node.state is not NodeState.SCHEDULABLE:
                continue
            if not spares or not stragglers.worth_replacing(score.score, running, cost):
                continue  # looked at again next pass: a spare frees up, the job runs long enough
            why = (f"straggler in job {job.name}: {stragglers.describe(score)}; expected loss over the job's remaining "
                   f"run ({running:.0f} s x {1 - score.score:.2f}) exceeds a restart (~{cost:g} s); "
                   f"spare {spares[0]} free")
            if spec.resilience.straggler_policy is StragglerPolicy.SHADOW:
                if self.stragglers.shadowed(job.name, job.attempt, name):
                    self.store.add_event("Job", job.name, "StragglerReplaceShadow", f"would take out node {name} now: {why}")
                continue
            try:
                nodes[name] = self.store.update_node(name, NodeUpdate(state=NodeState.PENDING_REPLACEMENT, fault_type=STRAGGLER,
                                                                      fault_reason=why[:200]), expect_version=node.version)
            except StaleUpdate:
                continue  # changed under us: the next pass looks again
            replaced = True
            self.store.add_event("Node", name, STRAGGLER, why, type=EventType.WARNING)
            self.store.add_event("Job", job.name, "StragglerReplaced", f"node {name} taken out: {why}", type=EventType.WARNING)
            spares.pop(0)
        return replaced

    def _noticed_growth(self, job: Job, spec: JobSpec, workers: list[Worker], free: list[str]) -> int | None:
        key = (job.name, job.attempt)
        if not job_decisions.growth(job, spec, free):
            self._grow_noticed.pop(key, None)
            return None
        if key not in self._grow_noticed:
            saved = job_decisions.saved_step(workers)
            self._grow_noticed[key] = saved if saved is not None else -1
            log.info("job %s: can grow; after the next checkpoint", job.name, extra={"job": job.name})
        return self._grow_noticed[key]

    def release_workers_on_lost_nodes(self, now: float, nodes: dict[str, Node]) -> list[Worker]:
        """Workers whose node's agent is gone can never report that they stopped: the backend
        closes them, so their node's books and their job's are closed. A faulty node whose
        agent still heartbeats stops its workers itself and reports it. Returns the workers
        still active."""
        active = self.backend.active_workers()
        gone = {name for name, node in nodes.items()
                if not node.state.is_active and job_decisions.agent_gone(now, node, self.silent_after)}
        for name in sorted(gone & {w.node for w in active}):
            self.backend.release_workers(nodes[name], f"lost with its node ({nodes[name].state.value})")
        return [w for w in active if w.node not in gone]

    def stop_unwanted(self, active: list[Worker], jobs: dict[str, Job]) -> None:
        """Level-triggered: a worker still asked to run whose job ended, or whose attempt is
        not the job's current one, is stopped (a stop the controller decided but did not apply)."""
        for worker in active:
            job = jobs.get(worker.job)
            if worker.desired is Desired.RUN and (job is None or job.phase.is_terminal or worker.attempt < job.attempt
                                                  or job.phase is JobPhase.RESTARTING):
                self.backend.stop_attempt(worker.job, worker.attempt)

    def _apply(self, now: float, job: Job, decision: Decision, nodes: dict[str, Node]) -> None:
        action = decision.action
        if action is Action.SCHEDULE:
            attempt = job.attempt + (1 if job.phase is JobPhase.RESTARTING else 0)
            placed = self.store.update_job(job.name, JobUpdate(
                phase=JobPhase.RUNNING, attempt=attempt, nodes=decision.nodes, started_at=job.started_at or now, reason=None,
            ), expect_version=job.version)
            endpoint = self.backend.launch_attempt(placed, attempt, [nodes[n] for n in decision.nodes])
            if job.nodes and len(job.nodes) != len(decision.nodes):
                self._note_resize(now, job, decision.nodes, nodes)
            self.store.add_event("Job", job.name, "JobScheduled",
                                 f"attempt {attempt} on {', '.join(decision.nodes)} (rendezvous {endpoint})")
        elif action in _STOPPED:
            phase, reason = _STOPPED[action]
            resizes = job.resizes + 1 if action is Action.RESIZE else job.resizes
            self.store.update_job(job.name, JobUpdate(phase=phase, reason=decision.reason, ended_at=now if phase.is_terminal else None,
                                                      resizes=resizes), expect_version=job.version)
            self.backend.stop_attempt(job.name, job.attempt, hold=decision.hold)
            self.store.add_event("Job", job.name, reason, decision.reason,
                                 type=EventType.NORMAL if action in (Action.CANCEL, Action.RESIZE) else EventType.WARNING)
        elif action is Action.SUCCEED:
            self.store.update_job(job.name, JobUpdate(phase=JobPhase.SUCCEEDED, reason=decision.reason, ended_at=now),
                                  expect_version=job.version)
            self.store.add_event("Job", job.name, "JobSucceeded", decision.reason)
        elif job.reason != decision.reason and job.phase is JobPhase.PENDING:
            self.store.update_job(job.name, JobUpdate(reason=decision.reason), expect_version=job.version)

    def _follow_launch(self, now: float, job: Job, workers: list[Worker]) -> None:
        """An attempt launched ``LAUNCH_FOLLOW_SECONDS`` ago none of whose workers runs yet: an Event saying what it
        waits for (once per distinct reason), and where nothing of it exists, one more launch."""
        key = (job.name, job.attempt)
        if any(w.phase is not WorkerPhase.PENDING for w in workers):
            self._launch_waits.pop(key, None)  # it runs: a later wait of the same attempt is reported afresh
            return
        if now - job.phase_changed_at < LAUNCH_FOLLOW_SECONDS:
            return
        wait = self.backend.attempt_waits_for(job.name, job.attempt)
        if wait is None or self._launch_waits.get(key) == wait.reason:
            return
        self._launch_waits[key] = wait.reason
        nudge = wait.nudge and key not in self._nudged
        message = f"attempt {job.attempt}, {now - job.phase_changed_at:.0f} s after its launch: {wait.reason}" + \
            ("; launching it once more" if nudge else "")
        log.warning("job %s: %s", job.name, message, extra={"job": job.name})
        self.store.add_event("Job", job.name, "AttemptWaiting", message, type=EventType.WARNING)
        if nudge:
            self._nudged.add(key)
            self.backend.nudge_attempt(job.name, job.attempt)

    def _note_resize(self, now: float, job: Job, placement: tuple[str, ...], nodes: dict[str, Node]) -> None:
        """A JobResized event: the old and new size, the job's range, and why."""
        spec = job.spec()
        before, after = len(job.nodes), len(placement)
        if after > before:
            why = f"grown onto {', '.join(n for n in placement if n not in job.nodes)}"
        else:
            left = [job_decisions.unavailable(now, n, nodes.get(n), self.silent_after) for n in job.nodes if n not in placement]
            why = f"{'; '.join(left)}; no other schedulable node free"
        self.store.add_event("Job", job.name, "JobResized",
                             f"{before} → {after} nodes (min {spec.fewest_nodes}, max {spec.nodes}): {why}")

    def _note_cause(self, job: Job, workers: list[Worker]) -> None:
        """A restart decided on a peer-lost symptom names its cause once that has reported: one
        JobRestartCause event per restart (the restart itself was not delayed to wait for it)."""
        if job.phase is JobPhase.RESTARTING:
            failed_attempt, failed = job.attempt, workers
        elif job.phase is JobPhase.RUNNING and job.attempt > 0:
            failed_attempt, failed = job.attempt - 1, self.backend.observe_attempt(job.name, job.attempt - 1)
        else:
            return
        restarts = self.store.list_events(object_kind="Job", object_name=job.name, reason="JobRestarting")
        if len(restarts) <= failed_attempt:
            return
        cause = job_decisions.restart_cause(failed, restarts[failed_attempt].message)
        if cause is None:
            return
        noted = self.store.list_events(object_kind="Job", object_name=job.name, reason="JobRestartCause")
        if any(e.message.startswith(f"attempt {failed_attempt}:") for e in noted):
            return
        self.store.add_event("Job", job.name, "JobRestartCause",
                             f"attempt {failed_attempt}: the failure behind restart {failed_attempt + 1}: worker on {cause.node}: {cause.message}",
                             type=EventType.WARNING)

    def _note_resume(self, job: Job, workers: list[Worker]) -> None:
        """One JobResumed event per restarted attempt, once its first step is reported."""
        if job.attempt == 0 or job.phase is not JobPhase.RUNNING:
            return
        if not any(w.first_progress_at is not None for w in workers):
            return
        noted = self.store.list_events(object_kind="Job", object_name=job.name, reason="JobResumed")
        if any(e.message.startswith(f"attempt {job.attempt} ") for e in noted):
            return
        restored = next((w.restored_step for w in workers if w.restored_step is not None), None)
        previous = self.backend.observe_attempt(job.name, job.attempt - 1)
        reached = max((w.last_step for w in previous if w.last_step is not None), default=None)
        origin = f"step {restored}" if restored is not None else "scratch (no checkpoint)"
        lost = (reached or 0) - (restored or 0) if reached is not None else 0
        self.store.add_event("Job", job.name, "JobResumed", f"attempt {job.attempt} resumed from {origin}; {lost} steps lost")


def _steps(steps: list[int]) -> str:
    return ", ".join(str(s) for s in steps)
