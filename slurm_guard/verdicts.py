"""Pure decisions: from gathered check values to a verdict. No tensors, no I/O, no Slurm.

Every rank runs the same function on the same gathered numbers, so every rank reaches the same
verdict without a further round of communication.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from slurm_guard.protocol import Check, Verdict
from slurm_guard.topology import Topology


@dataclass(frozen=True)
class Finding:
    """A failed check: what failed, what it means, and whom it points at."""

    check: Check
    verdict: Verdict
    suspect_ranks: tuple[int, ...]
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ReplayResult:
    """One comparison: the owner's own loss/gradient fingerprint against a replay of it."""

    owner: int
    replayer: int
    owner_loss: int  # bit pattern of the loss as float64
    owner_grad: int  # gradient fingerprint
    replay_loss: int
    replay_grad: int
    # tolerance mode: the replayer's relative discrepancy from the owner, and the bound on it
    discrepancy: float | None = None
    tolerance: float = 0.0

    @property
    def matches(self) -> bool:
        if self.discrepancy is not None:
            return self.discrepancy <= self.tolerance
        return self.owner_loss == self.replay_loss and self.owner_grad == self.replay_grad

    def evidence(self) -> dict[str, Any]:
        if self.discrepancy is not None:
            return {
                "owner": self.owner,
                "replayer": self.replayer,
                "discrepancy": self.discrepancy,
                "tolerance": self.tolerance,
            }
        return {
            "owner": self.owner,
            "replayer": self.replayer,
            "owner_loss_bits": f"{self.owner_loss & (2**64 - 1):016x}",
            "replay_loss_bits": f"{self.replay_loss & (2**64 - 1):016x}",
            "owner_grad_fingerprint": f"{self.owner_grad:016x}",
            "replay_grad_fingerprint": f"{self.replay_grad:016x}",
        }


@dataclass(frozen=True)
class ReplayJudgement:
    """Either a final finding (None = all passed) or a request for a third rank's replay."""

    finding: Finding | None
    settle: ReplayResult | None = None


def judge_replays(results: list[ReplayResult], topology: Topology) -> ReplayJudgement:
    """Attribute failed comparisons.

    A faulty rank fails twice: as owner (its own values are wrong) and as replayer (its replay of
    someone else is wrong). So the rank common to every failed comparison is the suspect; failing
    that, the node common to all of them. One failed comparison on its own cannot say which side
    is wrong: a third rank replays the same microbatch and the majority decides.
    """
    failed = [r for r in results if not r.matches]
    if not failed:
        return ReplayJudgement(None)
    evidence = {"failed": [r.evidence() for r in failed], "comparisons": len(results)}
    if len(failed) == 1:
        only = failed[0]
        if topology.third_rank(only.owner, only.replayer) is not None:
            return ReplayJudgement(None, settle=only)
        return ReplayJudgement(
            Finding(
                Check.REPLAY,
                Verdict.AMBIGUOUS,
                tuple(sorted({only.owner, only.replayer})),
                f"replay of rank {only.owner}'s microbatch by rank {only.replayer} disagrees and "
                "no rank on a third node can settle it",
                evidence,
            )
        )
    common = set.intersection(*({r.owner, r.replayer} for r in failed))
    if len(common) == 1:
        rank = common.pop()
        return ReplayJudgement(
            Finding(
                Check.REPLAY,
                Verdict.SDC,
                (rank,),
                f"rank {rank} ({topology.node_of(rank)}) disagrees in all {len(failed)} failed "
                "replay comparisons",
                evidence,
            )
        )
    involved = sorted({r for f in failed for r in (f.owner, f.replayer)})
    common_nodes = set.intersection(
        *({topology.node_of(r.owner), topology.node_of(r.replayer)} for r in failed)
    )
    if len(common_nodes) == 1:
        node = common_nodes.pop()
        suspects = tuple(r for r in involved if topology.node_of(r) == node)
        return ReplayJudgement(
            Finding(
                Check.REPLAY,
                Verdict.SDC,
                suspects,
                f"node {node} takes part in all {len(failed)} failed replay comparisons",
                evidence,
            )
        )
    return ReplayJudgement(
        Finding(
            Check.REPLAY,
            Verdict.AMBIGUOUS,
            tuple(involved),
            f"{len(failed)} replay comparisons failed with no common rank or node "
            "(several faults, or too few nodes to attribute)",
            evidence,
        )
    )


def settle_with_third(
    disputed: ReplayResult, third: int, loss: int, grad: int, discrepancy: float | None = None
) -> Finding:
    """The majority of owner, replayer and a third replay decides who computed wrong.

    In tolerance mode only distances from the owner are known: a third rank that agrees with
    the owner outvotes the replayer, one that disagrees sides with the replayer.
    """
    if discrepancy is not None:
        agrees = discrepancy <= disputed.tolerance
        suspect = disputed.replayer if agrees else disputed.owner
        other = disputed.owner if agrees else disputed.replayer
        return Finding(
            Check.REPLAY,
            Verdict.SDC,
            (suspect,),
            f"rank {suspect} disagrees with ranks {other} and {third} on rank "
            f"{disputed.owner}'s microbatch (beyond the calibrated tolerance)",
            {"disputed": disputed.evidence(), "third": third, "third_discrepancy": discrepancy},
        )
    evidence = {
        "disputed": disputed.evidence(),
        "third": third,
        "third_loss_bits": f"{loss & (2**64 - 1):016x}",
        "third_grad_fingerprint": f"{grad:016x}",
    }
    agrees_owner = (loss, grad) == (disputed.owner_loss, disputed.owner_grad)
    agrees_replayer = (loss, grad) == (disputed.replay_loss, disputed.replay_grad)
    if agrees_owner:
        suspect, other = disputed.replayer, disputed.owner
    elif agrees_replayer:
        suspect, other = disputed.owner, disputed.replayer
    else:
        return Finding(
            Check.REPLAY,
            Verdict.AMBIGUOUS,
            tuple(sorted({disputed.owner, disputed.replayer, third})),
            f"ranks {disputed.owner}, {disputed.replayer} and {third} computed three different "
            f"results for rank {disputed.owner}'s microbatch",
            evidence,
        )
    return Finding(
        Check.REPLAY,
        Verdict.SDC,
        (suspect,),
        f"rank {suspect} disagrees with ranks {other} and {third} on rank {disputed.owner}'s "
        "microbatch",
        evidence,
    )


def judge_nonfinite(
    flagged: list[int],
    reproduced: dict[int, bool],
    check: Check,
    unreplayed: Sequence[int] = (),
) -> Finding:
    """A NaN/Inf is hardware only if another node computing the same microbatch does not get it.

    `reproduced[owner]` says whether the owner's replayer also got a non-finite result.
    `unreplayed` are flagged ranks that no other rank could replay (world size 1): for them
    nothing can tell hardware from data, so the verdict is ambiguous, never sdc.
    """
    evidence: dict[str, Any] = {"nonfinite_ranks": flagged, "reproduced_by_replay": reproduced}
    faulty = tuple(r for r in flagged if r not in unreplayed and not reproduced.get(r, False))
    if faulty:
        return Finding(
            check,
            Verdict.SDC,
            faulty,
            f"non-finite gradients on rank(s) {list(faulty)} that a replay on another rank does "
            "not reproduce",
            evidence,
        )
    if unreplayed:
        evidence["not_replayed"] = list(unreplayed)
        evidence["replay"] = "none: no other rank can recompute these ranks' microbatches"
        return Finding(
            check,
            Verdict.AMBIGUOUS,
            (),  # nothing points at a node: no drain
            f"non-finite gradients on rank(s) {list(unreplayed)} and no replay on another rank "
            "could run (world size 1): hardware fault or unstable data/model cannot be told apart",
            evidence,
        )
    return Finding(
        check,
        Verdict.NUMERICAL,
        (),
        f"non-finite gradients on rank(s) {flagged}, reproduced by replay: the data or the model "
        "is numerically unstable, not the hardware",
        evidence,
    )


def judge_reduced_nonfinite(flags: list[bool], overflow_possible: bool = False) -> Finding | None:
    """Local gradients were finite but the averaged ones are not.

    Summing finite values can overflow only if some element's sum of magnitudes exceeds the
    largest finite value, which needs the ranks' L1 norms to add up to at least that much
    (`overflow_possible`): then it is numerical (a GradScaler finding its level), else a fault.
    """
    bad = [r for r, f in enumerate(flags) if f]
    if not bad:
        return None
    if overflow_possible and len(bad) == len(flags):
        return Finding(
            Check.FINITE_REDUCED,
            Verdict.NUMERICAL,
            (),
            "the averaged gradients overflowed; the local gradients are large enough for that",
            {"nonfinite_ranks": bad},
        )
    if 2 * len(bad) < len(flags):
        return Finding(
            Check.FINITE_REDUCED,
            Verdict.SDC,
            tuple(bad),
            f"averaged gradients non-finite only on rank(s) {bad}: their copy was corrupted",
            {"nonfinite_ranks": bad},
        )
    return Finding(
        Check.FINITE_REDUCED,
        Verdict.AMBIGUOUS,
        tuple(bad),
        "finite local gradients averaged to non-finite values: the fault is inside the all-reduce",
        {"nonfinite_ranks": bad},
    )


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


def bits_to_float(bits: int) -> float:
    """A float64 that travelled through an int64 collective as its bit pattern."""
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])
