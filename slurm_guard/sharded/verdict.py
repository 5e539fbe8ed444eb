"""The sharded guard's verdict row and the pure decisions on the gathered rows.

One fixed-size int64 row per rank per step, as in `checks.rows` for DDP, but with what a
sharded step measures: the finite flags of the unreduced gradient (reduce-scatter input) and
of the reduced shard, the loss bits, the checked GEMMs' worst ratio, the reduce-scatter's
conservation residual and the inputs' L1 norm (float64 bits) and, on verification
steps, the fingerprint of this rank's reduce-scatter input and of its replay of another
replica group's rank. Every rank runs the same functions on the same rows, so every rank
reaches the same finding without a further round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from slurm_guard.checks.consistency import judge_vote
from slurm_guard.checks.verdicts import (
    Finding,
    ReplayResult,
    bits_to_float,
    judge_replays,
    settle_with_third,
)
from slurm_guard.comm.topology import Topology
from slurm_guard.protocol import Check, Verdict
from slurm_guard.sharded.layout import Layout
from slurm_guard.sharded.replay import ReplayValues

(
    LOCAL_NONFINITE,
    REDUCED_NONFINITE,
    OWN_LOSS,
    OWN_GRAD,
    REPLAYED,
    REPLAY_LOSS,
    REPLAY_GRAD,
    REPLAY_NONFINITE,
    REPLAY_FAILED,
    ABFT_RATIO,
    ABFT_WHERE,
    CONSERVE_RESIDUAL,
    CONSERVE_L1,
) = range(13)
ROW = 13


def replay_fields(own_grad: int, values: ReplayValues) -> list[int]:
    """[OWN_GRAD .. REPLAY_FAILED] of a row."""
    return [
        own_grad,
        values.owner,
        values.loss,
        values.grad,
        int(values.nonfinite),
        int(values.failed),
    ]


def replay_results(
    rows: Sequence[Sequence[int]], replay_rows: Sequence[Sequence[int]]
) -> list[ReplayResult]:
    """Each replayer's values against its owner's own: `replay_rows[r]` is rank r's
    [REPLAYED .. REPLAY_FAILED] slice of a round, `rows` the step's rows (the owners' values)."""
    out = []
    for replayer, rep in enumerate(replay_rows):
        owner = rep[0]
        if owner < 0:
            continue
        out.append(
            ReplayResult(
                owner=owner,
                replayer=replayer,
                owner_loss=rows[owner][OWN_LOSS],
                owner_grad=rows[owner][OWN_GRAD],
                replay_loss=rep[1],
                replay_grad=rep[2],
            )
        )
    return out


def judge_by_tp(
    first: list[ReplayResult],
    second: list[ReplayResult] | None,
    topology: Topology,
    layout: Layout,
) -> Finding | None:
    """Judge each TP index's comparisons on their own, then join the findings.

    Ranks at different TP indices never compare with each other, so a fault on one rank of a
    node fails comparisons at its TP index only, and one on the whole node fails them at every
    index: judged together, the second would have no common rank. The joined finding is `sdc`
    only if every TP index's is; its suspects are all of theirs.
    """
    findings = []
    for t in range(layout.tp):
        mine = [r for r in first if layout.tp_index(r.owner) == t]
        settle = [r for r in second if layout.tp_index(r.owner) == t] if second else None
        finding = judge_sharded_replays(mine, settle, topology)
        if finding is not None:
            findings.append(finding)
    if len(findings) <= 1:
        return findings[0] if findings else None
    sdc = all(f.verdict == Verdict.SDC for f in findings)
    suspects = tuple(sorted({r for f in findings for r in f.suspect_ranks}))
    return Finding(
        Check.REPLAY,
        Verdict.SDC if sdc else Verdict.AMBIGUOUS,
        suspects,
        "; ".join(f.message for f in findings),
        {"by_tp_index": [f.evidence for f in findings]},
    )


def judge_sharded_replays(
    first: list[ReplayResult], second: list[ReplayResult] | None, topology: Topology
) -> Finding | None:
    """Attribute failed comparisons of the first round, with the settling round's if it ran.

    A persistent fault on rank F fails F's own step (its replayer disagrees) and F's replay
    of someone else. With two replica groups those are the same pair of ranks, so the
    settling round, in which a third rank recomputes every microbatch, names F: it is the one
    rank common to every failed comparison. A single disputed comparison is settled by the
    third rank's replay of the same owner (`settle_with_third`).
    """
    results = first + (second or [])
    judgement = judge_replays(results, topology)
    if judgement.settle is None:
        return judgement.finding
    disputed = judgement.settle
    third = next((r for r in second or [] if r.owner == disputed.owner and r is not disputed), None)
    if third is None:
        return Finding(
            Check.REPLAY,
            Verdict.AMBIGUOUS,
            tuple(sorted({disputed.owner, disputed.replayer})),
            f"the replay of rank {disputed.owner}'s step by rank {disputed.replayer} disagrees "
            "and no third replica group or shard position can settle it",
            {"failed": [disputed.evidence()]},
        )
    return settle_with_third(disputed, third.replayer, third.replay_loss, third.replay_grad)


def judge_conservation(
    rows: Sequence[Sequence[int]], layout: Layout, bound: Callable[[list[float]], float]
) -> Finding | None:
    """Each shard group's reduce-scatters must conserve the sum of their inputs.

    A shard group is one replica's ranks at one TP index (`Layout.shard_groups`): the ranks a
    reduce-scatter runs over. Under tensor parallel each TP index reduces its own gradients.

    `bound(l1_norms)` is the rounding tolerance for one group's inputs. A group over it got a
    wrong reduction: the wrong value is in every rank's copy of that shard after HSDP's
    all-reduce, and which GPU or link made it cannot be told from the sums, so the verdict is
    `ambiguous` with no suspect, as for the DDP guard's all-reduce (the group is in the evidence).
    """
    bad = []
    for i, group in enumerate(layout.shard_groups()):
        residual = sum(bits_to_float(rows[r][CONSERVE_RESIDUAL]) for r in group)
        limit = bound([bits_to_float(rows[r][CONSERVE_L1]) for r in group])
        if not abs(residual) <= limit:  # NaN fails too
            bad.append({"group": i, "ranks": list(group), "error": residual, "bound": limit})
    if not bad:
        return None
    first = bad[0]
    return Finding(
        Check.CONSERVATION,
        Verdict.AMBIGUOUS,
        (),
        f"the reduce-scatter of shard group {first['ranks']} did not conserve the gradient sum: "
        f"error {first['error']:.3e} over the rounding bound {first['bound']:.3e}",
        {"groups": bad},
    )


def judge_abft(rows: Sequence[Sequence[int]], where: Sequence[str]) -> Finding | None:
    """A checked GEMM whose residual exceeded its rounding bound: local and attributable at
    once. `where[r]` names rank r's worst layer and pass (from its own ABFT handle)."""
    bad = []
    for rank, row in enumerate(rows):
        ratio = bits_to_float(row[ABFT_RATIO])
        if not ratio <= 1.0:
            bad.append(rank)
    if not bad:
        return None
    return Finding(
        Check.ABFT,
        Verdict.SDC,
        tuple(bad),
        f"checked GEMM failed its check on rank(s) {bad}: {where[bad[0]]}",
        {"ratios": {str(r): bits_to_float(rows[r][ABFT_RATIO]) for r in bad}},
    )


def judge_shard_vote(fingerprints: Sequence[int], layout: Layout) -> Finding | None:
    """Each shard's copies must hold identical state: vote copy set by copy set.

    The copies of a shard are the ranks at one (shard, TP) coordinate in every replica
    (`Layout.copies`); ranks at different TP indices hold different state and never vote
    together.
    A strict majority within a column names the odd rank out (three or more replica groups);
    with two, a disagreement is caught but cannot be attributed (ambiguous, both ranks named).
    """
    findings = []
    for column in layout.copies():
        _, j, t = layout.coordinate(column[0])
        what = f"shard {j} state" + (f" at TP index {t}" if layout.tp > 1 else "")
        finding = judge_vote([fingerprints[r] for r in column], what=what)
        if finding is not None:
            findings.append((finding, column))
    if not findings:
        return None
    verdict = (
        Verdict.SDC if all(f.verdict == Verdict.SDC for f, _ in findings) else Verdict.AMBIGUOUS
    )
    suspects = tuple(sorted({col[i] for f, col in findings for i in f.suspect_ranks}))
    return Finding(
        Check.VOTE,
        verdict,
        suspects,
        "; ".join(f.message.replace("rank(s)", "replica group(s)") for f, _ in findings)
        + f" (global ranks {list(suspects)})",
        {"fingerprints": [f"{fp:016x}" for fp in fingerprints]},
    )
