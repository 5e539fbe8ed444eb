"""Pure verdict logic: attribution of failed replays, third-rank settling, votes, NaN triage."""

from __future__ import annotations

from slurm_guard.checks.consistency import judge_vote
from slurm_guard.checks.verdicts import (
    ReplayResult,
    judge_nonfinite,
    judge_reduced_nonfinite,
    judge_replays,
    settle_with_third,
)
from slurm_guard.comm.topology import Topology
from slurm_guard.rundir.records import RankInfo


def topo(nodes: list[str]) -> Topology:
    return Topology.build([RankInfo(r, n, "host") for r, n in enumerate(nodes)])


def results(t: Topology, bad: set[int]) -> list[ReplayResult]:
    """A faulty rank computes 99 for everything it touches, the others 1."""
    out = []
    for owner in range(t.world_size):
        rep = t.replayer[owner]
        out.append(
            ReplayResult(owner, rep, 99 if owner in bad else 1, 1, 99 if rep in bad else 1, 1)
        )
    return out


def test_ring_pairs_every_rank_with_another_node() -> None:
    for nodes in (["a", "b", "c"], ["a", "a", "b", "b", "c", "c"], ["a", "b", "c", "d"]):
        t = topo(nodes)
        assert sorted(t.replayer) == list(range(len(nodes)))  # a permutation
        assert all(t.node_of(o) != t.node_of(r) for o, r in enumerate(t.replayer))


def test_single_node_rings_over_ranks() -> None:
    t = topo(["a", "a", "a"])
    assert all(o != r for o, r in enumerate(t.replayer))
    assert t.third_rank(0, t.replayer[0]) not in (0, t.replayer[0], None)


def test_persistent_fault_is_attributed_to_the_common_rank() -> None:
    for nodes in (["a", "b", "c"], ["a", "b", "c", "d"], ["a", "a", "a"]):
        t = topo(nodes)
        j = judge_replays(results(t, {1}), t)
        assert j.finding is not None and j.finding.verdict == "sdc"
        assert j.finding.suspect_ranks == (1,)


def test_two_nodes_are_ambiguous() -> None:
    t = topo(["a", "b"])
    j = judge_replays(results(t, {1}), t)
    assert j.finding is not None and j.finding.verdict == "ambiguous"


def test_node_wide_fault_is_attributed_to_the_node() -> None:
    t = topo(["a", "a", "b", "b", "c", "c"])
    j = judge_replays(results(t, {2, 3}), t)
    assert j.finding is not None and j.finding.verdict == "sdc"
    assert set(j.finding.suspect_ranks) == {2, 3}


def test_single_failure_asks_a_third_rank_and_majority_decides() -> None:
    t = topo(["a", "b", "c"])
    res = [ReplayResult(o, t.replayer[o], 1, 1, 1, 1) for o in range(3)]
    res[0] = ReplayResult(0, t.replayer[0], 5, 1, 1, 1)  # owner 0 computed something else once
    j = judge_replays(res, t)
    assert j.finding is None and j.settle == res[0]
    third = t.third_rank(0, t.replayer[0])
    assert third is not None
    assert settle_with_third(res[0], third, 1, 1).suspect_ranks == (0,)
    assert settle_with_third(res[0], third, 5, 1).suspect_ranks == (t.replayer[0],)
    assert settle_with_third(res[0], third, 7, 7).verdict == "ambiguous"


def test_every_gradient_failing_with_every_loss_exact_names_the_loop_and_stays_ambiguous() -> None:
    """accelerator.backward() divides the loss by the accumulation steps; a loss_fn that does
    not recomputes other gradients on every rank, while every loss matches bit for bit."""
    t = topo(["a", "b", "c"])
    res = [ReplayResult(o, t.replayer[o], 7, 1, 7, 2) for o in range(3)]
    j = judge_replays(res, t)
    assert j.finding is not None and j.finding.verdict == "ambiguous"
    assert "backpropagate exactly what loss_fn" in j.finding.message
    # a loss that also differs somewhere, or a passing comparison: no such hint
    res[0] = ReplayResult(0, t.replayer[0], 7, 1, 8, 2)
    other = judge_replays(res, t).finding
    assert other is not None and "loss_fn" not in other.message


def test_all_passing_is_no_finding() -> None:
    t = topo(["a", "b", "c"])
    assert judge_replays(results(t, set()), t).finding is None


def test_vote_majority_and_no_majority() -> None:
    assert judge_vote([1, 1, 1]) is None
    f = judge_vote([1, 2, 1, 1])
    assert f is not None and f.verdict == "sdc" and f.suspect_ranks == (1,)
    f = judge_vote([1, 2])
    assert f is not None and f.verdict == "ambiguous"
    f = judge_vote([1, 1, 2, 2])
    assert f is not None and f.verdict == "ambiguous"


def test_nonfinite_reproduced_is_numerical_else_sdc() -> None:
    assert judge_nonfinite([2], {2: True}, "finite_local").verdict == "numerical"
    f = judge_nonfinite([2], {2: False}, "finite_local")
    assert f.verdict == "sdc" and f.suspect_ranks == (2,)


def test_reduced_nonfinite_everywhere_is_ambiguous_on_a_minority_sdc() -> None:
    assert judge_reduced_nonfinite([False, False, False]) is None
    f = judge_reduced_nonfinite([False, True, False])
    assert f is not None and f.verdict == "sdc" and f.suspect_ranks == (1,)
    f = judge_reduced_nonfinite([True, True, True])
    assert f is not None and f.verdict == "ambiguous"


def test_reduced_overflow_is_numerical_only_when_magnitudes_allow_it() -> None:
    f = judge_reduced_nonfinite([True, True, True], overflow_possible=True)
    assert f is not None and f.verdict == "numerical"
    f = judge_reduced_nonfinite([True, True, True], overflow_possible=False)
    assert f is not None and f.verdict == "ambiguous"


def test_reduction_consistency_and_conservation() -> None:
    from slurm_guard.checks.consistency import judge_reduction

    bits = 4607182418800017408  # 1.0 as float64 bits
    assert judge_reduction([1.0, 1.0, 1.0], [3.0] * 3, [bits] * 3, bound=1e-6) is None
    f = judge_reduction([1.0, 1.0, 1.0], [3.0] * 3, [bits, bits + 1, bits], bound=1e-6)
    assert f is not None and (f.check, f.verdict, f.suspect_ranks) == (
        "reduced_consistency",
        "sdc",
        (1,),
    )
    f = judge_reduction([1.0, 1.0, 4.0], [3.0] * 3, [bits] * 3, bound=1e-6)
    assert f is not None and (f.check, f.verdict) == ("conservation", "ambiguous")


def test_conservation_bound_counts_fp16_underflow_and_buckets() -> None:
    """fp16/bf16 buckets are divided before the all-reduce: each division may lose up to half
    the smallest subnormal, which no relative term covers; more buckets add float64 sums."""
    import pytest
    import torch

    from slurm_guard.checks.consistency import conservation_bound

    half = torch.finfo(torch.float16)
    eta = half.smallest_normal * half.eps / 2
    assert eta == 2.0**-25
    base = conservation_bound([1.0, 1.0], half.eps / 2, 1000)
    with_underflow = conservation_bound([1.0, 1.0], half.eps / 2, 1000, elements=10, underflow=eta)
    assert with_underflow - base == pytest.approx(10 * 2 * eta)
    assert conservation_bound([1.0, 1.0], 2.0**-53, 1000, buckets=100) > conservation_bound(
        [1.0, 1.0], 2.0**-53, 1000, buckets=1
    )


def _float_bits(x: float) -> int:
    import struct

    return int(struct.unpack("<q", struct.pack("<d", x))[0])


def test_fast_path_passes_only_what_the_row_check_passes() -> None:
    """The per-step fast path (sums and maxima over ranks) against the row check it replaces:
    the same clean step passes both; each thing the rows would flag sends the step to them."""
    from slurm_guard.checks.consistency import conservation_bound, judge_reduction, step_passes_fast

    world, local, l1 = 3, [0.25, -0.5, 1.75], [3.0, 3.0, 3.0]
    mean = sum(local) / world
    bits = _float_bits(mean)
    bound = conservation_bound(l1, 2.0**-24, 1000)
    assert bound == conservation_bound([sum(l1)], 2.0**-24, 1000, world=world)
    assert judge_reduction(local, l1, [bits] * world, bound) is None  # the rows pass...

    def fast(**change: object) -> bool:
        totals: list[float] = [0.0, 0.0, sum(local), sum(l1)]
        maxima = [bits, ~bits, _float_bits(0.5)]
        for key, value in change.items():
            if key.startswith("t"):
                totals[int(key[1:])] = value  # type: ignore[assignment]
            else:
                maxima[int(key[1:])] = value  # type: ignore[assignment]
        return step_passes_fast(totals, maxima, world, bound)

    assert fast()  # ...and so does the fast path
    assert not fast(t0=1.0)  # a rank saw a non-finite local gradient
    assert not fast(t1=2.0)  # a non-finite averaged gradient
    assert not fast(m1=~(bits - 1))  # one rank holds another averaged sketch (max != min)
    assert not fast(m2=_float_bits(1.5))  # a checked GEMM over its bound
    assert not fast(m2=_float_bits(float("inf")))  # a NaN residual, sent as +inf
    drifted = _float_bits(mean + 2 * bound)
    assert judge_reduction(local, l1, [drifted] * world, bound) is not None
    assert not fast(m0=drifted, m1=~drifted)  # the conservation check
    assert fast(m0=_float_bits(mean + bound / 2), m1=~_float_bits(mean + bound / 2))
    assert not step_passes_fast([0.0, 0.0, 1.0], [bits, ~bits, 0], world, bound)  # bad shape


def test_fast_vote_passes_only_when_every_replica_agrees() -> None:
    from slurm_guard.checks.consistency import same_on_every_rank

    fingerprints = [[123, 456], [123, 456], [123, 456]]

    def maxima(fps: list[list[int]]) -> list[int]:
        lanes = len(fps[0])
        return [max(fp[i] for fp in fps) for i in range(lanes)] + [
            max(~fp[i] for fp in fps) for i in range(lanes)
        ]

    assert same_on_every_rank(maxima(fingerprints), 2)
    for rank in range(3):
        for lane in range(2):
            for delta in (1, -1, 1 << 30):  # above or below the others, in either lane
                odd = [list(fp) for fp in fingerprints]
                odd[rank][lane] += delta
                assert not same_on_every_rank(maxima(odd), 2), (rank, lane, delta)
    assert not same_on_every_rank(maxima(fingerprints)[:3], 2)  # an unexpected shape
    assert not same_on_every_rank([], 0)


def test_no_loop_hint_when_one_node_takes_part_in_every_failed_comparison() -> None:
    """On two nodes every comparison spans both, so a persistent gradient fault on one node
    fails them all with every loss exact: ambiguous, and no hint that blames the loop (seen
    with ShardedGuard's ranks on nodes [a, a, b, b])."""
    t = topo(["a", "a", "b", "b"])
    res = [ReplayResult(o, t.replayer[o], 7, 1, 7, 2) for o in range(4)]
    j = judge_replays(res, t)
    assert j.finding is not None and j.finding.verdict == "ambiguous"
    assert "loss_fn" not in j.finding.message
