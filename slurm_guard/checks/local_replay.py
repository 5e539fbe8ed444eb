"""A replay step decided where each replay ran: the replayer compares, one MAX all-reduce decides.

Why: the row gather of a replay step costs W-1 ring hops and a Python loop over W rows on every
rank (6 ms at 1,024 ranks, 36-54 ms at 8,192), to learn what only two ranks can know: whether a
replayer's result matches its owner's. So the owner's claim travels with its batch in the replay
exchange, which exists anyway: in exact mode its loss bits and gradient fingerprint
(`Captured.claim`), in tolerance mode its reference loss and sketches (`Captured.reference`,
already there). The replayer compares them itself. What every rank must still agree on is
whether any replay raised or disagrees, and the largest tolerance-mode distance (for the ledger
and the calibration): a MAX all-reduce of a few int64, O(log W). They ride in the per-step fast
path's MAX (`Collective.sum_and_max`), with the averaged gradients' fingerprint and its
complement (every rank must hold the same averaged gradients), so a passing replay step makes
the plain step's two all-reduces and builds nothing of size W: the ring pairs this rank needs
come from the topology's inverse, not from a list of every rank.

Anything amiss (a flag, a non-finite value, a checked GEMM over its bound, the all-reduce's
conservation, averaged gradients that differ) sends the step to the row gather, which attributes
it exactly as a step below `GuardConfig.fast_path_world` is attributed: the same rows, the same
judging, a third rank to settle a single failed comparison.

`ReplayRing` is a base class of the Verifier, as `judging.RowJudge` is: the replay half of
`Verifier.check_step`, kept apart from the rounds of the plain step.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from slurm_guard.checks.comm_hook import HookState
from slurm_guard.checks.consistency import same_on_every_rank, step_passes_fast
from slurm_guard.checks.replay import Captured, exchange
from slurm_guard.checks.rows import LedgerFn, Replayed, bits, reference_vector, upload
from slurm_guard.checks.verdicts import bits_to_float
from slurm_guard.comm.collective import Collective
from slurm_guard.comm.topology import Topology
from slurm_guard.config import GuardConfig
from slurm_guard.fingerprint.tree import Fingerprinter, as_word
from slurm_guard.protocol import Check

logger = logging.getLogger(__name__)

# The MAX all-reduce of a replay step: the plain step's three words (`step_passes_fast`), then
REDUCED_GRAD_MAX, REDUCED_GRAD_COMPLEMENT, ANY_FAILED, ANY_DISAGREES, LARGEST_DISTANCE = range(3, 8)
MAXIMA = 8


@dataclass(frozen=True)
class RingReplay:
    """This rank's part of a verification step's ring replay, before any verdict round.

    Attributes:
        owner: whose microbatch this rank replayed.
        replayed: what the replay computed here (or that it raised).
        own_grad: this rank's local gradient fingerprint (int64 [1] on the device; 0 in
            tolerance mode).
        reduced_grad: the averaged gradients' fingerprint (int64 [1] on the device).
        captured: this rank's own capture, with what it sent along (claim or reference): what
            a settling third rank or the triage replays.
        received: the owner's capture as it arrived here.
    """

    owner: int
    replayed: Replayed
    own_grad: torch.Tensor
    reduced_grad: torch.Tensor
    captured: Captured
    received: Captured


def compare_with_owner(
    received: Captured, replayed: Replayed, tolerance: float
) -> tuple[bool, float]:
    """The replayer's own verdict on its owner's step: (disagrees, distance).

    Exact mode compares loss bits and gradient fingerprint with the owner's claim; tolerance
    mode reads the distance the replay measured from the owner's reference. A replay that
    raised, or an owner's step that arrived without its claim, disagrees: the row gather then
    decides (fail closed).
    """
    if replayed.failed:
        return True, 0.0
    if received.reference is not None:
        distance = bits_to_float(replayed.grad)
        return not distance <= tolerance, distance
    if received.claim is None:
        return True, 0.0
    loss, grad = (int(v) for v in received.claim.tolist())
    return (loss, grad) != (replayed.loss, replayed.grad), 0.0


def float_bits(value: float) -> int:
    """A float64's bit pattern as an int64 (`verdicts.bits_to_float` undoes it); for a value
    >= 0 the int order is the float order, so a MAX all-reduce of the bits is the largest."""
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


def replay_passes(totals: Sequence[float], maxima: Sequence[int], world: int, bound: float) -> bool:
    """A replay step from the fast path's two all-reduces: True only where the row gather
    would find nothing, so any False (a flag, a difference, an unexpected shape) sends the step
    to the gather, which attributes it. `maxima`: the plain step's three words, the averaged
    gradients' fingerprint and its complement, [a replay raised, a replay disagrees, the
    largest distance's bits] (the distance is the ledger's: each replayer already compared it
    with the tolerance)."""
    if len(maxima) != MAXIMA or not step_passes_fast(totals, maxima[:3], world, bound):
        return False
    if not same_on_every_rank(maxima[REDUCED_GRAD_MAX:ANY_FAILED], 1):
        return False
    return maxima[ANY_FAILED] == 0 and maxima[ANY_DISAGREES] == 0


class ReplayRing:
    """The ring replay of `Verifier.check_step` and its local decision (a base of Verifier)."""

    comm: Collective
    topology: Topology
    fingerprinter: Fingerprinter
    hook: HookState
    config: GuardConfig
    ledger: LedgerFn
    params: list[torch.nn.Parameter]
    calibration: list[float]
    local_replays: int

    def _replay(self, captured: Captured, cause_key: str) -> Replayed:
        raise NotImplementedError

    def tolerance(self) -> float:
        raise NotImplementedError

    def _fast_round(
        self,
        flags: torch.Tensor,
        loss: torch.Tensor,
        sketches: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        abft: torch.Tensor,
        extra: torch.Tensor | None = None,
    ) -> tuple[list[float], list[int], float]:
        raise NotImplementedError

    def _ring_replay(
        self, step: int, loss: torch.Tensor, captured: Captured, claim: bool
    ) -> RingReplay:
        """Send my step to my replayer with what it needs to judge it, replay my owner's.

        `claim`: attach the owner's loss bits and gradient fingerprint (exact mode, for the
        local decision); tolerance mode always sends the reference vector.
        """
        hook, fp, device = self.hook, self.fingerprinter, loss.device
        rank = self.comm.rank
        owner = self.topology.owner_of(rank)
        own_grad = torch.zeros(1, dtype=torch.int64, device=device)
        if self.config.deterministic:
            local = [hook.local_fingerprints.get(i) for i in range(len(self.params))]
            own_grad = as_word(
                fp.combine(
                    f if f is not None else fp.tensor(torch.zeros_like(p))
                    for f, p in zip(local, self.params, strict=True)
                )
            ).to(device)
            if claim:
                owner_claim = torch.cat([bits(loss), own_grad])
                captured = dataclasses.replace(captured, claim=owner_claim)
        else:
            sketches = [
                hook.local_fingerprints.get(i, torch.zeros(2, dtype=torch.float64, device=device))
                for i in range(len(self.params))
            ]
            captured = dataclasses.replace(captured, reference=reference_vector(loss, sketches))
        received = exchange(self.topology.ring_pairs(rank), captured, rank, self.comm)
        reduced_grad = as_word(
            fp.combine(
                fp.tensor(p.grad if p.grad is not None else torch.zeros_like(p))
                for p in self.params
            )
        ).to(device)
        replayed = self._replay(received[owner], f"replay/{step}/ring")
        return RingReplay(owner, replayed, own_grad, reduced_grad, captured, received[owner])

    def _passes_locally(
        self,
        step: int,
        flags: torch.Tensor,
        loss: torch.Tensor,
        sketches: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        abft: torch.Tensor,
        ring: RingReplay,
    ) -> bool:
        """The replay step's verdict from the fast path's round, with this replayer's own
        comparison in its MAX; False: gather the rows and judge them."""
        disagrees, distance = compare_with_owner(ring.received, ring.replayed, self.tolerance())
        flags_and_distance = [int(ring.replayed.failed), int(disagrees), float_bits(distance)]
        extra = torch.cat(
            [
                ring.reduced_grad,
                torch.bitwise_not(ring.reduced_grad),
                upload(flags_and_distance, torch.int64, loss.device),
            ]
        )
        # the replay (user code) ran since the step armed the hang watch: re-arm (no store
        # request: a passing replay step makes none)
        self.comm.arm(f"step {step}: verdicts")
        sums, highs, bound = self._fast_round(flags, loss, sketches, abft, extra)
        if not replay_passes(sums, highs, self.comm.world_size, bound):
            return False
        self.local_replays += 1
        self._replay_passed(step, bits_to_float(highs[LARGEST_DISTANCE]))
        return True

    def _replay_passed(self, step: int, worst: float) -> None:
        """Record a passing replay step; `worst`: the largest distance (tolerance mode), which
        the first `calibration_replays` steps calibrate the tolerance from."""
        config = self.config
        detail: dict[str, object] = {"comparisons": self.comm.world_size}
        if not config.deterministic:
            detail.update(max_discrepancy=worst, tolerance=self.tolerance())
            if len(self.calibration) < config.calibration_replays:
                self.calibration.append(worst)
        self.ledger(step, Check.REPLAY, True, detail)


def ring_row_fields(ring: RingReplay, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The row's replay fields on `device`: [OWN_GRAD .. REPLAY_NONFINITE] and [REDUCED_GRAD,
    REPLAY_FAILED] (`rows.replay_fields`, with the fingerprints still on the device)."""
    r = ring.replayed
    middle = upload([ring.owner, r.loss, r.grad, int(r.nonfinite)], torch.int64, device)
    failed = upload([int(r.failed)], torch.int64, device)
    return torch.cat([ring.own_grad, middle]), torch.cat([ring.reduced_grad, failed])
