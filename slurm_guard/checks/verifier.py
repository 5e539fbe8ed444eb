"""The collective side of the checks: replay rounds, the per-step verdict gather, the vote.

Every method here is entered by every rank in the same order. Each round ends in one small
all-gather of fixed-size rows (a few int64 per rank), from which every rank computes the same
verdict with the pure functions of `verdicts.py`.

The Verifier is built from explicit parts (the collective, the topology, the fingerprinter, the
hook's state, a replay function, the config and a ledger writer) and returns what it found: the
Guard decides what to do with the result, so the two modules do not import each other.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from slurm_guard.abft import Abft
from slurm_guard.checks.comm_hook import HookState, param_sketch
from slurm_guard.checks.consistency import (
    conservation_bound,
    judge_vote,
    same_on_every_rank,
    step_passes_fast,
)
from slurm_guard.checks.judging import RowJudge
from slurm_guard.checks.local_replay import ReplayRing, RingReplay, ring_row_fields
from slurm_guard.checks.replay import Captured, exchange
from slurm_guard.checks.rows import (
    LOCAL_L1,
    LOCAL_NONFINITE,
    OWN_LOSS,
    REDUCED_NONFINITE,
    REPLAY_FAILED,
    REPLAY_GRAD,
    REPLAYED,
    TOLERANCE_FLOOR,
    LedgerFn,
    Replayed,
    ReplayFn,
    StepResult,
    bits,
    discrepancy,
    loss_bits,
    reference_vector,
    replay_fields,
    total,
    upload,
    with_complements,
)
from slurm_guard.checks.verdicts import (
    Finding,
    bits_to_float,
    judge_reduced_nonfinite,
)
from slurm_guard.comm.collective import Collective
from slurm_guard.comm.errors import RankFailed
from slurm_guard.comm.topology import Topology
from slurm_guard.config import GuardConfig
from slurm_guard.fingerprint.tree import Fingerprinter, as_int, lanes_to_int
from slurm_guard.protocol import Check

logger = logging.getLogger(__name__)


class Verifier(RowJudge, ReplayRing):
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
        self.local_replays = 0  # replay steps passed by the replayers' own comparisons, likewise
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

    def _replay(self, captured: Captured, cause_key: str) -> Replayed:
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
                return Replayed(0, distance, out.nonfinite)
            fp = self.fingerprinter
            fingerprint = as_int(fp.combine(fp.tensor(t) for t in out.grads))
            return Replayed(loss_bits(out.loss), fingerprint, out.nonfinite)
        except Exception as exc:
            logger.exception("rank %d: the replay raised", self.rank)
            self.comm.post_cause(cause_key, f"{type(exc).__name__}: {exc}")
            return Replayed(failed=True)

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
        local_sketch = total(hook.local_sketches, device)
        local_l1 = total(hook.local_l1, device)
        reduced_parts = [hook.reduced_sketches[i] for i in sorted(hook.reduced_sketches)]
        reduced_sketch = total(reduced_parts, device)
        sketches = (local_sketch, local_l1, reduced_sketch)
        # The row stays on the device until the gather: no host read of any value here.
        flags = torch.stack(
            [
                ~torch.isfinite(local_sketch + local_l1 + loss.detach().double()),
                ~torch.isfinite(reduced_sketch),
            ]
        ).to(torch.int64)
        # from fast_path_world ranks on, two all-reduces judge a passing step; rows attribute
        fast = config.finite_check and self.world_size >= config.fast_path_world
        abft: torch.Tensor | None = None
        if not verify and fast:
            abft = self._abft_summary(device)
            sums, highs, bound = self._fast_round(flags, loss, sketches, abft)
            if step_passes_fast(sums, highs, self.world_size, bound):
                self.fast_steps += 1
                return StepResult(None, False)
        what: str | None = None
        ring: RingReplay | None = None
        key = f"replay/{step}/ring"
        if verify:
            ring = self._ring_replay(step, loss, captured, claim=fast)
            captured = ring.captured
            # the replay (user code) ran since the step's own arrival check
            what = f"step {step}: verdicts"
            if fast:
                abft = self._abft_summary(device)
                if self._passes_locally(step, flags, loss, sketches, abft, ring):
                    return StepResult(None, False, verified=True)
                what = None  # that round checked the arrival; the gather follows at once
        if ring is not None:
            middle_t, tail_t = ring_row_fields(ring, device)
        else:  # the values a step without replay always has, uploaded once
            middle_t, tail_t, _ = self._plain_constants(device)
        if abft is None:
            abft = self._abft_summary(device)
        row = torch.cat(
            [
                flags,
                bits(loss),
                middle_t,
                bits(local_sketch),
                bits(local_l1),
                bits(reduced_sketch),
                tail_t,
                bits(abft[0]),
                abft[1:].to(torch.int64),
            ]
        )
        rows = self.comm.all_gather_rows(row, what)
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
        tolerant = not config.deterministic
        worst = max(bits_to_float(r[REPLAY_GRAD]) for r in rows) if tolerant else 0.0
        self._replay_passed(step, worst)
        return StepResult(None, False, verified=True)

    def _plain_constants(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """What every step without replay sends, on `device`, uploaded on first use only: the
        row's replay fields with nothing replayed, and the summary of no checked GEMM."""
        constants = self._constants.get(device)
        if constants is None:
            middle, tail = replay_fields(0, -1, Replayed(), 0)
            constants = self._constants[device] = (
                upload(middle, torch.int64, device),
                upload(tail, torch.int64, device),
                upload((0.0, -1.0), torch.float64, device),
            )
        return constants

    def _abft_summary(self, device: torch.device) -> torch.Tensor:
        """Checked GEMMs: [largest residual/bound, where] of this rank's step, on the device."""
        if self.abft is not None:
            worst = self.abft.collect()
            if worst is not None:
                return self.abft.summary(worst).to(device)
        return self._plain_constants(device)[2]

    def _fast_round(
        self,
        flags: torch.Tensor,
        loss: torch.Tensor,
        sketches: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        abft: torch.Tensor,
        extra: torch.Tensor | None = None,
    ) -> tuple[list[float], list[int], float]:
        """The fast path's two all-reduces of a few values instead of the gather of every
        rank's row: (sums, maxima, conservation bound) for `verdicts.step_passes_fast`, or with
        a replay step's `extra` maxima for `local_replay.replay_passes`."""
        local_sketch, local_l1, reduced_sketch = sketches
        totals = torch.cat([flags.to(torch.float64), local_sketch.reshape(1), local_l1.reshape(1)])
        ratio = torch.nan_to_num(abft[0:1].to(torch.float64), nan=math.inf).clamp_min(0.0)
        maxima = [with_complements(bits(reduced_sketch)), bits(ratio)]
        if extra is not None:
            maxima.append(extra.to(ratio.device))
        sum_bits, highs, own = self.comm.sum_and_max(totals, torch.cat(maxima), bits(loss))
        sums = [bits_to_float(b) for b in sum_bits]
        self.last_loss_bits = own[0]
        return sums, highs, self._conservation_bound([sums[3]], world=self.world_size)

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

    def vote(self, step: int, fingerprint: torch.Tensor) -> Finding | None:
        """Compare this replica's state fingerprint (its lanes, on the device) with every other
        replica's: the round's one host read is the only one, the fingerprint is not read on its
        own first. From `GuardConfig.fast_path_world` ranks on, one MAX all-reduce of the lanes
        and their complements shows whether all agree; only a disagreement gathers the
        fingerprints, which name the odd ones out."""
        if self.world_size >= self.config.fast_path_world:
            lanes = fingerprint.reshape(-1).to(torch.int64)
            maxima = self.comm.all_max(with_complements(lanes), "vote")
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
