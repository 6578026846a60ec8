"""The node agent process: ``python -m unbroken.agent --dir DIR --node NAME``.

A reconciler like the controller: it reads what the store wants of its node
(workers to run or stop) and reports what it observes (heartbeat, join-check
verdict, worker exits, rank progress). It keeps only the ``Popen`` handles of
the workers it started; if it is restarted, workers it cannot see are
stopped and reported lost.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sqlite3
import sys
import threading
import time
from typing import Any

from unbroken import logs, procs
from unbroken.agent import join_checks, launcher
from unbroken.agent.progress import ProgressBook
from unbroken.checkpoint import service as checkpoint_service
from unbroken.checkpoint import shm
from unbroken.checkpoint.peer import load_token
from unbroken.checkpoint.service import CheckpointService
from unbroken.channel import AgentReceiver, agent_address
from unbroken.config.cluster import ClusterConfig
from unbroken.health.monitor import HealthMonitor
from unbroken.layout import ClusterLayout
from unbroken.state.phases import DeepHealthStatus, NodeState, WorkerPhase
from unbroken.state.records import Desired, EventType, Worker
from unbroken.state.sqlite import SqliteStore

log = logging.getLogger("unbroken.agent")

LOOP_SECONDS = 0.1
PROGRESS_FLUSH_SECONDS = 0.5
"""Rank progress reaches the store at most twice a second per worker: fresh
enough for hang timeouts of seconds, cheap enough for thousands of steps/s."""

_REJOIN_FROM = {NodeState.JOINING, NodeState.REBOOTING, NodeState.SCHEDULABLE}


class Agent:
    def __init__(self, layout: ClusterLayout, node: str) -> None:
        self.layout = layout
        self.node = node
        self.store = SqliteStore(layout.state_db)
        self.cluster = ClusterConfig.model_validate_json(self.store.cluster_json())
        self.running: dict[int, launcher.RunningWorker] = {}
        self.book = ProgressBook()
        self.stopping = threading.Event()
        self._last_flush = 0.0
        self.checkpoints = CheckpointService(
            SqliteStore(layout.state_db), node, shm.node_root(layout.root, node), load_token(layout.cluster_token)
        )

    # -- lifecycle ------------------------------------------------------------------

    def register(self) -> bool:
        """Announce this agent; False if the node is not ours to run any more."""
        node = self.store.get_node(self.node)
        if node.state in (NodeState.RETIRED, NodeState.PENDING_REPLACEMENT, NodeState.PENDING_REBOOT):
            log.warning("node is %s; agent exits", node.state.value, extra={"node": self.node})
            return False
        state = NodeState.JOINING if node.state in _REJOIN_FROM else node.state
        now = time.time()
        self.store.update_node(
            self.node, state=state, deep_health=DeepHealthStatus.IN_PROGRESS, agent_pid=os.getpid(),
            heartbeat_at=now, registered_at=now, fault_type=None, fault_reason=None, recovery_requested=False,
        )
        self.store.add_event("Node", self.node, "NodeRegistered", f"agent pid {os.getpid()} registered; running join checks")
        log.info("registered", extra={"node": self.node, "state": state.value})
        self._stop_orphans()
        return True

    def run(self) -> None:
        if not self.register():
            return
        receiver = AgentReceiver(agent_address(self.layout.root, self.node))
        heartbeat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        heartbeat.start()
        self.checkpoints.start()
        threading.Thread(target=self._checkpoint_loop, name="checkpoints", daemon=True).start()
        checks = threading.Thread(target=self._join_checks, name="join-checks", daemon=True)
        checks.start()
        HealthMonitor(self.layout, self.node, self.cluster, self.stopping).start()  # kernel log + continuous checks
        try:
            while not self.stopping.is_set():
                try:
                    if self.store.get_node(self.node).state is NodeState.RETIRED:
                        log.info("node retired; stopping", extra={"node": self.node})
                        break
                    self.book.apply(receiver.drain())
                    active = self.store.list_workers(node=self.node, active=True)
                    self._reconcile_workers(active)
                    self._flush_progress(active)
                except sqlite3.Error:
                    # A store hiccup must not kill the agent: that would look like a lost
                    # node and cost a replacement plus a restart of every job on it.
                    log.exception("agent pass failed; retrying", extra={"node": self.node})
                    self.stopping.wait(1.0)
                self.stopping.wait(LOOP_SECONDS)
        finally:
            for running in list(self.running.values()):
                running.kill()
            receiver.close()
            self.checkpoints.close()

    def _heartbeat_loop(self) -> None:
        interval = self.cluster.Local.HeartbeatIntervalSeconds
        store = SqliteStore(self.layout.state_db)  # own connection: the main loop may be busy
        while not self.stopping.wait(interval):
            try:
                store.update_node(self.node, heartbeat_at=time.time())
            except sqlite3.Error:
                log.exception("heartbeat failed; retrying", extra={"node": self.node})

    def _checkpoint_loop(self) -> None:
        """The memory tier's reconciler, on its own thread and store connection: a slow
        pass (a big drain decision, a busy store) never delays worker supervision."""
        while not self.stopping.wait(checkpoint_service.PASS_SECONDS):
            try:
                self.checkpoints.reconcile()
            except Exception:  # noqa: BLE001 - checkpoints degrade; the agent must stay up
                log.exception("checkpoint pass failed; retrying", extra={"node": self.node})
                self.stopping.wait(1.0)

    def _join_checks(self) -> None:
        node = self.store.get_node(self.node)
        suites = [s.value for s in self.cluster.group(node.group).OnStartDeepHealthChecks]
        result, notes = join_checks.run_join_checks(self.node, self.layout.node_dir(self.node), suites)
        store = SqliteStore(self.layout.state_db)
        for note in notes:
            store.add_event("Node", self.node, "DeepHealthCheckNote", note)
        status = DeepHealthStatus.PASSED if result.passed else DeepHealthStatus.FAILED
        changes: dict[str, Any] = {"deep_health": status}
        if not result.passed:
            changes.update(fault_type=result.fault_type, fault_reason=result.reason)
        store.update_node(self.node, **changes)
        store.add_event(
            "Node", self.node, f"JoinChecks{status.value}", result.reason,
            type=EventType.NORMAL if result.passed else EventType.WARNING,
        )
        log.info("join checks %s: %s", status.value, result.reason, extra={"node": self.node})

    # -- workers --------------------------------------------------------------------

    def _reconcile_workers(self, active: list[Worker]) -> None:
        self._stop_unwanted({w.id for w in active})
        for worker in active:
            running = self.running.get(worker.id)
            if running is None:
                self._reconcile_unstarted(worker)
                continue
            code = running.exited()
            if code is not None:
                self._record_exit(worker, running, code)
            elif worker.desired is Desired.STOP:
                running.begin_stop()
                running.continue_stop()

    def _stop_unwanted(self, active_ids: set[int]) -> None:
        """Stop processes whose worker row was closed by someone else (the controller
        gave them up as lost): a row that says Stopped must not hide a live process."""
        for worker_id, running in list(self.running.items()):
            if worker_id in active_ids:
                continue
            if running.exited() is not None:
                del self.running[worker_id]
            else:
                running.begin_stop()
                running.continue_stop()

    def _reconcile_unstarted(self, worker: Worker) -> None:
        if worker.desired is Desired.STOP:
            self.store.update_worker(worker.id, phase=WorkerPhase.STOPPED, ended_at=time.time(), message="stopped before launch")
        elif worker.phase is WorkerPhase.PENDING:
            self._launch(worker)
        else:  # Running but not ours: launched by a previous incarnation of this agent
            if worker.pid:
                procs.terminate_tree(worker.pid, grace=1.0)
            self.store.update_worker(worker.id, phase=WorkerPhase.STOPPED, ended_at=time.time(), message="lost: node agent restarted")

    def _launch(self, worker: Worker) -> None:
        job = self.store.get_job(worker.job)
        spec = job.spec()
        log_dir = self.layout.worker_log_dir(worker.job, worker.attempt, self.node)
        checkpoint_dir = spec.checkpoint.dir or self.layout.checkpoint_dir(worker.job)
        endpoint = self.checkpoints.server.address if self.checkpoints.server else None
        try:
            running = launcher.launch(
                spec, worker, cluster_dir=self.layout.root, node=self.node, log_dir=log_dir, checkpoint_dir=checkpoint_dir,
                checkpoint_endpoint=endpoint,
                local_addr=self.store.get_node(self.node).address,
            )
        except OSError as exc:
            # e.g. the working_dir was deleted: the job's fault, not the node's. Report it
            # as a failed worker instead of letting the agent die and the node look lost.
            message = f"cannot start torchrun in {spec.working_dir}: {exc.strerror or exc}"
            self.store.update_worker(worker.id, phase=WorkerPhase.FAILED, ended_at=time.time(), exit_code=127, message=message)
            log.error(message, extra={"node": self.node, "job": worker.job})
            return
        self.running[worker.id] = running
        self.store.update_worker(
            worker.id, phase=WorkerPhase.RUNNING, pid=running.process.pid, started_at=time.time(), log_dir=str(log_dir)
        )
        log.info("launched worker", extra={"node": self.node, "job": worker.job, "attempt": worker.attempt, "pid": running.process.pid})

    def _record_exit(self, worker: Worker, running: launcher.RunningWorker, code: int) -> None:
        del self.running[worker.id]
        self._flush_progress([worker], force=True)  # its last steps, before the row closes
        if worker.desired is Desired.STOP or running.stop_started is not None:
            phase, exit_code, message = WorkerPhase.STOPPED, code, "stopped by the controller"
        elif code == 0:
            phase, exit_code, message = WorkerPhase.SUCCEEDED, 0, "all ranks exited 0"
        else:
            phase = WorkerPhase.FAILED
            exit_code, message = launcher.describe_exit(code, running.log_dir)
        self.store.update_worker(worker.id, phase=phase, exit_code=exit_code, ended_at=time.time(), message=message)
        self.book.forget(worker.job, worker.attempt)
        level = logging.WARNING if phase is WorkerPhase.FAILED else logging.INFO
        log.log(level, "worker %s: %s", phase.value, message, extra={"node": self.node, "job": worker.job, "attempt": worker.attempt})

    def _flush_progress(self, active: list[Worker], force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_flush < PROGRESS_FLUSH_SECONDS:
            return
        self._last_flush = now
        by_key = {(w.job, w.attempt): w for w in active}
        updates = self.book.take_dirty(set(by_key))
        if not updates:
            return
        with self.store.transaction():
            for key, changes in updates.items():
                self.store.update_worker(by_key[key].id, **changes)

    def _stop_orphans(self) -> None:
        """Workers this node ran before the agent restarted are gone or unmanageable: stop them."""
        for worker in self.store.list_workers(node=self.node, active=True):
            if worker.phase is WorkerPhase.RUNNING and worker.pid and procs.alive(worker.pid):
                procs.terminate_tree(worker.pid, grace=1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unbroken-agent", description="unbroken node agent")
    parser.add_argument("--dir", required=True, help="cluster directory")
    parser.add_argument("--node", required=True, help="name of the node this agent runs")
    args = parser.parse_args(argv)
    logs.setup(component="agent", node=args.node)
    agent = Agent(ClusterLayout.at(args.dir), args.node)
    signal.signal(signal.SIGTERM, lambda *_: agent.stopping.set())
    agent.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
