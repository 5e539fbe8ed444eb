"""Pure decisions: from gathered check values to a verdict. No tensors, no I/O, no Slurm.

Every rank runs the same function on the same gathered numbers, so every rank reaches the same
verdict without a further round of communication.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from slurm_guard.comm.topology import Topology
from slurm_guard.protocol import Check, Verdict


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
            "(several faults, or too few nodes to attribute)"
            + ("" if common_nodes else _loop_hint(failed, results)),
            evidence,
        )
    )


def _loop_hint(failed: list[ReplayResult], results: list[ReplayResult]) -> str:
    """Every loss reproduced bit for bit but no gradient did, and no node takes part in every
    failed comparison (the caller's condition): one fault on every node at once is far less
    likely than a loop whose backward is not `loss_fn`'s, so the message says so (the verdict
    stays ambiguous: nothing is trusted that could not be verified). On two nodes every
    comparison spans both, so one node's fault explains it: no hint there."""
    if len(failed) < len(results) or len(results) < 3:
        return ""
    if any(r.discrepancy is not None or r.owner_loss != r.replay_loss for r in failed):
        return ""
    return (
        "; every loss reproduced exactly and no gradient did, which points at the loop: the "
        "backward must backpropagate exactly what loss_fn(model, microbatch) returns (for "
        "example, accelerator.backward() divides by gradient_accumulation_steps, so loss_fn "
        "must divide too; see docs/integrations/hf.md)"
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


def bits_to_float(bits: int) -> float:
    """A float64 that travelled through an int64 collective as its bit pattern."""
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])
