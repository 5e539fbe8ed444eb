"""Pure decisions: from gathered check values to a verdict. No tensors, no I/O, no Slurm.

Every rank runs the same function on the same gathered numbers, so every rank reaches the same
verdict without a further round of communication.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from slurm_guard.topology import Topology


@dataclass(frozen=True)
class Finding:
    """A failed check: what failed, what it means, and whom it points at."""

    check: str
    verdict: str  # "sdc" | "ambiguous" | "numerical"
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

    @property
    def matches(self) -> bool:
        return self.owner_loss == self.replay_loss and self.owner_grad == self.replay_grad

    def evidence(self) -> dict[str, Any]:
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
                "replay",
                "ambiguous",
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
                "replay",
                "sdc",
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
                "replay",
                "sdc",
                suspects,
                f"node {node} takes part in all {len(failed)} failed replay comparisons",
                evidence,
            )
        )
    return ReplayJudgement(
        Finding(
            "replay",
            "ambiguous",
            tuple(involved),
            f"{len(failed)} replay comparisons failed with no common rank or node "
            "(several faults, or too few nodes to attribute)",
            evidence,
        )
    )


def settle_with_third(disputed: ReplayResult, third: int, loss: int, grad: int) -> Finding:
    """The majority of owner, replayer and a third replay decides who computed wrong."""
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
            "replay",
            "ambiguous",
            tuple(sorted({disputed.owner, disputed.replayer, third})),
            f"ranks {disputed.owner}, {disputed.replayer} and {third} computed three different "
            f"results for rank {disputed.owner}'s microbatch",
            evidence,
        )
    return Finding(
        "replay",
        "sdc",
        (suspect,),
        f"rank {suspect} disagrees with ranks {other} and {third} on rank {disputed.owner}'s "
        "microbatch",
        evidence,
    )


def judge_nonfinite(flagged: list[int], reproduced: dict[int, bool], check: str) -> Finding:
    """A NaN/Inf is hardware only if another node computing the same microbatch does not get it.

    `reproduced[owner]` says whether the owner's replayer also got a non-finite result.
    """
    evidence = {"nonfinite_ranks": flagged, "reproduced_by_replay": reproduced}
    faulty = tuple(r for r in flagged if not reproduced.get(r, False))
    if faulty:
        return Finding(
            check,
            "sdc",
            faulty,
            f"non-finite gradients on rank(s) {list(faulty)} that a replay on another rank does "
            "not reproduce",
            evidence,
        )
    return Finding(
        check,
        "numerical",
        (),
        f"non-finite gradients on rank(s) {flagged}, reproduced by replay: the data or the model "
        "is numerically unstable, not the hardware",
        evidence,
    )


def judge_reduced_nonfinite(flags: list[bool]) -> Finding | None:
    """Local gradients were finite but the averaged ones are not."""
    bad = [r for r, f in enumerate(flags) if f]
    if not bad:
        return None
    if 2 * len(bad) < len(flags):
        return Finding(
            "finite_reduced",
            "sdc",
            tuple(bad),
            f"averaged gradients non-finite only on rank(s) {bad}: their copy was corrupted",
            {"nonfinite_ranks": bad},
        )
    return Finding(
        "finite_reduced",
        "ambiguous",
        tuple(bad),
        "finite local gradients averaged to non-finite values: the fault is inside the all-reduce",
        {"nonfinite_ranks": bad},
    )


def judge_vote(fingerprints: list[int], what: str = "weights") -> Finding | None:
    """Replicas must hold identical state; the odd rank out of a strict majority is the suspect."""
    counts = Counter(fingerprints)
    if len(counts) == 1:
        return None
    evidence = {"fingerprints": [f"{fp:016x}" for fp in fingerprints]}
    value, count = counts.most_common(1)[0]
    if 2 * count > len(fingerprints):
        odd = tuple(r for r, fp in enumerate(fingerprints) if fp != value)
        return Finding(
            "vote",
            "sdc",
            odd,
            f"{what} of rank(s) {list(odd)} differ from the majority of {count} of "
            f"{len(fingerprints)} replicas",
            evidence,
        )
    return Finding(
        "vote",
        "ambiguous",
        tuple(range(len(fingerprints))),
        f"{what} differ across replicas with no strict majority",
        evidence,
    )
