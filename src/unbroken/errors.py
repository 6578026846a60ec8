"""The one error hierarchy of unbroken.

Everything the user can cause raises a subclass of :class:`UnbrokenError`; the
CLI catches it once, prints ``error: <message>`` on one line and exits with
``exit_code``. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UnbrokenError(Exception):
    """Base of every error unbroken raises on purpose."""

    exit_code: int = 1


class ConfigError(UnbrokenError):
    """A cluster or job file (or a flag) is invalid. Nothing was changed."""

    exit_code = 2


class UsageError(UnbrokenError):
    """The command was called wrongly (unknown job, node, rank...)."""

    exit_code = 2


class NotFoundError(UsageError):
    """A named object (job, node, cluster) does not exist."""


class ConflictError(UnbrokenError):
    """The request conflicts with the current state (name taken, cluster up)."""


class StoreError(UnbrokenError):
    """The state store is missing, too new, or unreadable."""


class StoreUnavailable(StoreError):
    """The store did not answer (busy, locked, unreachable): retryable, unlike its base.

    Long-running loops (agent, monitors) catch this one and retry; a store hiccup
    must never kill an agent, which would look like a lost node."""


class BackendError(UnbrokenError):
    """Starting or stopping a node or worker failed."""


class CheckpointError(UnbrokenError):
    """A checkpoint could not be written or read."""


class ReplicasDiverged(UnbrokenError):
    """Data-parallel replicas no longer hold the same state (``ctx.watch_replicas``): silent data corruption on some
    rank. Raised on every rank of the group at once; the job restarts from the last step they agreed on."""
