"""The ledger's proof of a snapshot's step, on the rows the resume gathers (no processes).

The DDP case runs end to end in tests/test_snapshot_runs.py; here the sharded rows too: a
sharded step needs rank 0's shards sealed with the fingerprint its passing vote recorded, or a
trust point of that step.
"""

from __future__ import annotations

from slurm_guard.core import snapshot_peers as peers
from slurm_guard.core.snapshot_proof import LedgerProof, fingerprint_key
from slurm_guard.protocol import Check
from slurm_guard.rundir.records import LedgerEntry
from slurm_guard.rundir.trust import TRUST_POINT
from slurm_guard.sharded.snapshots import KEPT, PROVIDED, WIDTH, proven

GOOD, EDITED = "0123456789abcde5", "0fedcba987654321"


def _vote(step: int, fingerprint: str, passed: bool = True) -> LedgerEntry:
    return LedgerEntry(step, Check.VOTE.value, passed, {"fingerprint": fingerprint}, 0)


def _shard_row(steps: dict[int, list[tuple[int, int]]]) -> list[int]:
    row: list[int] = []
    for step, pairs in sorted(steps.items(), reverse=True):
        flat = [x for pair in pairs for x in pair]
        row += [step, *flat, *[-1] * (2 * PROVIDED - len(flat))]
    return (row + [-1] * WIDTH * KEPT)[: WIDTH * KEPT]


def test_a_step_is_proven_only_by_a_passing_vote_on_that_state() -> None:
    proof = LedgerProof([_vote(9, GOOD), _vote(14, EDITED, passed=False)])
    good, edited = fingerprint_key(GOOD), fingerprint_key(EDITED)
    assert good is not None and edited is not None
    assert proof.proves(10, good)  # the vote after step 9's update: the state after 10 steps
    assert not proof.proves(9, good) and not proof.proves(10, edited)
    assert not proof.proves(15, edited)  # a failed vote proves nothing
    rows = [peers.row_of({10: (good, True, {0}), 15: (good, True, {0})}, 2)]
    unproven = {
        step: "rank 0"
        for step, (fp, _, _) in peers.offered(rows)[0].items()
        if not proof.proves(step, fp)
    }
    allowed = proof.restrict(lambda step: True, unproven)
    assert allowed(10) and not allowed(15)


def test_a_sharded_step_needs_rank_0_s_recorded_fingerprint_or_a_trust_point() -> None:
    trust = LedgerEntry(6, Check.ABFT.value, True, {TRUST_POINT: "passed"}, 0)
    proof = LedgerProof([_vote(3, GOOD), trust])
    good, edited = fingerprint_key(GOOD), fingerprint_key(EDITED)
    assert good is not None and edited is not None
    rows = [
        _shard_row({4: [(0, good), (1, 77)], 8: [(0, good)]}),  # each node offers two steps
        _shard_row({6: [(0, 5)], 8: [(1, 1)]}),
    ]
    allowed = proven(proof, lambda step: True, rows)
    assert allowed(4) and allowed(6) and not allowed(8)
    relabeled = [_shard_row({4: [(0, edited), (1, 77)]}), _shard_row({4: [(0, good)]})]
    assert not proven(proof, lambda step: True, relabeled)(4)  # one copy edited: not this step
