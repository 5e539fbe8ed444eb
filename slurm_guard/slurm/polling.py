"""Waiting for a condition by polling it, with back-off and a deadline, instead of sleeping
and hoping. Standard library only: the launcher imports it inside every task."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll(
    predicate: Callable[[], T | None],
    timeout: float,
    what: str,
    interval: float = 0.05,
    max_interval: float = 0.5,
) -> T:
    """Call `predicate` until it returns something truthy, and return that value.

    The project's one polling helper: the drill, the launcher's wait for rank 0's rendezvous
    record, and tests that wait for Slurm or for files.
    Polling starts fast (Slurm reacts in tens of milliseconds) and backs off to `max_interval`
    so a slow machine is not hammered. On timeout, TimeoutError names `what` and the last value
    seen, which usually says where things got stuck. Exceptions from `predicate` propagate: a
    broken query is an error, not a reason to keep waiting.
    """
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise TimeoutError(f"waited {timeout:g} s for {what}; last: {last!r}")
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
        interval = min(interval * 1.5, max_interval)
