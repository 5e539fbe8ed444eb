"""The collective side of the checks: replay rounds, the per-step verdict gather, the vote.

Every function here is entered by every rank in the same order. Each round ends in one small
all-gather of fixed-size rows (a few int64 per rank), from which every rank computes the same
verdict with the pure functions of `verdicts.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from slurm_guard.fingerprint import as_int
from slurm_guard.hooks import param_sketch
from slurm_guard.records import LedgerEntry, append_ledger
from slurm_guard.replay import Captured, exchange, recompute
from slurm_guard.verdicts import (
    Finding,
    ReplayResult,
    bits_to_float,
    conservation_bound,
    judge_nonfinite,
    judge_reduced_nonfinite,
    judge_reduction,
    judge_replays,
    judge_vote,
    settle_with_third,
)

if TYPE_CHECKING:
    from slurm_guard.guard import Guard

logger = logging.getLogger(__name__)

# Row layout of the per-step gather (float64 values travel as their int64 bit patterns).
(
    LOCAL_NONFINITE,
    REDUCED_NONFINITE,
    OWN_LOSS,
    OWN_GRAD,
    REPLAYED,
    REPLAY_LOSS,
    REPLAY_GRAD,
    REPLAY_NONFINITE,
    LOCAL_SKETCH,
    LOCAL_L1,
    REDUCED_SKETCH,
    REDUCED_GRAD,
) = range(12)
ROW = 12


def loss_bits(loss: torch.Tensor) -> int:
    """The exact bit pattern of a scalar, widened to float64 (exact for every float type)."""
    return int(loss.detach().double().reshape(1).view(torch.int64).item())


TOLERANCE_FLOOR = 4 * torch.finfo(torch.float32).eps


def reference_vector(loss: torch.Tensor, sketches: Sequence[torch.Tensor]) -> torch.Tensor:
    """Tolerance mode: [loss, (sketch, norm) per parameter] in float64 on the CPU."""
    parts = [loss.detach().double().reshape(1).cpu()] + [s.cpu() for s in sketches]
    return torch.cat(parts)


def discrepancy(reference: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
    """Relative distance of a replay from the owner: the worst of the loss and every parameter.

    A sketch difference <e, r> has the size of ||e||_2 for random signs r, so dividing by the
    owner's gradient norm gives a relative error that does not depend on the layer's scale.
    """
    tiny = 1e-30
    loss_error = (mine[0] - reference[0]).abs() / reference[0].abs().clamp_min(tiny)
    ref_pairs, my_pairs = reference[1:].view(-1, 2), mine[1:].view(-1, 2)
    grad_error = (my_pairs[:, 0] - ref_pairs[:, 0]).abs() / ref_pairs[:, 1].clamp_min(tiny)
    worst = torch.cat([loss_error.reshape(1), grad_error]).max()
    return torch.nan_to_num(worst, nan=float("inf"))


def _total(values: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum per-bucket float64 scalars in a fixed order (bitwise equal on every rank)."""
    if not values:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(values).sum()


class Verifier:
    """Runs the checks for one Guard; holds no state of its own beyond a reference to it."""

    def __init__(self, guard: Guard) -> None:
        self.g = guard
        self.calibration: list[float] = []  # worst discrepancy of each calibration step

    def _gather(self, row: list[int]) -> list[list[int]]:
        g = self.g
        mine = torch.tensor(row, dtype=torch.int64, device=g.comm_device)
        out = [torch.empty_like(mine) for _ in range(g.world_size)]
        dist.all_gather(out, mine, group=g.group)
        return [[int(v) for v in t.tolist()] for t in out]

    def _ledger(self, step: int, check: str, passed: bool, detail: dict[str, object]) -> None:
        if self.g.rank == 0:
            try:
                append_ledger(
                    self.g.run_dir.ledger,
                    LedgerEntry(step, check, passed, detail, self.g.restart_count),
                )
            except OSError:
                logger.exception("could not append to the ledger")

    def _replay(self, owner_capture: Captured) -> tuple[int, int, bool]:
        """Recompute someone's microbatch here: (loss bits, gradient value, non-finite).

        The gradient value is the exact fingerprint, or in tolerance mode the bit pattern of the
        relative discrepancy from the owner's reference (and the loss slot is unused).
        """
        g = self.g
        with g.injector.replay():
            scale = g.scaler.scale if g.scaler is not None else None
            out = recompute(g.module, g.loss_fn, owner_capture, g.params, scale)
        if owner_capture.reference is not None:
            mine = reference_vector(out.loss, [param_sketch(g.hook.signs, t) for t in out.grads])
            return 0, loss_bits(discrepancy(owner_capture.reference, mine)), out.nonfinite
        fingerprint = as_int(g.fingerprinter.combine(g.fingerprinter.tensor(t) for t in out.grads))
        return loss_bits(out.loss), fingerprint, out.nonfinite

    def tolerance(self) -> float:
        """The calibrated bound on a clean replay's relative discrepancy (tolerance mode)."""
        config = self.g.config
        if len(self.calibration) < config.calibration_replays:
            return config.initial_tolerance
        return max(config.tolerance_margin * max(self.calibration), TOLERANCE_FLOOR)

    def replay_round(
        self, pairs: Sequence[tuple[int, int]], mine: Captured
    ) -> dict[int, tuple[int, int, bool]]:
        """An extra round (NaN triage, third-rank settling): {owner: replayer's result}."""
        g = self.g
        received = exchange(pairs, mine, g.rank, g.group, g.comm_device)
        row = [-1, 0, 0, 0]
        for owner, replayer in pairs:
            if replayer == g.rank:
                loss, grad, nonfinite = self._replay(received[owner])
                row = [owner, loss, grad, int(nonfinite)]
        results = {}
        for r in self._gather(row):
            if r[0] >= 0:
                results[r[0]] = (r[1], r[2], bool(r[3]))
        return results

    def check_step(
        self, step: int, loss: torch.Tensor, captured: Captured, verify: bool
    ) -> tuple[Finding | None, bool]:
        """All checks of one step, after backward and before the update.

        Returns (finding, skip_update). A numerical finding with on_numerical="skip" comes back
        as (None, True): the update is skipped and training goes on.
        """
        g = self.g
        hook = g.hook
        device = loss.device
        local_sketch = _total(hook.local_sketches, device)
        local_l1 = _total(hook.local_l1, device)
        reduced_parts = [hook.reduced_sketches[i] for i in sorted(hook.reduced_sketches)]
        reduced_sketch = _total(reduced_parts, device)
        local_bad = not bool(torch.isfinite(local_sketch + local_l1 + loss.double()).item())
        reduced_bad = not bool(torch.isfinite(reduced_sketch).item())

        row = [0] * ROW
        row[LOCAL_NONFINITE] = int(local_bad)
        row[REDUCED_NONFINITE] = int(reduced_bad)
        row[OWN_LOSS] = loss_bits(loss)
        row[REPLAYED] = -1
        row[LOCAL_SKETCH] = loss_bits(local_sketch)
        row[LOCAL_L1] = loss_bits(local_l1)
        row[REDUCED_SKETCH] = loss_bits(reduced_sketch)
        if verify:
            owner = g.topology.owner_of(g.rank)
            pairs = [(o, g.topology.replayer[o]) for o in range(g.world_size)]
            fp = g.fingerprinter
            if g.config.deterministic:
                local = [hook.local_fingerprints.get(i) for i in range(len(g.params))]
                row[OWN_GRAD] = as_int(
                    fp.combine(
                        f if f is not None else fp.tensor(torch.zeros_like(p))
                        for f, p in zip(local, g.params, strict=True)
                    )
                )
            else:
                captured.reference = reference_vector(
                    loss,
                    [
                        hook.local_fingerprints.get(i, torch.zeros(2, dtype=torch.float64))
                        for i in range(len(g.params))
                    ],
                )
            received = exchange(pairs, captured, g.rank, g.group, g.comm_device)
            row[REDUCED_GRAD] = as_int(
                fp.combine(
                    fp.tensor(p.grad if p.grad is not None else torch.zeros_like(p))
                    for p in g.params
                )
            )
            replay_loss, replay_grad, replay_bad = self._replay(received[owner])
            row[REPLAYED] = owner
            row[REPLAY_LOSS] = replay_loss
            row[REPLAY_GRAD] = replay_grad
            row[REPLAY_NONFINITE] = int(replay_bad)
        rows = self._gather(row)

        if g.config.finite_check and any(r[LOCAL_NONFINITE] for r in rows):
            return self._triage_nonfinite(step, rows, captured, verify)
        if g.config.finite_check:
            l1_total = sum(bits_to_float(r[LOCAL_L1]) for r in rows)
            reduced = judge_reduced_nonfinite(
                [bool(r[REDUCED_NONFINITE]) for r in rows],
                overflow_possible=l1_total >= torch.finfo(g.params[0].dtype).max,
            )
            if reduced is not None:
                self._ledger(step, "finite_reduced", False, {"verdict": reduced.verdict})
                return self._numerical_outcome(step, reduced)
            reduction = self._judge_reduction(rows, verify)
            if reduction is not None:
                return reduction, True
        if not verify:
            return None, False
        finding = self._judge_replays(rows, captured)
        if finding is None:
            g.last_verified_step = step
            g.verified_steps.append(step)
            detail: dict[str, object] = {"comparisons": g.world_size}
            if not g.config.deterministic:
                worst = max(bits_to_float(r[REPLAY_GRAD]) for r in rows)
                detail.update(max_discrepancy=worst, tolerance=self.tolerance())
                if len(self.calibration) < g.config.calibration_replays:
                    self.calibration.append(worst)
            self._ledger(step, "replay", True, detail)
        return finding, finding is not None

    def _judge_reduction(self, rows: list[list[int]], verify: bool) -> Finding | None:
        g = self.g
        l1 = [bits_to_float(r[LOCAL_L1]) for r in rows]
        unit_roundoff = torch.finfo(g.params[0].dtype).eps / 2
        return judge_reduction(
            [bits_to_float(r[LOCAL_SKETCH]) for r in rows],
            l1,
            [r[REDUCED_SKETCH] for r in rows],
            conservation_bound(l1, unit_roundoff, g.hook.largest_bucket),
            [r[REDUCED_GRAD] for r in rows] if verify else None,
        )

    def _triage_nonfinite(
        self, step: int, rows: list[list[int]], captured: Captured, verify: bool
    ) -> tuple[Finding | None, bool]:
        """Replay each rank that saw NaN/Inf on another node: reproduced means numerical."""
        g = self.g
        flagged = [rank for rank, r in enumerate(rows) if r[LOCAL_NONFINITE]]
        if verify:  # the ring replay already recomputed every microbatch
            reproduced = {o: bool(rows[g.topology.replayer[o]][REPLAY_NONFINITE]) for o in flagged}
        else:
            extra = self.replay_round([(o, g.topology.replayer[o]) for o in flagged], captured)
            reproduced = {o: extra[o][2] for o in flagged}
        finding = judge_nonfinite(flagged, reproduced, "finite_local")
        self._ledger(step, "finite_local", False, {"verdict": finding.verdict})
        return self._numerical_outcome(step, finding)

    def _numerical_outcome(self, step: int, finding: Finding) -> tuple[Finding | None, bool]:
        """A numerical (not hardware) finding under a GradScaler or on_numerical='skip'."""
        g = self.g
        if finding.verdict == "numerical" and g.scaler is not None:
            # a GradScaler overflow: expected; the scaler skips the update and lowers its scale
            logger.info("step %d: gradient overflow under the GradScaler, update skipped", step)
            return None, False
        if finding.verdict == "numerical" and g.config.on_numerical == "skip":
            logger.warning("step %d skipped: %s", step, finding.message)
            return None, True
        return finding, True

    def _judge_replays(self, rows: list[list[int]], captured: Captured) -> Finding | None:
        g = self.g
        tolerant = not g.config.deterministic
        tolerance = self.tolerance() if tolerant else 0.0
        results = [
            ReplayResult(
                owner=o,
                replayer=g.topology.replayer[o],
                owner_loss=rows[o][OWN_LOSS],
                owner_grad=rows[o][OWN_GRAD],
                replay_loss=rows[g.topology.replayer[o]][REPLAY_LOSS],
                replay_grad=rows[g.topology.replayer[o]][REPLAY_GRAD],
                discrepancy=(
                    bits_to_float(rows[g.topology.replayer[o]][REPLAY_GRAD]) if tolerant else None
                ),
                tolerance=tolerance,
            )
            for o in range(g.world_size)
        ]
        judgement = judge_replays(results, g.topology)
        if judgement.settle is None:
            return judgement.finding
        disputed = judgement.settle
        third = g.topology.third_rank(disputed.owner, disputed.replayer)
        assert third is not None  # judge_replays asks to settle only when a third rank exists
        extra = self.replay_round([(disputed.owner, third)], captured)
        third_loss, third_grad, _ = extra[disputed.owner]
        third_distance = bits_to_float(third_grad) if tolerant else None
        return settle_with_third(disputed, third, third_loss, third_grad, third_distance)

    def vote(self, step: int) -> Finding | None:
        """Fingerprint this replica's whole state and compare it with every other replica's."""
        g = self.g
        fingerprint = g.vote_fingerprint()
        rows = self._gather([fingerprint])
        finding = judge_vote([r[0] for r in rows])
        self._ledger(step, "vote", finding is None, {"fingerprint": f"{fingerprint:016x}"})
        return finding
