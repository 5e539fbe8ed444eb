"""The collective side of the checks: replay rounds, the per-step verdict gather, the vote.

Every method here is entered by every rank in the same order. Each round ends in one small
all-gather of fixed-size rows (a few int64 per rank), from which every rank computes the same
verdict with the pure functions of `verdicts.py`.

The Verifier is built from explicit parts (the collective, the topology, the fingerprinter, the
hook's state, a replay function, the config and a ledger writer) and returns what it found: the
Guard decides what to do with the result, so the two modules do not import each other.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from slurm_guard.abft import Abft
from slurm_guard.collective import Collective, RankFailed
from slurm_guard.config import GuardConfig
from slurm_guard.fingerprint import Fingerprinter, as_int, lanes_to_int
from slurm_guard.hooks import HookState, param_sketch
from slurm_guard.protocol import Check, Verdict
from slurm_guard.replay import Captured, ReplayOutput, exchange
from slurm_guard.topology import Topology
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
    same_on_every_rank,
    settle_with_third,
    step_passes_fast,
)

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
    REPLAY_FAILED,
    ABFT_RATIO,
    ABFT_WHERE,
) = range(15)
ROW = 15

ReplayFn = Callable[[Captured], ReplayOutput]
"""Recompute a captured step on this rank (the Guard binds module, loss_fn, scaler, faults)."""

LedgerFn = Callable[[int, Check, bool, dict[str, object]], None]
"""Record one verification result (the Guard writes on rank 0 only)."""


def loss_bits(loss: torch.Tensor) -> int:
    """The exact bit pattern of a scalar, widened to float64 (exact for every float type)."""
    return int(_bits(loss).item())


def _bits(x: torch.Tensor) -> torch.Tensor:
    """A scalar's float64 bit pattern as a one-element int64 tensor, on the scalar's device."""
    return x.detach().double().reshape(1).view(torch.int64)


TOLERANCE_FLOOR = 4 * torch.finfo(torch.float32).eps


def reference_vector(loss: torch.Tensor, sketches: Sequence[torch.Tensor]) -> torch.Tensor:
    """Tolerance mode: [loss, (sketch, norm) per parameter] in float64 on the CPU, joined on
    the loss's device first: one device-to-host copy, not one per parameter."""
    device = loss.device
    parts = [loss.detach().double().reshape(1)] + [s.to(device) for s in sketches]
    return torch.cat(parts).cpu()


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


def _upload(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host numbers as a tensor on `device` without waiting for the device: a blocking
    host-to-device copy synchronises the stream (on CUDA it would wait for the whole backward
    before the verdict round could even be launched)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _replay_fields(
    own_grad: int, owner: int, replayed: _Replayed, reduced_grad: int
) -> tuple[list[int], list[int]]:
    """The row's replay fields: [OWN_GRAD .. REPLAY_NONFINITE] and [REDUCED_GRAD, REPLAY_FAILED]."""
    middle = [own_grad, owner, replayed.loss, replayed.grad, int(replayed.nonfinite)]
    return middle, [reduced_grad, int(replayed.failed)]


def _with_complements(values: torch.Tensor) -> torch.Tensor:
    """int64 values followed by their bitwise complements: what `same_on_every_rank` reads after
    a MAX all-reduce."""
    return torch.cat([values, torch.bitwise_not(values)])


def _total(values: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum per-bucket float64 scalars in a fixed order (bitwise equal on every rank)."""
    if not values:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(values).sum()


@dataclass(frozen=True)
class StepResult:
    """What the checks of one step decided.

    Attributes:
        finding: the failed check, or None.
        skip_update: the optimizer step must not run (a finding, or a skipped numerical step).
        verified: a ring replay of this step passed on every rank; the step is now the newest
            verified one.
    """

    finding: Finding | None
    skip_update: bool
    verified: bool = False


@dataclass(frozen=True)
class _Replayed:
    loss: int = 0
    grad: int = 0
    nonfinite: bool = False
    failed: bool = False


class Verifier:
    """Runs the collective checks of a guarded DDP job.

    Args:
        comm: the guard's collectives (every round of the checks goes through it).
        topology: who replays whom.
        fingerprinter: the run's fingerprints (exact mode) and combination of them.
        hook: the comm hook's per-step values (sketches, L1 norms, local fingerprints).
        replay: recomputes a captured step on this rank.
        config: what to check.
        ledger: records each verification result.
        params: the guarded parameters, in the hook's order.
        scaler_active: a GradScaler steps the optimizer (its overflows are expected).
        abft: the model's checked GEMMs (GuardConfig(abft=True)), or None.
    """

    def __init__(
        self,
        *,
        comm: Collective,
        topology: Topology,
        fingerprinter: Fingerprinter,
        hook: HookState,
        replay: ReplayFn,
        config: GuardConfig,
        ledger: LedgerFn,
        params: Sequence[torch.nn.Parameter],
        scaler_active: bool = False,
        abft: Abft | None = None,
    ) -> None:
        self.comm = comm
        self.topology = topology
        self.fingerprinter = fingerprinter
        self.hook = hook
        self.replay_fn = replay
        self.config = config
        self.ledger = ledger
        self.params = list(params)
        self.scaler_active = scaler_active
        self.abft = abft
        self.calibration: list[float] = []  # worst discrepancy of each calibration step
        self.last_loss_bits = 0  # float64 bits of the last checked step's loss (OWN_LOSS)
        self.fast_steps = 0  # steps passed by the fast path, without the row gather
        self.fast_votes = 0  # votes passed by one all-reduce, without the fingerprint gather
        # values every plain step sends (the row fields of no replay, the summary of no checked
        # GEMM), on the device: uploaded once, so that a plain step uploads nothing
        self._constants: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def _replay(self, captured: Captured, cause_key: str) -> _Replayed:
        """Recompute someone's microbatch here.

        The gradient value is the exact fingerprint, or in tolerance mode the bit pattern of the
        relative discrepancy from the owner's reference (and the loss slot is unused). An
        exception (the user's loss_fn, out of memory) is not raised here: it becomes the row's
        REPLAY_FAILED slot, so that the other ranks learn it in the same gather instead of
        waiting for this rank in it.
        """
        try:
            out = self.replay_fn(captured)
            if captured.reference is not None:
                signs = self.hook.signs
                mine = reference_vector(out.loss, [param_sketch(signs, t) for t in out.grads])
                distance = loss_bits(discrepancy(captured.reference, mine))
                return _Replayed(0, distance, out.nonfinite)
            fp = self.fingerprinter
            fingerprint = as_int(fp.combine(fp.tensor(t) for t in out.grads))
            return _Replayed(loss_bits(out.loss), fingerprint, out.nonfinite)
        except Exception as exc:
            logger.exception("rank %d: the replay raised", self.rank)
            self.comm.post_cause(cause_key, f"{type(exc).__name__}: {exc}")
            return _Replayed(failed=True)

    def _raise_if_replay_failed(
        self, step: int, failed: list[tuple[int, int]], cause_key: str
    ) -> None:
        """[(replayer, owner)] whose replay raised: every rank raises the same RankFailed."""
        if not failed:
            return
        replayer, owner = failed[0]
        node, cause = self.comm.read_cause(cause_key, replayer)
        raise RankFailed(
            f"step {step}: the replay of rank {owner}'s microbatch",
            [r for r, _ in failed],
            node,
            cause,
        )

    def tolerance(self) -> float:
        """The calibrated bound on a clean replay's relative discrepancy (tolerance mode)."""
        config = self.config
        if len(self.calibration) < config.calibration_replays:
            return config.initial_tolerance
        return max(config.tolerance_margin * max(self.calibration), TOLERANCE_FLOOR)

    def replay_round(
        self, step: int, pairs: Sequence[tuple[int, int]], mine: Captured, purpose: str
    ) -> dict[int, tuple[int, int, bool]]:
        """An extra round (NaN triage, third-rank settling): {owner: replayer's result}."""
        received = exchange(pairs, mine, self.rank, self.comm)
        key = f"replay/{step}/{purpose}"
        row = [-1, 0, 0, 0, 0]
        for owner, replayer in pairs:
            if replayer == self.rank:
                r = self._replay(received[owner], key)
                row = [owner, r.loss, r.grad, int(r.nonfinite), int(r.failed)]
        rows = self.comm.all_gather_rows(row, f"step {step}: {purpose} replays")
        self._raise_if_replay_failed(step, [(rk, r[0]) for rk, r in enumerate(rows) if r[4]], key)
        return {r[0]: (r[1], r[2], bool(r[3])) for r in rows if r[0] >= 0}

    def check_step(
        self, step: int, loss: torch.Tensor, captured: Captured, verify: bool
    ) -> StepResult:
        """All checks of one step, after backward and before the update.

        A numerical finding with on_numerical="skip" comes back as no finding with
        skip_update=True: the update is skipped and training goes on.
        """
        hook, config = self.hook, self.config
        device = loss.device
        local_sketch = _total(hook.local_sketches, device)
        local_l1 = _total(hook.local_l1, device)
        reduced_parts = [hook.reduced_sketches[i] for i in sorted(hook.reduced_sketches)]
        reduced_sketch = _total(reduced_parts, device)
        # The row stays on the device until the gather: no host read of any value here.
        flags = torch.stack(
            [
                ~torch.isfinite(local_sketch + local_l1 + loss.detach().double()),
                ~torch.isfinite(reduced_sketch),
            ]
        ).to(torch.int64)
        abft: torch.Tensor | None = None
        if not verify and config.finite_check and self.world_size >= config.fast_path_world:
            abft = self._abft_summary(device)
            if self._fast_step_passes(flags, loss, local_sketch, local_l1, reduced_sketch, abft):
                self.fast_steps += 1
                return StepResult(None, False)
        own_grad, reduced_grad = 0, 0
        replayed = _Replayed()
        owner = -1
        key = f"replay/{step}/ring"
        if verify:
            owner = self.topology.owner_of(self.rank)
            pairs = [(o, self.topology.replayer[o]) for o in range(self.world_size)]
            fp = self.fingerprinter
            if config.deterministic:
                local = [hook.local_fingerprints.get(i) for i in range(len(self.params))]
                own_grad = as_int(
                    fp.combine(
                        f if f is not None else fp.tensor(torch.zeros_like(p))
                        for f, p in zip(local, self.params, strict=True)
                    )
                )
            else:
                captured = dataclasses.replace(
                    captured,
                    reference=reference_vector(
                        loss,
                        [
                            hook.local_fingerprints.get(
                                i, torch.zeros(2, dtype=torch.float64, device=device)
                            )
                            for i in range(len(self.params))
                        ],
                    ),
                )
            received = exchange(pairs, captured, self.rank, self.comm)
            reduced_grad = as_int(
                fp.combine(
                    fp.tensor(p.grad if p.grad is not None else torch.zeros_like(p))
                    for p in self.params
                )
            )
            replayed = self._replay(received[owner], key)
        if verify:
            middle, tail = _replay_fields(own_grad, owner, replayed, reduced_grad)
            middle_t, tail_t = (
                _upload(middle, torch.int64, device),
                _upload(tail, torch.int64, device),
            )
        else:  # the values a step without replay always has, uploaded once
            middle_t, tail_t, _ = self._plain_constants(device)
        if abft is None:
            abft = self._abft_summary(device)
        row = torch.cat(
            [
                flags,
                _bits(loss),
                middle_t,
                _bits(local_sketch),
                _bits(local_l1),
                _bits(reduced_sketch),
                tail_t,
                _bits(abft[0]),
                abft[1:].to(torch.int64),
            ]
        )
        # On a verification step the replay (user code) ran since the step's own arrival check.
        rows = self.comm.all_gather_rows(row, f"step {step}: verdicts" if verify else None)
        # the step's loss, from the same read (the Guard returns it without a host sync of its own)
        self.last_loss_bits = rows[self.rank][OWN_LOSS]
        if verify:
            failed = [(r, rows[r][REPLAYED]) for r in range(self.world_size)]
            failed = [(r, o) for r, o in failed if rows[r][REPLAY_FAILED]]
            self._raise_if_replay_failed(step, failed, key)

        if config.finite_check and any(r[LOCAL_NONFINITE] for r in rows):
            return self._triage_nonfinite(step, rows, captured, verify)
        if config.finite_check:
            l1_total = sum(bits_to_float(r[LOCAL_L1]) for r in rows)
            reduced = judge_reduced_nonfinite(
                [bool(r[REDUCED_NONFINITE]) for r in rows],
                overflow_possible=l1_total >= torch.finfo(self.params[0].dtype).max,
            )
            if reduced is not None:
                self.ledger(step, Check.FINITE_REDUCED, False, {"verdict": reduced.verdict})
                return self._numerical_outcome(step, reduced)
        if self.abft is not None:
            gemm = self._judge_abft(step, rows, captured)
            if gemm is not None:
                return StepResult(gemm, True)
        if config.finite_check:
            reduction = self._judge_reduction(rows, verify)
            if reduction is not None:
                return StepResult(reduction, True)
        if not verify:
            return StepResult(None, False)
        # `captured` carries the owner's reference in tolerance mode: a settling third rank
        # measures its distance from it, as the ring replayer did
        finding = self._judge_replays(step, rows, captured)
        if finding is not None:
            return StepResult(finding, True)
        detail: dict[str, object] = {"comparisons": self.world_size}
        if not config.deterministic:
            worst = max(bits_to_float(r[REPLAY_GRAD]) for r in rows)
            detail.update(max_discrepancy=worst, tolerance=self.tolerance())
            if len(self.calibration) < config.calibration_replays:
                self.calibration.append(worst)
        self.ledger(step, Check.REPLAY, True, detail)
        return StepResult(None, False, verified=True)

    def _plain_constants(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """What every step without replay sends, on `device`, uploaded on first use only: the
        row's replay fields with nothing replayed, and the summary of no checked GEMM."""
        constants = self._constants.get(device)
        if constants is None:
            middle, tail = _replay_fields(0, -1, _Replayed(), 0)
            constants = self._constants[device] = (
                _upload(middle, torch.int64, device),
                _upload(tail, torch.int64, device),
                _upload((0.0, -1.0), torch.float64, device),
            )
        return constants

    def _abft_summary(self, device: torch.device) -> torch.Tensor:
        """Checked GEMMs: [largest residual/bound, where] of this rank's step, on the device."""
        if self.abft is not None:
            worst = self.abft.collect()
            if worst is not None:
                return self.abft.summary(worst).to(device)
        return self._plain_constants(device)[2]

    def _fast_step_passes(
        self,
        flags: torch.Tensor,
        loss: torch.Tensor,
        local_sketch: torch.Tensor,
        local_l1: torch.Tensor,
        reduced_sketch: torch.Tensor,
        abft: torch.Tensor,
    ) -> bool:
        """A step without replay, judged from two all-reduces of a few values instead of the
        gather of every rank's row (`verdicts.step_passes_fast`); False: gather and judge."""
        totals = torch.cat([flags.to(torch.float64), local_sketch.reshape(1), local_l1.reshape(1)])
        ratio = torch.nan_to_num(abft[0:1].to(torch.float64), nan=math.inf).clamp_min(0.0)
        maxima = torch.cat([_with_complements(_bits(reduced_sketch)), _bits(ratio)])
        sum_bits, highs, own = self.comm.sum_and_max(totals, maxima, _bits(loss))
        sums = [bits_to_float(b) for b in sum_bits]
        self.last_loss_bits = own[0]
        bound = self._conservation_bound([sums[3]], world=self.world_size)
        return step_passes_fast(sums, highs, self.world_size, bound)

    def _conservation_bound(self, l1: list[float], world: int | None = None) -> float:
        """`verdicts.conservation_bound` for this step's buckets and gradient dtype."""
        finfo = torch.finfo(self.params[0].dtype)
        return conservation_bound(
            l1,
            finfo.eps / 2,
            self.hook.largest_bucket,
            buckets=self.hook.buckets,
            elements=self.hook.elements,
            underflow=finfo.smallest_normal * finfo.eps / 2,
            world=world,
        )

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

    def vote(self, step: int, fingerprint: torch.Tensor) -> Finding | None:
        """Compare this replica's state fingerprint (its lanes, on the device) with every other
        replica's: the round's one host read is the only one, the fingerprint is not read on its
        own first. From `GuardConfig.fast_path_world` ranks on, one MAX all-reduce of the lanes
        and their complements shows whether all agree; only a disagreement gathers the
        fingerprints, which name the odd ones out."""
        if self.world_size >= self.config.fast_path_world:
            lanes = fingerprint.reshape(-1).to(torch.int64)
            maxima = self.comm.all_max(_with_complements(lanes), "vote")
            if same_on_every_rank(maxima, lanes.numel()):
                self.fast_votes += 1
                agreed = lanes_to_int(maxima[: lanes.numel()])
                self.ledger(step, Check.VOTE, True, {"fingerprint": f"{agreed:016x}"})
                return None
        rows = self.comm.all_gather_rows(fingerprint)
        values = [lanes_to_int(r) for r in rows]
        finding = judge_vote(values)
        mine = values[self.rank]
        self.ledger(step, Check.VOTE, finding is None, {"fingerprint": f"{mine:016x}"})
        return finding
