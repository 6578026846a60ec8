"""Calling the API server: its errors as unbroken's, and its time stamps.

Every call of the Kubernetes backend goes through :func:`call`, so a 404 is a
NotFoundError, a 409 an :class:`ApiConflict` (someone wrote the object since it
was read: read again and decide again), any other refusal of the request (400,
403, 422: a field the server will not take, a permission unbroken lacks) a
:class:`RequestRefused` naming the server's reason, and an unreachable or failing
server StoreUnavailable, which the reconcile loops retry.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from typing import TypeVar

from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from unbroken.errors import BackendError, ConflictError, NotFoundError, StoreUnavailable

T = TypeVar("T")

STRICT = "Strict"
"""``fieldValidation`` for every object unbroken creates or patches: the API server refuses a field the
schema does not know (a misspelt field, one a CRD version dropped) instead of silently dropping it, so
the mistake is an error in a test, not a setting that never took effect on a user's cluster."""


class ApiConflict(ConflictError):
    """409: the object changed since it was read (a stale resourceVersion), or it exists already."""


class RequestRefused(BackendError):
    """The API server refused this request (400, 403, 422, ...): the object or the request is at fault,
    not the server, so the same request will be refused again."""

    def __init__(self, status: int, server_message: str) -> None:
        super().__init__(f"Kubernetes API refused the request ({status}): {server_message}")
        self.status = status
        self.server_message = server_message


def _reason(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body or "{}").get("message") or exc.reason)
    except (ValueError, AttributeError):
        return str(exc.reason)


def call(request: Callable[[], T]) -> T:
    try:
        return request()
    except ApiException as exc:
        if exc.status == 404:
            raise NotFoundError(exc.reason or "not found") from None
        if exc.status == 409:
            raise ApiConflict(exc.reason or "conflict") from None
        if exc.status is None or exc.status >= 500 or exc.status == 429:
            raise StoreUnavailable(f"Kubernetes API: {exc.status} {exc.reason}") from exc
        raise RequestRefused(exc.status, _reason(exc)) from None
    except (HTTPError, OSError) as exc:
        raise StoreUnavailable(f"Kubernetes API unreachable: {exc}") from exc


def parse_time(text: str | None) -> float | None:
    """An RFC 3339 time stamp (``2026-11-24T10:00:00Z``, with or without microseconds) as epoch seconds."""
    if not text:
        return None
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def format_time(ts: float, *, micro: bool = False) -> str:
    """Epoch seconds as the API writes them: whole seconds (``Time``) or microseconds (``MicroTime``, Leases)."""
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")
