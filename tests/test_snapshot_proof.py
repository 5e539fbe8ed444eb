"""The ledger's proof of a snapshot's step, on the rows the resume gathers (no processes).

The DDP case runs end to end in tests/test_snapshot_runs.py; here the sharded rows too: a
sharded step needs rank 0's shards sealed with the fingerprint that a passing vote, replay or
trust point recorded for that state.
"""

from __future__ import annotations

from slurm_guard.core import snapshot_peers as peers
from slurm_guard.core.snapshot_proof import STARTED_FROM, LedgerProof, fingerprint_key
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


def test_a_sharded_step_needs_rank_0_s_fingerprint_recorded_by_a_passing_check() -> None:
    good, edited = fingerprint_key(GOOD), fingerprint_key(EDITED)
    assert good is not None and edited is not None
    trust = LedgerEntry(6, Check.ABFT.value, True, {TRUST_POINT: "passed", STARTED_FROM: GOOD}, 0)
    proof = LedgerProof([_vote(3, GOOD), trust])
    rows = [
        _shard_row({4: [(0, good), (1, 77)], 8: [(0, good)]}),  # each node offers two steps
        _shard_row({6: [(0, good)], 8: [(1, 1)]}),
    ]
    allowed = proven(proof, lambda step: True, rows)
    assert allowed(4) and allowed(6) and not allowed(8)
    relabeled = [_shard_row({4: [(0, edited), (1, 77)]}), _shard_row({4: [(0, good)]})]
    assert not proven(proof, lambda step: True, relabeled)(4)  # one copy edited: not this step
    # a trust point's step alone (no state recorded, as before this field) proves nothing
    bare = LedgerProof([LedgerEntry(6, Check.ABFT.value, True, {TRUST_POINT: "passed"}, 0)])
    assert not bare.proves_shards(6, {good})


def _replay(step: int, detail: dict[str, object], passed: bool = True) -> LedgerEntry:
    return LedgerEntry(step, Check.REPLAY.value, passed, {"comparisons": 4, **detail}, 0)


def test_a_passing_replay_proves_the_state_its_step_started_from() -> None:
    """FSDP2 (+ TP) without abft: a snapshot of step N is the state replayed step N started
    from, so the replay entry of step N (not N - 1, as for a vote) must record its fingerprint."""
    good, edited = fingerprint_key(GOOD), fingerprint_key(EDITED)
    assert good is not None and edited is not None
    proof = LedgerProof(
        [
            _replay(2, {STARTED_FROM: GOOD}),
            _replay(4, {STARTED_FROM: EDITED}, passed=False),  # a failed replay proves nothing
            _replay(6, {}),  # a replay without snapshots records no state
            _replay(8, {STARTED_FROM: 12345}),  # not a hex string: nothing
        ]
    )
    assert proof.proves_shards(2, {good})
    assert not proof.proves_shards(3, {good})  # the step the state stands for, not the next
    assert not proof.proves_shards(2, {edited})  # another state relabelled as step 2
    assert not proof.proves_shards(2, {good, edited})  # two copies of rank 0 that differ
    assert not proof.proves_shards(4, {edited}) and not proof.proves_shards(6, {good})
    assert not proof.proves_shards(8, {0x12345})
    assert not proof.proves(2, good)  # the DDP proof reads votes only, as before
