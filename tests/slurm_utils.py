"""Test helpers for real-Slurm tests: poll for a condition instead of sleeping and hoping."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from slurm_guard.slurm.polling import poll

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T | None],
    timeout: float,
    what: str,
    interval: float = 0.05,
    max_interval: float = 0.5,
) -> T:
    """`slurm_guard.slurm.polling.poll` (the project's one polling helper), with a timeout that
    fails the test as an AssertionError naming `what` and the last value seen, which usually
    tells the reader which Slurm state the test was stuck in."""
    try:
        return poll(predicate, timeout, what, interval=interval, max_interval=max_interval)
    except TimeoutError as exc:
        raise AssertionError(f"timed out: {exc}") from None
