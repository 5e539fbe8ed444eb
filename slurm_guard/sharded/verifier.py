"""The collective rounds of a sharded step: the verdict gather, the replay rounds, the vote.

Every method is entered by every rank in the same order, and every decision is taken from
gathered rows by the pure functions of `sharded.verdict`, so no rank takes a branch another
does not. Built from explicit parts; the ShardedGuard decides what to do with the finding.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from slurm_guard.abft import Abft
from slurm_guard.checks.consistency import conservation_bound
from slurm_guard.checks.replay import Captured, LossFn, exchange
from slurm_guard.checks.rows import LedgerFn, StepResult, bits, upload
from slurm_guard.checks.verdicts import Finding, judge_nonfinite, judge_reduced_nonfinite
from slurm_guard.comm.collective import Collective
from slurm_guard.comm.errors import RankFailed
from slurm_guard.comm.topology import Topology
from slurm_guard.config import GuardConfig
from slurm_guard.core.snapshot_proof import STARTED_FROM
from slurm_guard.faults.injection import FaultInjector
from slurm_guard.fingerprint.tree import as_hex, as_int, lanes_to_int
from slurm_guard.protocol import Check, Verdict
from slurm_guard.sharded import verdict as v
from slurm_guard.sharded.hooks import ReduceScatterState
from slurm_guard.sharded.layout import Layout
from slurm_guard.sharded.replay import ReplayValues, replay_step

logger = logging.getLogger(__name__)


class ShardedVerifier:
    """Runs the checks of a sharded step on every rank (see the module docstring)."""

    def __init__(
        self,
        *,
        comm: Collective,
        topology: Topology,
        layout: Layout,
        model: nn.Module,
        loss_fn: LossFn,
        state: ReduceScatterState,
        injector: FaultInjector,
        config: GuardConfig,
        ledger: LedgerFn,
        abft: Abft | None,
    ) -> None:
        self.comm = comm
        self.topology = topology
        self.layout = layout
        # (first, settling) shifts of the data-parallel index: replays on other nodes
        self.first_shift, self.settling_shift = layout.replay_shifts(topology.node_of)
        self.model = model
        self.loss_fn = loss_fn
        self.state = state
        self.injector = injector
        self.config = config
        self.ledger = ledger
        self.abft = abft
        self.last_loss_bits = 0

    @property
    def rank(self) -> int:
        return self.comm.rank

    def _replay(self, captured: Captured, shift: int, key: str) -> ReplayValues:
        """Send my step to my replayer, receive my owner's, and recompute it with everyone."""
        pairs = self.layout.pairs(shift)
        received = exchange(pairs, captured, self.rank, self.comm)
        owner = next(o for o, r in pairs if r == self.rank)

        def failed(exc: Exception) -> None:
            logger.exception("rank %d: the replay of rank %d's step raised", self.rank, owner)
            self.comm.post_cause(key, f"{type(exc).__name__}: {exc}")

        with self.injector.replay():
            return replay_step(self.model, self.loss_fn, received[owner], owner, self.state, failed)

    def _raise_if_failed(self, step: int, replays: list[list[int]], key: str) -> None:
        failed = [r for r, rep in enumerate(replays) if rep[4]]
        if failed:
            node, cause = self.comm.read_cause(key, failed[0])
            owner = replays[failed[0]][0]
            raise RankFailed(f"step {step}: the replay of rank {owner}'s step", failed, node, cause)

    def round(self, step: int, captured: Captured, shift: int, purpose: str) -> list[list[int]]:
        """An extra replay round (triage, settling): every rank's [owner, loss, grad, nonfinite,
        failed]."""
        key = f"sharded-replay/{step}/{purpose}"
        r = self._replay(captured, shift, key)
        row = [r.owner, r.loss, r.grad, int(r.nonfinite), int(r.failed)]
        replays = self.comm.all_gather_rows(row, f"step {step}: {purpose} replays")
        self._raise_if_failed(step, replays, key)
        return replays

    def check_step(
        self,
        step: int,
        loss: torch.Tensor,
        captured: Captured,
        verify: bool,
        grads: list[torch.Tensor],
        started_from: torch.Tensor | None = None,
    ) -> StepResult:
        """Every check of one step, after backward and before the update.

        `grads` are this rank's reduced gradient shards (after FSDP's reduce-scatter and, under
        HSDP, its all-reduce), checked for NaN/Inf before the update uses them.
        `started_from`: this rank's shard fingerprint as the step began, where a snapshot of
        that state follows a passing replay; rank 0's goes into the replay's ledger entry,
        which is what proves the snapshot's step on a restart (`core.snapshot_proof`).
        """
        device = self.comm.device
        local_nonfinite = self.state.nonfinite(device)
        partial = [g.sum(dtype=torch.float64).reshape(1) for g in grads]
        reduced_sum = torch.cat(partial).sum() if partial else torch.zeros((), dtype=torch.float64)
        reduced_nonfinite = (~torch.isfinite(reduced_sum)).to(torch.int64).reshape(1).to(device)
        abft = self._abft_summary(device)
        conserved = self.state.conservation.summary(device)  # before a replay resets it
        rounding = self.state.conservation.bound_inputs()
        own_grad, replayed = 0, ReplayValues()
        key = f"sharded-replay/{step}/ring"
        if verify and self.first_shift is not None:
            own_grad = as_int(self.state.input_fingerprint())  # before the replay resets it
            replayed = self._replay(captured, self.first_shift, key)
        fields = upload(v.replay_fields(own_grad, replayed), torch.int64, device)
        row = torch.cat(
            [
                local_nonfinite,
                reduced_nonfinite,
                bits(loss).to(device),
                fields,
                bits(abft[0]).to(device),
                abft[1:].to(torch.int64).to(device),
                conserved.view(torch.int64),
            ]
        )
        rows = self.comm.all_gather_rows(row, f"step {step}: verdicts" if verify else None)
        self.last_loss_bits = rows[self.rank][v.OWN_LOSS]
        first = [r[v.REPLAYED : v.REPLAY_FAILED + 1] for r in rows]
        if verify:
            self._raise_if_failed(step, first, key)
        config = self.config
        if config.finite_check and any(r[v.LOCAL_NONFINITE] for r in rows):
            return self._nonfinite(step, rows, first if verify else None, captured)
        if config.finite_check:
            reduced = judge_reduced_nonfinite([bool(r[v.REDUCED_NONFINITE]) for r in rows])
            if reduced is not None:
                self.ledger(step, Check.FINITE_REDUCED, False, {"verdict": reduced.verdict})
                return StepResult(reduced, True)
        if self.abft is not None:
            abft_handle = self.abft
            where = [self._where(abft_handle, r[v.ABFT_WHERE]) for r in rows]
            gemm = v.judge_abft(rows, where)
            if gemm is not None:
                self.ledger(step, Check.ABFT, False, {"suspects": list(gemm.suspect_ranks)})
                return StepResult(gemm, True)
        if config.finite_check:  # as the DDP guard's conservation check, after ABFT's
            u, largest, calls, size = rounding

            def bound(l1: list[float]) -> float:
                return conservation_bound(l1, u, largest, buckets=calls, world=size)

            conservation = v.judge_conservation(rows, self.layout, bound)
            if conservation is not None:
                self.ledger(step, Check.CONSERVATION, False, conservation.evidence)
                return StepResult(conservation, True)
        if not verify:
            return StepResult(None, False)
        results = v.replay_results(rows, first)
        second = None
        settle = self.settling_shift
        if not all(r.matches for r in results) and settle is not None:
            second = v.replay_results(rows, self.round(step, captured, settle, "settling"))
        finding = v.judge_by_tp(results, second, self.topology, self.layout)
        detail: dict[str, object] = {"comparisons": len(results)}
        if finding is None and started_from is not None and self.rank == 0:
            detail[STARTED_FROM] = as_hex(started_from)  # the ledger is rank 0's to write
        self.ledger(step, Check.REPLAY, finding is None, detail)
        if finding is not None:
            return StepResult(finding, True)
        return StepResult(None, False, verified=True)

    @staticmethod
    def _where(abft: Abft, index: int) -> str:
        if index < 0:
            return "no checked GEMM ran"
        layer, which = abft.where(index)
        return f"layer {layer}, pass {which}"

    def _nonfinite(
        self, step: int, rows: list[list[int]], replays: list[list[int]] | None, captured: Captured
    ) -> StepResult:
        """A NaN/Inf in some rank's unreduced gradient: hardware only if another replica
        index's replay of the same microbatch (same TP index) does not reproduce it."""
        flagged = [r for r, row in enumerate(rows) if row[v.LOCAL_NONFINITE]]
        if self.first_shift is None:
            finding = judge_nonfinite(flagged, {}, Check.FINITE_LOCAL, unreplayed=flagged)
        else:
            if replays is None:
                replays = self.round(step, captured, self.first_shift, "nan triage")
            reproduced = {rep[0]: bool(rep[3]) for rep in replays if rep[0] >= 0}
            finding = judge_nonfinite(flagged, reproduced, Check.FINITE_LOCAL)
        self.ledger(step, Check.FINITE_LOCAL, False, {"verdict": finding.verdict})
        if finding.verdict == Verdict.NUMERICAL and self.config.on_numerical == "skip":
            return StepResult(None, True)
        return StepResult(finding, True)

    def _abft_summary(self, device: torch.device) -> torch.Tensor:
        if self.abft is not None:
            worst = self.abft.collect()
            if worst is not None:
                return self.abft.summary(worst).to(device)
        return torch.tensor([0.0, -1.0], dtype=torch.float64, device=device)

    def vote(self, step: int, lanes: torch.Tensor) -> Finding | None:
        """The shard vote: every rank's shard fingerprint, judged column by column."""
        rows = self.comm.all_gather_rows(lanes, f"step {step}: shard vote")
        values = [lanes_to_int(r) for r in rows]
        finding = v.judge_shard_vote(values, self.layout)
        self.ledger(step, Check.VOTE, finding is None, {"fingerprint": f"{values[self.rank]:016x}"})
        return finding
