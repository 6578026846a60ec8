"""Wait for a condition by polling it: the one helper the CLI, the tests and the benchmarks share.

Polling, not sleeping a guessed time: the condition is checked every
``interval`` and the wait ends the moment it holds, or fails after ``timeout``
naming what was awaited and the last value seen.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from unbroken.errors import UnbrokenError

T = TypeVar("T")


class WaitTimeout(UnbrokenError):
    """The condition did not hold within the time given."""


def wait_until(predicate: Callable[[], T], timeout: float, what: str, *, interval: float = 0.1,
               on_poll: Callable[[T], Any] | None = None) -> T:
    """Call ``predicate`` until it returns something truthy, and return that.

    ``on_poll`` sees every value (a progress bar). Raises :class:`WaitTimeout` after
    ``timeout`` seconds with ``what`` and the last value in its message.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if on_poll is not None:
            on_poll(value)
        if value:
            return value
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"timed out after {timeout:g} s waiting for: {what} (last: {value!r})")
        time.sleep(interval)
