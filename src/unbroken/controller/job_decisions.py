"""What the job reconciler should do next: pure functions of (now, job, workers, nodes).

No I/O here, so every branch is tested with plain records and an injected
clock. Each decision carries the reason that becomes the job's event.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from unbroken.rank import symptoms
from unbroken.config.job import JobSpec, RestartPolicy
from unbroken.controller import divergence, hang_timeout
from unbroken.controller.hang_timeout import HangTimeout
from unbroken.state.phases import DeepHealthStatus, JobPhase, NodeState, WorkerPhase
from unbroken.state.records import Desired, Job, Node, Worker


class Action(StrEnum):
    WAIT = "Wait"
    SCHEDULE = "Schedule"
    """Place the next attempt on ``nodes`` (from Pending or Restarting)."""
    RESTART = "Restart"
    """Stop this attempt's workers (those on ``hold`` keep their processes: an in-process restart); the job goes Restarting."""
    RESIZE = "Resize"
    """Grow an elastic job: stop this attempt's workers right after a checkpoint; the job goes
    Restarting and the next attempt is placed on more nodes. Not counted against max_retry."""
    FAIL = "Fail"
    """Stop this attempt's workers; the job is Failed for good."""
    SUCCEED = "Succeed"
    CANCEL = "Cancel"


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str = ""
    nodes: tuple[str, ...] = ()
    hold: tuple[str, ...] = ()
    """RESTART of a job with in-process restarts: the nodes whose workers stay alive for the next attempt."""


@dataclass(frozen=True)
class Failure:
    reason: str
    retryable: bool
    corrupt: bool = False
    """The replicas diverged: no rank stays for an in-process restart (every one exits, and none's state is trusted)."""


def decide(
    now: float, job: Job, spec: JobSpec, workers: list[Worker], nodes: dict[str, Node], free: list[str],
    *, silent_after: float = 1.5, grow_after: int | None = None, hang: HangTimeout | None = None,
    startup: HangTimeout | None = None,
) -> Decision:
    """``workers`` are the current attempt's; ``free`` the eligible idle nodes in preference order.

    ``silent_after``: a node whose heartbeat is older than this is named as a
    suspect in failure reasons (it is not declared lost until NodeLostAfterSeconds).
    ``grow_after``: for an elastic job below its size with nodes free, the saved step seen when
    that was first noticed (-1: none yet); it grows once a newer checkpoint is saved.
    ``hang``, ``startup``: the hang and startup timeouts in force (default: from ``workers`` and the spec alone).
    """
    hang = hang or hang_timeout.in_force(spec, workers)
    if job.phase.is_terminal:
        return Decision(Action.WAIT, "terminal")
    if job.cancel_requested:
        return Decision(Action.CANCEL, "cancelled by user")
    if job.phase is JobPhase.PENDING:
        return _place(spec, free, "waiting")
    if job.phase is JobPhase.RESTARTING:
        # Wait for the old attempt's workers to confirm they stopped, except on nodes
        # that have gone quiet: a dead node never confirms, and waiting for it to be
        # declared lost would add NodeLostAfterSeconds to every recovery. Its workers
        # stay in the books (the node stays busy) until it is declared lost.
        stopping = [w for w in workers if not w.phase.is_terminal and not _silent(now, nodes.get(w.node), silent_after)]
        if stopping:
            without = _place_without_the_unanswered(now, spec, workers, stopping, free)
            if without is not None:
                return without
            return Decision(Action.WAIT, f"stopping attempt {job.attempt} on {', '.join(w.node for w in stopping)}")
        return _place(spec, free, "waiting to restart")
    # Running
    failure = detect_failure(now, spec, workers, nodes, hang, startup)
    if failure is not None:
        failure = _with_suspects(now, failure, workers, nodes, silent_after)
        if can_restart(job, spec, failure):
            reason = f"{failure.reason}; restart {restarts_used(job) + 1} of {spec.resilience.max_retry}"
            hold = () if failure.corrupt else holdable(now, spec, workers, nodes, silent_after, hang)
            if hold:
                reason += f"; in-process: the ranks on {', '.join(hold)} stay"
            return Decision(Action.RESTART, reason, hold=hold)
        return Decision(Action.FAIL, _final_reason(job, spec, failure))
    if workers and all(w.phase is WorkerPhase.SUCCEEDED for w in workers):
        return Decision(Action.SUCCEED, f"all {len(workers)} workers succeeded")
    growable = growth(job, spec, free)
    if growable:
        return _grow(job, spec, workers, growable, grow_after)
    return Decision(Action.WAIT, "running")


HELD_PEERS_GRACE_SECONDS = 0.5
"""In an in-process restart, how long after the first held worker left its group the others have
to follow before the next attempt goes on without them. Survivors of one failure notice it within
milliseconds of each other (their collective fails, and each leaving rank ends its connections),
so a held worker still running after this most likely has no node left to answer for it."""


def _place_without_the_unanswered(now: float, spec: JobSpec, workers: list[Worker], stopping: list[Worker],
                                  free: list[str]) -> Decision | None:
    """An in-process restart whose held survivors have left need not wait for a held worker that
    did not follow them: place the next attempt on other free nodes (a spare), if there are enough.

    After a node loss the dead node's worker was stepping on a Schedulable node a moment ago, so it
    is asked to hold with the survivors; it never answers, and its heartbeat is overdue only after
    ``silent_after``. That wait, about a second of every node loss, buys nothing when a spare is
    ready. A node that was only slow keeps its held worker for a later attempt (agent/held.py) and
    stays busy until its worker stops; a full restart (no in-process) waits as before, its next
    attempt belongs on the nodes whose memory tier holds its checkpoint."""
    if not spec.resilience.in_process_restart or any(w.desired is not Desired.HOLD for w in stopping):
        return None
    left = [w.ended_at for w in workers
            if w.desired is Desired.HOLD and w.phase is WorkerPhase.STOPPED and w.ended_at is not None]
    if not left or now - min(left) < HELD_PEERS_GRACE_SECONDS:
        return None
    unanswered = sorted({w.node for w in stopping})
    placed = _place(spec, [n for n in free if n not in unanswered], "waiting to restart")
    if placed.action is not Action.SCHEDULE:
        return None
    return Decision(Action.SCHEDULE, f"placed without {', '.join(unanswered)}: its held worker did not leave within "
                                     f"{HELD_PEERS_GRACE_SECONDS:g} s of its peers (its node may be lost)", nodes=placed.nodes)


def holdable(now: float, spec: JobSpec, workers: list[Worker], nodes: dict[str, Node], silent_after: float,
             hang: HangTimeout | None = None) -> tuple[str, ...]:
    """For a job with in-process restarts, the nodes whose workers can stay for the next attempt:
    running, on a Schedulable node whose agent answers (the next attempt is placed on no other), and stepping until the fault (in a hang every rank is silent, stuck
    in a collective it cannot leave, so none is held: that restart is a full one)."""
    if not spec.resilience.in_process_restart:
        return ()
    recent = (hang or hang_timeout.in_force(spec, workers)).seconds
    return tuple(w.node for w in workers
                 if w.phase in (WorkerPhase.RUNNING, WorkerPhase.INTERRUPTED)
                 and (n := nodes.get(w.node)) is not None and n.state is NodeState.SCHEDULABLE and not _silent(now, n, silent_after)
                 and w.last_progress_at is not None and now - w.last_progress_at <= recent)


def restarts_used(job: Job) -> int:
    """Restarts after faults so far: attempts started to grow an elastic job are not faults."""
    return job.attempt - job.resizes


def growth(job: Job, spec: JobSpec, free: list[str]) -> list[str]:
    """The free nodes an elastic job running below its size would grow onto, in preference order."""
    if not spec.elastic or job.phase is not JobPhase.RUNNING or not job.nodes or len(job.nodes) >= spec.nodes:
        return []
    return [n for n in free if n not in job.nodes][: spec.nodes - len(job.nodes)]


def saved_step(workers: list[Worker]) -> int | None:
    """The newest step every worker of the attempt has saved, or None."""
    saved = [w.saved_step for w in workers]
    return min(s for s in saved if s is not None) if saved and None not in saved else None


def _grow(job: Job, spec: JobSpec, workers: list[Worker], growable: list[str], grow_after: int | None) -> Decision:
    """Grow at a checkpoint: once a step saved after the nodes were noticed is behind every rank
    (each has run a step past it, so its save is published), stop and resume larger from it."""
    size = len(job.nodes) + len(growable)
    saved = saved_step(workers)
    steps = [w.last_step for w in workers]
    reached = min(s for s in steps if s is not None) if steps and None not in steps else None
    if grow_after is not None and saved is not None and saved > grow_after and reached is not None and reached > saved:
        return Decision(Action.RESIZE, f"growing from {len(job.nodes)} to {size} nodes ({', '.join(growable)} schedulable) "
                                       f"at the checkpoint of step {saved}", nodes=tuple(growable))
    return Decision(Action.WAIT, f"running on {len(job.nodes)} of {spec.nodes} nodes; growing to {size} after the next checkpoint")


def is_peer_lost(worker: Worker) -> bool:
    """The worker failed because a peer went away (a symptom), not of its own accord.

    When one rank dies, the ranks it talked to fail a moment later on a broken connection,
    and their node may report first. The restart is not delayed to wait for the cause (a dead
    node never reports one); the reconciler names the cause in a JobRestartCause event once it
    shows up, and a symptom is always retryable, whatever the restart policy says of exit codes."""
    return worker.phase is WorkerPhase.FAILED and worker.exit_code is not None and worker.exit_code > 0 \
        and symptoms.says_peer_lost(worker.message or "")


def _root_cause_first(worker: Worker) -> tuple[int, float]:
    """Blame order among failed workers: killed by a signal, then any error of its own, then a
    peer-lost symptom; the earliest first within each."""
    if worker.exit_code is not None and worker.exit_code < 0:
        kind = 0
    else:
        kind = 2 if is_peer_lost(worker) else 1
    return kind, worker.ended_at or 0.0


def restart_cause(failed_attempt: list[Worker], restart_reason: str) -> Worker | None:
    """The worker whose own failure caused a restart whose event named only a symptom (a peer lost,
    or a rank whose end was not read yet), once it has reported; None if the event already named
    it or nothing better is known yet."""
    unread = symptoms.says_exit_unread(restart_reason)
    if not (unread or symptoms.says_peer_lost(restart_reason)):
        return None
    causes = sorted((w for w in failed_attempt if w.phase is WorkerPhase.FAILED and not is_peer_lost(w)
                     and not (unread and symptoms.says_exit_unread(w.message or ""))), key=_root_cause_first)
    return causes[0] if causes else None


def detect_failure(now: float, spec: JobSpec, workers: list[Worker], nodes: dict[str, Node],
                   hang: HangTimeout | None = None, startup: HangTimeout | None = None) -> Failure | None:
    """First reason this attempt cannot finish, in order: worker exit (the root cause among
    several), ranks that left their process group (in-process restarts), lost node, hang. A divergence of the
    replicas goes before all of them: the ranks exit because of it."""
    diverged = divergence.find(workers)
    if diverged is not None:  # first: the ranks exit on it, and their exit is its symptom
        return Failure(divergence.reason(diverged), True, corrupt=True)
    failed = sorted((w for w in workers if w.phase is WorkerPhase.FAILED), key=_root_cause_first)
    if failed:
        w = failed[0]
        return Failure(f"worker on {w.node}: {w.message}", is_peer_lost(w) or _retryable_exit(spec, w.exit_code))
    for w in workers:
        if w.phase is WorkerPhase.INTERRUPTED:  # a symptom (a peer is gone); the cause, if it reports, is noted later
            return Failure(f"worker on {w.node}: {w.message}", True)
    for w in workers:
        if w.phase is WorkerPhase.STOPPED and w.desired is Desired.RUN:
            return Failure(f"worker on {w.node} {w.message or 'stopped unexpectedly'}", True)
    lost = [w for w in workers if not w.phase.is_terminal and not _node_usable_for_running(nodes.get(w.node))]
    if lost and not _goes_on_without(spec, lost):
        w = lost[0]
        node = nodes.get(w.node)
        detail = f": {node.fault_reason}" if node and node.fault_reason else ""
        state = node.state.value if node else "missing"
        return Failure(f"node {w.node} is {state}{detail}", True)
    timeout = hang or hang_timeout.in_force(spec, workers)
    starting = startup or hang_timeout.startup_in_force(spec, None)
    for w in workers:
        if w.phase is not WorkerPhase.RUNNING:
            continue
        if w.finished_at is not None and len(w.ranks) >= spec.procs_per_node:
            # Every rank said it finished: exiting, not training, however long that takes under load. A rank that never
            # exits is ended by its agent (agent/workers.py) or its launcher (unbroken run), and the job judged on what
            # its ranks reported: a restart here would train the finished job again.
            continue
        if w.last_progress_at is not None:
            # Progress is as fresh as the node's last report: while its agent is silent (paused,
            # restarting, cut off) the ranks' silence is not known to grow, so it is not a hang.
            reported = nodes[w.node].heartbeat_at if w.node in nodes else None
            silent = min(now, reported or now) - w.last_progress_at
            if silent > timeout.seconds:
                return Failure(
                    f"hang: no progress from a rank on {w.node} for {silent:.1f} s "
                    f"(hang_timeout {timeout.seconds:g} s {timeout.why}, last step {w.last_step})", True,
                )
        elif w.ranks and w.started_at is not None and now - w.started_at > starting.seconds:
            # Only ranks that said hello (they called unbroken.init()) are expected to
            # report progress; a script without the API is watched for exits only.
            return Failure(
                f"hang: no rank on {w.node} reported progress within startup_timeout "
                f"{starting.seconds:g} s ({starting.why})", True,
            )
    return None


def _goes_on_without(spec: JobSpec, lost: list[Worker]) -> bool:
    """The job's pods regroup without these workers, lost with their nodes (``resilience.node_losses_in_place``):
    no more of them than that, and never node rank 0, which hosts the rendezvous."""
    return len(lost) <= spec.resilience.node_losses_in_place and all(w.node_rank != 0 for w in lost)


def _with_suspects(now: float, failure: Failure, workers: list[Worker], nodes: dict[str, Node], silent_after: float) -> Failure:
    """Name attempt nodes that have gone quiet: a rank failing on a healthy node is
    often only the first to notice that a peer's node died."""
    suspects = []
    for w in workers:
        node = nodes.get(w.node)
        if node is not None and node.state.is_active and node.heartbeat_at is not None:
            silent = now - node.heartbeat_at
            if silent > silent_after and not _names(failure.reason, w.node):
                suspects.append(f"{w.node} silent for {silent:.1f} s")
    if not suspects:
        return failure
    return Failure(f"{failure.reason} (suspect: {', '.join(suspects)})", failure.retryable, failure.corrupt)


def _names(text: str, node: str) -> bool:
    """``node`` appears in ``text`` as a whole name (node-1 is not named by node-10)."""
    return re.search(rf"(?<![\w-]){re.escape(node)}(?![\w-])", text) is not None


def can_restart(job: Job, spec: JobSpec, failure: Failure) -> bool:
    policy = spec.resilience
    if not policy.auto_resume or policy.restart_policy is RestartPolicy.NEVER:
        return False
    if not failure.retryable:
        return False
    return restarts_used(job) < policy.max_retry


def eligible(node: Node, spec: JobSpec, now: float, silent_after: float) -> bool:
    if node.state is not NodeState.SCHEDULABLE:
        return False
    if node.heartbeat_at is not None and now - node.heartbeat_at > silent_after:
        return False  # probably dying: do not hand it a fresh attempt
    return not spec.resilience.require_deep_health_passed or node.deep_health is DeepHealthStatus.PASSED


def _place(spec: JobSpec, free: list[str], waiting: str) -> Decision:
    """As many free nodes as the job wants; an elastic job starts (or resumes) on fewer, down to its min."""
    if len(free) >= spec.fewest_nodes:
        return Decision(Action.SCHEDULE, "placed", nodes=tuple(free[: spec.nodes]))
    needs = f"at least {spec.fewest_nodes} (up to {spec.nodes})" if spec.elastic else str(spec.nodes)
    return Decision(Action.WAIT, f"{waiting}: needs {needs} schedulable idle nodes, {len(free)} available")


def _retryable_exit(spec: JobSpec, exit_code: int | None) -> bool:
    if spec.resilience.restart_policy is not RestartPolicy.EXIT_CODE or exit_code is None:
        return True
    return exit_code < 0 or exit_code >= 128


def _final_reason(job: Job, spec: JobSpec, failure: Failure) -> str:
    policy = spec.resilience
    if not policy.auto_resume:
        why = "auto_resume is off"
    elif policy.restart_policy is RestartPolicy.NEVER:
        why = "restart_policy is Never"
    elif not failure.retryable:
        why = "exit code 1-127 is not retried under restart_policy ExitCode"
    else:
        why = f"max_retry {policy.max_retry} restarts used"
    return f"{failure.reason}; {why}"


def unavailable(now: float, name: str, node: Node | None, silent_after: float) -> str:
    """Why a node the job was on cannot take its next attempt, for the resize event."""
    if node is None:
        return f"{name} is gone"
    fault = f" ({node.fault_type}: {node.fault_reason})" if node.fault_type else ""
    if node.state is NodeState.SCHEDULABLE and node.heartbeat_at is not None and now - node.heartbeat_at > silent_after:
        return f"{name} is silent for {now - node.heartbeat_at:.1f} s"
    return f"{name} is {node.state.value}{fault}"


def agent_gone(now: float, node: Node, silent_after: float) -> bool:
    """Nobody will stop this node's workers but the backend: it was retired or rebooted
    (the backend killed everything), or its heartbeat is overdue."""
    if node.state in (NodeState.RETIRED, NodeState.REBOOTING):
        return True
    return node.heartbeat_at is None or now - node.heartbeat_at > silent_after


def _silent(now: float, node: Node | None, silent_after: float) -> bool:
    """No agent is answering for this node (gone, lost, or heartbeat overdue)."""
    if node is None or not node.state.is_active:
        return True
    return node.heartbeat_at is not None and now - node.heartbeat_at > silent_after


def _node_usable_for_running(node: Node | None) -> bool:
    """Cordoning (Unschedulable) keeps running work, as on Kubernetes; faults do not."""
    return node is not None and node.state in (NodeState.SCHEDULABLE, NodeState.UNSCHEDULABLE)
