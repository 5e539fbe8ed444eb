"""Judging the gathered rows of a step: which check failed, on which rank, and why.

These are the Verifier's decisions after the gather, kept apart from the rounds that produce the
rows. Where a decision needs more evidence (a NaN to triage, a checked GEMM to confirm, a
disputed replay to settle) it runs one more replay round through the Verifier's collective.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from slurm_guard.abft import Abft
from slurm_guard.checks.consistency import judge_reduction
from slurm_guard.checks.replay import Captured
from slurm_guard.checks.rows import (
    ABFT_RATIO,
    ABFT_WHERE,
    LOCAL_L1,
    LOCAL_NONFINITE,
    LOCAL_SKETCH,
    OWN_GRAD,
    OWN_LOSS,
    REDUCED_GRAD,
    REDUCED_SKETCH,
    REPLAY_GRAD,
    REPLAY_LOSS,
    REPLAY_NONFINITE,
    LedgerFn,
    StepResult,
)
from slurm_guard.checks.verdicts import (
    Finding,
    ReplayResult,
    bits_to_float,
    judge_nonfinite,
    judge_replays,
    settle_with_third,
)
from slurm_guard.comm.topology import Topology
from slurm_guard.config import GuardConfig
from slurm_guard.protocol import Check, Verdict

logger = logging.getLogger(__name__)


class RowJudge:
    """The decisions of `Verifier.check_step` after its gather (a base class of Verifier)."""

    topology: Topology
    config: GuardConfig
    ledger: LedgerFn
    abft: Abft | None
    scaler_active: bool

    @property
    def world_size(self) -> int:
        raise NotImplementedError

    def replay_round(
        self, step: int, pairs: Sequence[tuple[int, int]], mine: Captured, purpose: str
    ) -> dict[int, tuple[int, int, bool]]:
        raise NotImplementedError

    def tolerance(self) -> float:
        raise NotImplementedError

    def _conservation_bound(self, l1: list[float], world: int | None = None) -> float:
        raise NotImplementedError

    def _judge_abft(self, step: int, rows: list[list[int]], captured: Captured) -> Finding | None:
        """A checked GEMM over its rounding bound is a local, attributable fault: this rank.

        Judged after the finite checks, so a non-finite value (a bad sample, an overflow) keeps
        its replay triage. Where another node can replay the failing rank's microbatch it does:
        a different loss there confirms that this rank's forward result was wrong; an equal loss
        means the wrong value was in a backward GEMM (or did not reach the loss), and the
        residual is the evidence. Every rank over its bound is a suspect; all of them failing
        (world > 1) points at the bound or a shared input, not one GPU: ambiguous.
        """
        assert self.abft is not None
        ratios = [bits_to_float(r[ABFT_RATIO]) for r in rows]
        failing = [rank for rank, ratio in enumerate(ratios) if not ratio <= 1.0]
        if not failing:
            return None
        replayer = self.topology.replayer
        pairs = [(o, replayer[o]) for o in failing if replayer[o] != o]
        extra = self.replay_round(step, pairs, captured, "abft confirmation") if pairs else {}
        per_rank: dict[str, object] = {}
        confirmed: list[bool] = []
        for o in failing:
            layer, gemm_pass = self.abft.where(rows[o][ABFT_WHERE])
            detail: dict[str, object] = {"layer": layer, "pass": gemm_pass, "ratio": ratios[o]}
            if o in extra:
                differs = extra[o][0] != rows[o][OWN_LOSS]
                detail.update(replayed_on=replayer[o], replay_loss_differs=differs)
                confirmed.append(differs)
            per_rank[str(o)] = detail
        everyone = len(failing) == self.world_size and self.world_size > 1
        verdict = Verdict.AMBIGUOUS if everyone else Verdict.SDC
        first = per_rank[str(failing[0])]
        assert isinstance(first, dict)
        evidence: dict[str, object] = {
            "ranks": per_rank,
            "layer": first["layer"],
            "pass": first["pass"],
            "replay_confirmed": (all(confirmed) if confirmed else None),
        }
        message = (
            f"checked GEMM over its rounding bound on rank(s) {failing}: "
            f"{first['layer']} {first['pass']}, residual {first['ratio']:.3g} x the bound"
        )
        self.ledger(step, Check.ABFT, False, {"verdict": verdict, **evidence})
        return Finding(Check.ABFT, verdict, tuple(failing), message, evidence)

    def _judge_reduction(self, rows: list[list[int]], verify: bool) -> Finding | None:
        l1 = [bits_to_float(r[LOCAL_L1]) for r in rows]
        bound = self._conservation_bound(l1)
        return judge_reduction(
            [bits_to_float(r[LOCAL_SKETCH]) for r in rows],
            l1,
            [r[REDUCED_SKETCH] for r in rows],
            bound,
            [r[REDUCED_GRAD] for r in rows] if verify else None,
        )

    def _triage_nonfinite(
        self, step: int, rows: list[list[int]], captured: Captured, verify: bool
    ) -> StepResult:
        """Replay each rank that saw NaN/Inf on another rank: reproduced means numerical.

        A rank with no other rank to replay it (world size 1) cannot be judged either way: its
        finding says so instead of blaming the hardware.
        """
        replayer = self.topology.replayer
        flagged = [rank for rank, r in enumerate(rows) if r[LOCAL_NONFINITE]]
        unreplayed = [o for o in flagged if replayer[o] == o]
        replayable = [o for o in flagged if replayer[o] != o]
        if verify:  # the ring replay already recomputed every microbatch
            reproduced = {o: bool(rows[replayer[o]][REPLAY_NONFINITE]) for o in replayable}
        else:
            pairs = [(o, replayer[o]) for o in replayable]
            extra = self.replay_round(step, pairs, captured, "non-finite triage") if pairs else {}
            reproduced = {o: extra[o][2] for o in replayable}
        finding = judge_nonfinite(flagged, reproduced, Check.FINITE_LOCAL, unreplayed)
        self.ledger(step, Check.FINITE_LOCAL, False, {"verdict": finding.verdict})
        return self._numerical_outcome(step, finding)

    def _numerical_outcome(self, step: int, finding: Finding) -> StepResult:
        """A numerical (not hardware) finding under a GradScaler or on_numerical='skip'."""
        if finding.verdict == Verdict.NUMERICAL and self.scaler_active:
            # a GradScaler overflow: expected; the scaler skips the update and lowers its scale
            logger.info("step %d: gradient overflow under the GradScaler, update skipped", step)
            return StepResult(None, False)
        if finding.verdict == Verdict.NUMERICAL and self.config.on_numerical == "skip":
            logger.warning("step %d skipped: %s", step, finding.message)
            return StepResult(None, True)
        return StepResult(finding, True)

    def _judge_replays(
        self, step: int, rows: list[list[int]], captured: Captured
    ) -> Finding | None:
        topology = self.topology
        tolerant = not self.config.deterministic
        tolerance = self.tolerance() if tolerant else 0.0
        results = [
            ReplayResult(
                owner=o,
                replayer=topology.replayer[o],
                owner_loss=rows[o][OWN_LOSS],
                owner_grad=rows[o][OWN_GRAD],
                replay_loss=rows[topology.replayer[o]][REPLAY_LOSS],
                replay_grad=rows[topology.replayer[o]][REPLAY_GRAD],
                discrepancy=(
                    bits_to_float(rows[topology.replayer[o]][REPLAY_GRAD]) if tolerant else None
                ),
                tolerance=tolerance,
            )
            for o in range(self.world_size)
        ]
        judgement = judge_replays(results, topology)
        if judgement.settle is None:
            return judgement.finding
        disputed = judgement.settle
        third = topology.third_rank(disputed.owner, disputed.replayer)
        assert third is not None  # judge_replays asks to settle only when a third rank exists
        extra = self.replay_round(step, [(disputed.owner, third)], captured, "settling")
        third_loss, third_grad, _ = extra[disputed.owner]
        third_distance = bits_to_float(third_grad) if tolerant else None
        return settle_with_third(disputed, third, third_loss, third_grad, third_distance)
