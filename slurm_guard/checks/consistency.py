"""Pure decisions on values that must be the same on every rank: the vote, the all-reduce.

Replicas must hold identical weights after an update, and an all-reduce must conserve the sum
of what went in and hand every rank the same result. These functions turn the gathered (or
all-reduced) values into a verdict; like `verdicts`, they do no I/O and touch no tensor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

from slurm_guard.checks.verdicts import Finding, bits_to_float
from slurm_guard.protocol import Check, Verdict


def odd_ones_out(values: Sequence[Hashable]) -> tuple[int, ...] | None:
    """Ranks whose value differs from a strict majority: () if all agree, None if no majority."""
    value, count = Counter(values).most_common(1)[0]
    if 2 * count <= len(values):
        return None
    return tuple(r for r, v in enumerate(values) if v != value)


def judge_vote(fingerprints: list[int], what: str = "weights") -> Finding | None:
    """Replicas must hold identical state; the odd rank out of a strict majority is the suspect."""
    odd = odd_ones_out(fingerprints)
    if odd == ():
        return None
    evidence = {"fingerprints": [f"{fp:016x}" for fp in fingerprints]}
    if odd is not None:
        count = len(fingerprints) - len(odd)
        return Finding(
            Check.VOTE,
            Verdict.SDC,
            odd,
            f"{what} of rank(s) {list(odd)} differ from the majority of {count} of "
            f"{len(fingerprints)} replicas",
            evidence,
        )
    return Finding(
        Check.VOTE,
        Verdict.AMBIGUOUS,
        tuple(range(len(fingerprints))),
        f"{what} differ across replicas with no strict majority",
        evidence,
    )


def same_on_every_rank(maxima: Sequence[int], n: int) -> bool:
    """Whether every rank holds the same n int64 values, from one MAX all-reduce of the values
    followed by their bitwise complements: max(x) == ~max(~x) = min(x). A False (a difference,
    or an unexpected shape) sends the round to the gather, which names the odd ranks out. The
    vote's fast path, and the averaged sketch's agreement in `step_passes_fast`."""
    if n < 1 or len(maxima) != 2 * n:
        return False
    return all(maxima[i] == ~maxima[n + i] for i in range(n))


def conservation_bound(
    l1_norms: list[float],
    unit_roundoff: float,
    largest_bucket: int,
    buckets: int = 1,
    elements: int = 0,
    underflow: float = 0.0,
    world: int | None = None,
) -> float:
    """How far the averaged sketch may drift from the mean of the local sketches by rounding.

    W ranks, u the gradient dtype's unit roundoff, u64 = 2^-53, d = bit_length of the largest
    bucket, B buckets and n elements per step (derivation: benchmarks/README.md, "Rounding
    bound"). The all-reduce errs by at most u sum_r L1_r on the +-1 sketch, plus n W eta when
    fp16/bf16 buckets are divided before the sum (eta: half the smallest subnormal, what one
    underflowing division can lose). The fused kernel's fixed float64 tree errs by d u64 per L1
    on each sketch, adding B bucket sketches by B u64, averaging W sketches by W u64. A factor 2
    covers the second-order terms. `world`: W when `l1_norms` is already their sum (the fast
    path's all-reduce); the number of norms otherwise.
    """
    total = sum(l1_norms)
    world = world if world is not None else max(len(l1_norms), 1)
    depth = max(largest_bucket, 2).bit_length() + 1
    float64_error = (2 * depth + 2 * buckets + world) * 2.0**-53 * total / world
    return 2.0 * (unit_roundoff * total + float64_error) + elements * world * underflow


def step_passes_fast(
    totals: Sequence[float], maxima: Sequence[int], world: int, bound: float
) -> bool:
    """The per-step checks from two all-reduces instead of every rank's row: True only where
    the row check would find nothing, so a False (anything amiss, or an unexpected shape) sends
    the step to the row gather, which attributes it.

    totals (summed over ranks): [ranks with a non-finite local value, ranks with a non-finite
    averaged value, local sketch, local L1]. maxima (maximum over ranks): [averaged sketch
    bits, their bitwise complement, bits of the largest checked-GEMM residual/bound, NaN taken
    as +inf]. Every rank holds the same averaged sketch iff max(bits) == ~max(~bits) = min.
    """
    if len(totals) != 4 or len(maxima) != 3 or world < 1:
        return False
    local_nonfinite, reduced_nonfinite, sketch_sum, _l1 = totals
    reduced_max, _, abft_max = maxima
    if local_nonfinite != 0 or reduced_nonfinite != 0:
        return False
    if not same_on_every_rank(maxima[:2], 1):
        return False
    if not bits_to_float(abft_max) <= 1.0:
        return False
    return abs(bits_to_float(reduced_max) - sketch_sum / world) <= bound


def judge_reduction(
    local_sketches: list[float],
    local_l1: list[float],
    reduced_sketch_bits: list[int],
    bound: float,
    reduced_fingerprints: list[int] | None = None,
) -> Finding | None:
    """The averaged gradients must be identical on every rank and conserve the local sketches.

    A copy that differs on a minority of ranks was corrupted after the reduction on those ranks.
    A result that is the same everywhere but does not conserve the sketch was computed wrong
    inside the all-reduce: every replica got it, no other check can see it, and which node
    produced it cannot be told from here (verdict ambiguous).
    """
    world = len(local_sketches)
    keys = list(zip(reduced_sketch_bits, reduced_fingerprints or [0] * world, strict=True))
    odd = odd_ones_out(keys)
    if odd != ():
        evidence = {"reduced_sketch_bits": [f"{b & (2**64 - 1):016x}" for b in reduced_sketch_bits]}
        if odd is not None:
            return Finding(
                Check.REDUCED_CONSISTENCY,
                Verdict.SDC,
                odd,
                f"averaged gradients on rank(s) {list(odd)} differ from the other replicas' copy",
                evidence,
            )
        return Finding(
            Check.REDUCED_CONSISTENCY,
            Verdict.AMBIGUOUS,
            tuple(range(world)),
            "averaged gradients differ across ranks with no strict majority",
            evidence,
        )
    expected = sum(local_sketches) / world
    actual = bits_to_float(reduced_sketch_bits[0])  # every rank holds the same value here
    drift = abs(actual - expected)
    if drift <= bound:
        return None
    return Finding(
        Check.CONSERVATION,
        Verdict.AMBIGUOUS,
        (),
        f"the all-reduce did not conserve the gradient sketch: mean of local sketches "
        f"{expected!r}, averaged sketch {actual!r}, drift {drift:.3e} > rounding bound {bound:.3e}",
        {"expected": expected, "actual": actual, "drift": drift, "bound": bound},
    )
