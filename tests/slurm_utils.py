"""Test helpers for real-Slurm tests: poll for a condition instead of sleeping and hoping."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T | None],
    timeout: float,
    what: str,
    interval: float = 0.05,
    max_interval: float = 0.5,
) -> T:
    """Call ``predicate`` until it returns something truthy, and return that value.

    Polling starts fast (Slurm reacts in tens of milliseconds) and backs off so that a slow CI
    machine is not hammered. On timeout the AssertionError names ``what`` and the last value
    seen, which usually tells the reader which Slurm state the test was stuck in.

    Exceptions raised by ``predicate`` propagate: a broken query is a test failure, not a
    reason to keep waiting.
    """
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = predicate()
        if last:
            return last
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(
                f"timed out after {timeout:.1f} s waiting for {what}; last: {last!r}"
            )
        time.sleep(min(interval, remaining))
        interval = min(interval * 1.5, max_interval)
