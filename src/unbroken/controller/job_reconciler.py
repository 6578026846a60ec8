"""Applies job decisions to the store: read → decide → write, one transaction per job."""

from __future__ import annotations

import logging
import socket

from unbroken.controller import job_decisions
from unbroken.controller.job_decisions import Action, Decision
from unbroken.state.phases import JobPhase, WorkerPhase
from unbroken.state.records import Desired, EventType, Job, Node, Worker
from unbroken.state.store import StaleUpdate, Store

log = logging.getLogger("unbroken.controller.jobs")


class JobReconciler:
    def __init__(self, store: Store, *, silent_after: float) -> None:
        self.store = store
        self.silent_after = silent_after

    def reconcile_all(self, now: float) -> None:
        """One pass: nodes and busy nodes are read once and shared by every job."""
        nodes = {n.name: n for n in self.store.list_nodes()}
        active = self.forget_workers_on_lost_nodes(now, nodes)
        busy = {w.node for w in active}
        for job in self.store.list_jobs():
            if not job.phase.is_terminal:
                try:
                    decision = self.reconcile(now, job, nodes, busy)
                except StaleUpdate:
                    continue  # changed under us (e.g. cancel); the next pass sees the new state
                busy.update(decision.nodes)  # so the next job in this pass cannot take them

    def reconcile(self, now: float, job: Job, nodes: dict[str, Node], busy: set[str]) -> Decision:
        spec = job.spec()
        workers = self.store.list_workers(job=job.name, attempt=job.attempt)
        free = [n.name for n in nodes.values()
                if n.name not in busy and job_decisions.eligible(n, spec, now, self.silent_after)]
        decision = job_decisions.decide(now, job, spec, workers, nodes, free, silent_after=self.silent_after)
        if decision.action is not Action.WAIT:
            log.info("job %s: %s: %s", job.name, decision.action.value, decision.reason, extra={"job": job.name})
        self._apply(now, job, decision, workers, nodes)
        self._note_resume(job, workers)
        return decision

    def forget_workers_on_lost_nodes(self, now: float, nodes: dict[str, Node]) -> list[Worker]:
        """Workers whose node's agent is gone can never report that they stopped: mark
        them Stopped so their node's books and their job's are closed. A faulty node
        whose agent still heartbeats stops its workers itself and reports it.
        Returns the workers still active."""
        still_active = []
        for worker in self.store.list_workers(active=True):
            node = nodes.get(worker.node)
            if node is None or (not node.state.is_active and job_decisions.agent_gone(now, node, self.silent_after)):
                state = node.state.value if node else "missing"
                self.store.update_worker(worker.id, phase=WorkerPhase.STOPPED, desired=Desired.STOP, ended_at=now,
                                         message=f"lost with its node ({state})")
            else:
                still_active.append(worker)
        return still_active

    def _apply(self, now: float, job: Job, decision: Decision, workers: list[Worker], nodes: dict[str, Node]) -> None:
        store = self.store
        action = decision.action
        with store.transaction():
            if action is Action.SCHEDULE:
                attempt = job.attempt + (1 if job.phase is JobPhase.RESTARTING else 0)
                endpoint = f"{nodes[decision.nodes[0]].address}:{_free_port(nodes[decision.nodes[0]].address)}"
                for node_rank, node in enumerate(decision.nodes):
                    store.add_worker(
                        Worker(job=job.name, attempt=attempt, node=node, node_rank=node_rank, desired=Desired.RUN,
                               phase=WorkerPhase.PENDING, rdzv_endpoint=endpoint, created_at=now)
                    )
                store.update_job(job.name, expect_phase=job.phase, phase=JobPhase.RUNNING, attempt=attempt,
                                 started_at=job.started_at or now, reason=None)
                store.add_event("Job", job.name, "JobScheduled", f"attempt {attempt} on {', '.join(decision.nodes)} (rendezvous {endpoint})")
            elif action in (Action.RESTART, Action.FAIL, Action.CANCEL):
                self._stop_workers(workers)
                phase = {Action.RESTART: JobPhase.RESTARTING, Action.FAIL: JobPhase.FAILED, Action.CANCEL: JobPhase.CANCELLED}[action]
                ended = now if phase.is_terminal else None
                store.update_job(job.name, expect_phase=job.phase, phase=phase, reason=decision.reason, ended_at=ended)
                reason = {Action.RESTART: "JobRestarting", Action.FAIL: "JobFailed", Action.CANCEL: "JobCancelled"}[action]
                store.add_event("Job", job.name, reason, decision.reason,
                                type=EventType.NORMAL if action is Action.CANCEL else EventType.WARNING)
            elif action is Action.SUCCEED:
                store.update_job(job.name, expect_phase=job.phase, phase=JobPhase.SUCCEEDED, reason=decision.reason, ended_at=now)
                store.add_event("Job", job.name, "JobSucceeded", decision.reason)
            elif job.reason != decision.reason and job.phase is JobPhase.PENDING:
                store.update_job(job.name, reason=decision.reason)

    def _stop_workers(self, workers: list[Worker]) -> None:
        for worker in workers:
            if not worker.phase.is_terminal and worker.desired is not Desired.STOP:
                self.store.update_worker(worker.id, desired=Desired.STOP)

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
        previous = self.store.list_workers(job=job.name, attempt=job.attempt - 1)
        reached = max((w.last_step for w in previous if w.last_step is not None), default=None)
        origin = f"step {restored}" if restored is not None else "scratch (no checkpoint)"
        lost = (reached or 0) - (restored or 0) if reached is not None else 0
        self.store.add_event("Job", job.name, "JobResumed", f"attempt {job.attempt} resumed from {origin}; {lost} steps lost")


def _free_port(address: str) -> int:
    """A port free on ``address`` now, for the attempt's rendezvous store. A node address
    inside a network namespace is not bindable here: any port free here is as good."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            sock.bind(("", 0))
        return int(sock.getsockname()[1])
