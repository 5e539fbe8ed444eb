"""A snapshot proves its step: the run's own ledger must have recorded that step's state.

A seal in node-local memory says which step its state stands for; the seal is only a file. A
checkpoint proves its weights against its seal; a snapshot proves its seal against the ledger in
the run directory, which the guard wrote as the check passed. A snapshot of step N holds the
state after N steps, and is offered only where the ledger records, with the fingerprint the
snapshot is sealed with:
- a passing vote on the state after step N - 1's update (the vote's own fingerprint); or,
- for a sharded run without replicas (FSDP2, FSDP2 + TP), a passing replay of step N or a
  trust point at step N, whose entry records the state that step started from (`STARTED_FROM`:
  the state before step N's update, which is the state after N steps). An entry without it
  (a check with snapshots off, or an older slurm-guard) proves no snapshot.
A seal whose step was edited (the state of step 20 claiming step 25) names a fingerprint the
ledger never recorded for that step, and the load then proves the state against that same
fingerprint: the step and the state are bound together.

Rank 0 reads the ledger once per resume and leaves out every step some rank offers without
such a record, with a warning naming the step and the rank; the resume then tries older ones.

A sharded entry records rank 0's shard fingerprint, so a sharded step is proven by rank 0's
shards; the other ranks' shards are proven at load against their seals (docs/snapshots.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from slurm_guard.protocol import Check
from slurm_guard.rundir.records import LedgerEntry, read_ledger
from slurm_guard.rundir.trust import counts_for_trust

logger = logging.getLogger(__name__)

__all__ = ["STARTED_FROM", "LedgerProof", "fingerprint_key"]

STARTED_FROM = "started_from"
"""Ledger detail key of a passing replay or trust point: rank 0's shard fingerprint of the state
the step started from, recorded where a snapshot of that state follows (ShardedGuard)."""


def fingerprint_key(fingerprint: str) -> int | None:
    """A sealed or recorded fingerprint (16 hex digits) as the resume's gather carries it:
    its first 60 bits; None if it is not hex."""
    try:
        return int(fingerprint[:15], 16)
    except ValueError:
        return None


class LedgerProof:
    """Which (step, fingerprint) pairs the run's ledger vouches for."""

    def __init__(self, entries: Iterable[LedgerEntry]) -> None:
        self.votes: dict[int, set[int]] = {}  # snapshot step (vote step + 1) -> fingerprints
        self.checked: dict[int, set[int]] = {}  # snapshot step (replay / trust step) -> same
        for entry in entries:
            if not entry.passed:
                continue
            if entry.check == Check.VOTE.value:
                key = fingerprint_key(str(entry.detail.get("fingerprint", "")))
                if key is not None:
                    self.votes.setdefault(entry.step + 1, set()).add(key)
            elif counts_for_trust(entry):  # a passing replay, or a trust point
                started = entry.detail.get(STARTED_FROM)
                key = fingerprint_key(started) if isinstance(started, str) else None
                if key is not None:
                    self.checked.setdefault(entry.step, set()).add(key)

    @classmethod
    def read(cls, ledger: Path | None) -> LedgerProof:
        """The proof from the ledger file (an unreadable ledger proves nothing)."""
        return cls(read_ledger(ledger) if ledger is not None else [])

    def proves(self, step: int, fingerprint: int) -> bool:
        return fingerprint in self.votes.get(step, ())

    def proves_shards(self, step: int, rank_zero: set[int]) -> bool:
        """A sharded step: a passing vote, replay or trust point whose recorded fingerprint
        (rank 0's shards) is what every offered copy of rank 0's snapshot is sealed with."""
        recorded = self.votes.get(step, set()) | self.checked.get(step, set())
        return bool(rank_zero) and rank_zero <= recorded

    def restrict(
        self, allowed: Callable[[int], bool], unproven: Mapping[int, str]
    ) -> Callable[[int], bool]:
        """`allowed` less the unproven steps, each named once in a warning where it mattered."""
        for step, who in sorted(unproven.items(), reverse=True):
            if allowed(step):
                logger.warning(
                    "skipping snapshot step-%08d (%s): the run's ledger records no passing vote, "
                    "replay or trust point of that state with its fingerprint",
                    step,
                    who,
                )
        return lambda step: step not in unproven and allowed(step)
