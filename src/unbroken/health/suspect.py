"""The known-answer check on demand, for a node the controller suspects of silent data corruption.

When two replicas disagree there is no majority to say which one computed
wrong, so the controller cordons both nodes (``Unschedulable``, fault type
``SilentDataCorruptionSuspect``) and their agents run the known-answer check
(health/checks/known_answer.py) at once: a node that gets a wrong answer is
``UnschedulablePendingReplacement`` with fault type ``SilentDataCorruption``;
one that gets the exact answer is ``Schedulable`` again. A check that cannot
finish (timeout, crash) counts as a wrong answer: a node that cannot show it
computes right does not get the job back.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from collections.abc import Callable

from unbroken.config.cluster import ClusterConfig
from unbroken.health import catalogue, events, faults, runner, targets
from unbroken.health.context import CheckContext
from unbroken.health.result import CheckResult, FaultAction, Suite
from unbroken.plumbing.layout import ClusterLayout
from unbroken.state.phases import NodeState
from unbroken.state.records import EventType, Node
from unbroken.state.store import ClusterStore, StaleUpdate
from unbroken.state.updates import NodeUpdate

log = logging.getLogger("unbroken.health.suspect")

CHECK = "stress.known_answer"


def _context(layout: ClusterLayout, cluster: ClusterConfig, node: Node) -> CheckContext:
    """The node's check context; for a node whose instance type has no health profile (a Kubernetes Node without the
    ``node.kubernetes.io/instance-type`` label), the shipped cpu-dev profile's: the known-answer check reads no
    threshold from it, and it checks every GPU it finds."""
    try:
        return targets.context(layout, cluster, node)
    except ValueError:
        return dataclasses.replace(targets.context(layout, cluster, dataclasses.replace(node, instance_type=UNPROFILED)),
                                   instance_type=node.instance_type)


UNPROFILED = "cpu-dev"


def is_suspect(node: Node) -> bool:
    return node.state is NodeState.UNSCHEDULABLE and node.fault_type == faults.SDC_SUSPECT


def check(store: ClusterStore, jobs_on: events.JobsOn, layout: ClusterLayout, cluster: ClusterConfig, name: str) -> CheckResult:
    """Run the known-answer check on suspect node ``name`` and move it out or back in."""
    node = store.get_node(name)
    result = runner.run_check(catalogue.get(CHECK, cluster.Health), _context(layout, cluster, node), Suite.INSTANCE_STRESS)
    events.record(store, result)
    if result.failed:
        events.apply_fault(store, jobs_on, name, FaultAction.REPLACE, f"{result.check}: {result.message}", source=result.check,
                           fault_type=faults.SILENT_DATA_CORRUPTION)
        return result
    for _ in range(3):
        node = store.get_node(name)
        if not is_suspect(node):
            break  # an operator or the controller moved it meanwhile: theirs is the newer word
        try:
            store.update_node(name, NodeUpdate(state=NodeState.SCHEDULABLE, fault_type=None, fault_reason=None),
                              expect_version=node.version)
        except StaleUpdate:
            continue
        store.add_event("Node", name, "SilentDataCorruptionCleared",
                        f"{result.check} passed ({result.message}): the node computes right and takes work again",
                        type=EventType.NORMAL)
        break
    return result


class SuspectWatch:
    """An agent's side of the suspicion: given its node's record (read by its loop anyway), run :func:`check` beside
    the loop once per suspicion (it takes seconds). A check that could not run is run again, never counted as passed:
    the node stays cordoned meanwhile. Both agents (local and Kubernetes) use it."""

    def __init__(self, run: Callable[[], CheckResult], node: str) -> None:
        self._run = run
        self._node = node
        self._thread: threading.Thread | None = None

    def look(self, node: Node) -> None:
        if not is_suspect(node) or (self._thread is not None and self._thread.is_alive()):
            return
        self._thread = threading.Thread(target=self._check, name="suspect-check", daemon=True)
        self._thread.start()

    def _check(self) -> None:
        try:
            self._run()
        except Exception:  # noqa: BLE001 - the node stays cordoned: its agent looks again on its next pass
            log.exception("suspect check failed to run; the next pass runs it again", extra={"node": self._node})
