"""Triage at the alarm: does the suspect rank get the failing microbatch wrong again?

A drained node is returned to service or retired on evidence. One wrong result can be a
transient (a particle strike, a marginal moment); a wrong result that comes back every time the
same computation is repeated points at broken hardware. At the alarm the rank that computed
wrong is still running and still holds the exact inputs: the microbatch, the RNG state it had
before its forward pass, and the weights of the step (whose update is not applied). So before
the ranks stop, the suspect repeats that computation a few times, within
`GuardConfig.triage_seconds`, and a rank on another node (the witness) computes it once as the
reference. The alarm then carries `evidence["triage"]`: `reproduced` of `runs` repeats that
disagreed with the witness again (`runs` of `runs`: persistent; 0: transient).

The repeats go through the guard's replay function, so they are replays in every respect: the
same batch and RNG state (shipped by `replay.exchange`), the plain module, the real `.grad`
fields, buffers and this rank's own RNG left untouched, and injected faults behave as on any
replay (a persistent fault hits them, a one-off fault does not).

Every rank enters the same rounds: one batch exchange, one agreement on the recomputation (the
ranks with nothing to recompute wait there under the watchdog), one point-to-point send of the
witness's reference to the suspect in tolerance mode, and one gather of small fixed-size rows
from which every rank builds the same record. A triage that fails never replaces the alarm: the
record says what failed instead.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from slurm_guard.checks.comm_hook import param_sketch
from slurm_guard.checks.replay import Captured, exchange
from slurm_guard.checks.rows import discrepancy, loss_bits, reference_vector
from slurm_guard.checks.verdicts import Finding, bits_to_float
from slurm_guard.checks.verifier import Verifier
from slurm_guard.comm.errors import CollectiveError
from slurm_guard.comm.topology import Topology
from slurm_guard.fingerprint.tree import as_int
from slurm_guard.protocol import Check, Verdict

logger = logging.getLogger(__name__)

MAX_RUNS = 3
"""Repeats on the suspect at most: three that all disagree again leave little doubt, and the
alarm should not wait longer than the budget allows anyway."""

TRIAGED_CHECKS = (Check.REPLAY, Check.ABFT)
"""Findings that name a microbatch one rank computed wrong (a vote or a reduction check names a
state or a sum, which a recomputation of one microbatch does not reproduce)."""

# Row of the gather: [runs, seconds (float64 bits), then (loss bits, value) per run]; the value
# is the gradient fingerprint (exact mode) or the discrepancy from the witness (float64 bits).
_HEAD = 2
_ROW = _HEAD + 2 * MAX_RUNS


@dataclass(frozen=True)
class TriagePlan:
    """Who recomputes what: `suspect` repeats `owner`'s microbatch, `witness` computes it once."""

    suspect: int
    owner: int
    witness: int


def _compared_pairs(evidence: Mapping[str, Any]) -> list[tuple[int, int]]:
    """(owner, replayer) of every failed comparison a replay finding's evidence lists."""
    entries: list[Any] = []
    failed = evidence.get("failed")
    if isinstance(failed, list):
        entries += failed
    entries.append(evidence.get("disputed"))
    pairs = []
    for e in entries:
        if not isinstance(e, dict):
            continue
        owner, replayer = e.get("owner"), e.get("replayer")
        if isinstance(owner, int) and isinstance(replayer, int):
            pairs.append((owner, replayer))
    return pairs


def plan(finding: Finding, topology: Topology) -> TriagePlan | None:
    """The triage of an `sdc` finding from a replay comparison or a checked GEMM, or None.

    The microbatch is one the suspect computed wrong: its own when its own result failed a
    comparison (or its GEMM check), else the one it replayed. With several suspects (a node
    named as a whole) the lowest rank is triaged: a node-wide fault shows on any of them. The
    witness is a rank on a node with no suspect, preferably one that already computed the same
    microbatch at the alarm (its replayer, or its owner).
    """
    if finding.verdict != Verdict.SDC or not finding.suspect_ranks:
        return None
    if finding.check not in TRIAGED_CHECKS:
        return None
    suspect = min(finding.suspect_ranks)
    owner = suspect
    if finding.check == Check.REPLAY:
        pairs = _compared_pairs(finding.evidence)
        if not any(o == suspect for o, _ in pairs):
            owner = next((o for o, r in pairs if r == suspect), suspect)
    suspects = set(finding.suspect_ranks)
    suspect_nodes = {topology.node_of(r) for r in suspects}
    preferred = [topology.replayer[owner], owner, *range(topology.world_size)]
    candidates = [r for r in preferred if r not in suspects]
    elsewhere = [r for r in candidates if topology.node_of(r) not in suspect_nodes]
    if elsewhere:
        return TriagePlan(suspect, owner, elsewhere[0])
    if candidates and len(topology.nodes) == 1:  # one node: another GPU is the best there is
        return TriagePlan(suspect, owner, candidates[0])
    return None


def effective_budget(triage_seconds: float, watchdog_seconds: float) -> float:
    """The suspect's time for repeats: at most half the watchdog, which the other ranks wait
    under meanwhile (a repeat started within the budget may overrun it by its own length)."""
    if watchdog_seconds > 0:
        return min(triage_seconds, watchdog_seconds / 2)
    return triage_seconds


def repeat(
    run_once: Callable[[], torch.Tensor],
    budget: float,
    limit: int = MAX_RUNS,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[list[torch.Tensor], float]:
    """Run at least once, then again while another run (at the average pace so far) still fits
    into `budget` seconds, `limit` runs at most. Returns the results and the seconds taken."""
    start = clock()
    results = [run_once()]
    while len(results) < limit:
        elapsed = clock() - start
        if elapsed + elapsed / len(results) > budget:
            break
        results.append(run_once())
    return results, clock() - start


def _float_bits(x: float) -> int:
    return int(torch.tensor([x], dtype=torch.float64).view(torch.int64).item())


class _Recompute:
    """One recomputation of the planned microbatch on this rank, as a result vector.

    Exact mode: [loss bits, gradient fingerprint]. Tolerance mode: the float64 bits of the loss
    and each parameter's gradient sketch and norm (what `verification.discrepancy` compares).
    """

    def __init__(self, verifier: Verifier, captured: Captured) -> None:
        self.verifier = verifier
        self.captured = captured
        self.tolerant = not verifier.config.deterministic

    def __call__(self) -> torch.Tensor:
        v = self.verifier
        out = v.replay_fn(self.captured)
        if self.tolerant:
            sketches = [param_sketch(v.hook.signs, t) for t in out.grads]
            return reference_vector(out.loss, sketches).view(torch.int64).clone()
        fp = v.fingerprinter
        grad = as_int(fp.combine(fp.tensor(t) for t in out.grads))
        return torch.tensor([loss_bits(out.loss), grad], dtype=torch.int64)


def triage_alarm(verifier: Verifier, finding: Finding, captured: Captured, step: int) -> Finding:
    """Every rank: the finding, with `evidence["triage"]` when the triage applies.

    `captured` is this rank's own step (batch and RNG state), as the replay round had it.
    """
    config = verifier.config
    budget = effective_budget(config.triage_seconds, config.watchdog_seconds)
    if budget <= 0 or verifier.world_size < 2:
        return finding
    triage_plan = plan(finding, verifier.topology)
    if triage_plan is None:
        return finding
    try:
        record = _run(verifier, triage_plan, captured, step, budget)
    except CollectiveError as exc:  # raised alike on every rank: each goes on to the alarm
        logger.error("step %d: the triage of rank %d failed: %s", step, triage_plan.suspect, exc)
        record = {
            "error": str(exc),
            "microbatch_of": triage_plan.owner,
            "suspect": triage_plan.suspect,
        }
    message = finding.message
    if "reproduced" in record:
        message += (
            f"; triage: reproduced {record['reproduced']} of {record['runs']} repeats on rank "
            f"{triage_plan.suspect}"
        )
    evidence = {**finding.evidence, "triage": record}
    return dataclasses.replace(finding, message=message, evidence=evidence)


def _run(
    verifier: Verifier, p: TriagePlan, captured: Captured, step: int, budget: float
) -> dict[str, Any]:
    comm, topology = verifier.comm, verifier.topology
    rank = comm.rank
    received = exchange([(p.owner, p.suspect), (p.owner, p.witness)], captured, rank, comm)
    recompute = _Recompute(verifier, received[p.owner]) if p.owner in received else None
    tolerant = not verifier.config.deterministic
    tolerance = verifier.tolerance()
    ref: torch.Tensor | None = None

    def work() -> tuple[list[torch.Tensor], float]:
        assert recompute is not None or rank not in (p.suspect, p.witness)
        if rank == p.suspect and recompute is not None:
            return repeat(recompute, budget)
        if rank == p.witness and recompute is not None:
            return [recompute()], 0.0
        return [], 0.0

    what = f"step {step}: triage of rank {p.suspect} ({topology.node_of(p.suspect)})"
    runs, seconds = comm.agree(work, what)
    if tolerant:  # the suspect compares with the witness's vector: it travels there, not to all
        width = 1 + 2 * len(verifier.params)
        reference = torch.zeros(width, dtype=torch.int64, device=comm.device)
        if rank == p.witness:
            reference = runs[0].to(comm.device)
        ops = []
        if rank == p.witness:
            ops.append(comm.send(reference, p.suspect))
        elif rank == p.suspect:
            ops.append(comm.recv(reference, p.witness))
        comm.p2p(ops, "triage: the witness's reference")
        ref = reference.cpu().view(torch.float64)
    row = [0] * _ROW
    if rank in (p.suspect, p.witness):
        row[0], row[1] = len(runs), _float_bits(seconds)
        for i, vector in enumerate(runs):
            if tolerant:
                mine = vector.view(torch.float64)
                distance = 0.0
                if rank == p.suspect and ref is not None:
                    distance = float(discrepancy(ref, mine))
                row[_HEAD + 2 * i : _HEAD + 2 * i + 2] = [
                    int(vector[0].item()),
                    _float_bits(distance),
                ]
            else:
                row[_HEAD + 2 * i : _HEAD + 2 * i + 2] = [int(x) for x in vector.tolist()]
    rows = comm.all_gather_rows(row)
    return _record(p, rows, topology, tolerance if tolerant else None)


def _hex(value: int) -> str:
    return f"{value & (2**64 - 1):016x}"


def _record(
    p: TriagePlan, rows: list[list[int]], topology: Topology, tolerance: float | None
) -> dict[str, Any]:
    """The alarm's `evidence["triage"]`, built alike on every rank from the gathered rows."""
    mine, ref = rows[p.suspect], rows[p.witness]
    ref_loss, ref_value = ref[_HEAD], ref[_HEAD + 1]
    runs: list[dict[str, Any]] = []
    reproduced = 0
    for i in range(mine[0]):
        loss, value = mine[_HEAD + 2 * i], mine[_HEAD + 2 * i + 1]
        if tolerance is None:
            differs = (loss, value) != (ref_loss, ref_value)
            runs.append({"loss_bits": _hex(loss), "grad_fingerprint": _hex(value)})
        else:
            distance = bits_to_float(value)
            differs = not distance <= tolerance
            runs.append({"loss_bits": _hex(loss), "discrepancy": distance})
        reproduced += int(differs)
    witness: dict[str, Any] = {
        "rank": p.witness,
        "node": topology.node_of(p.witness),
        "loss_bits": _hex(ref_loss),
    }
    if tolerance is None:
        witness["grad_fingerprint"] = _hex(ref_value)
    record: dict[str, Any] = {
        "reproduced": reproduced,
        "runs": mine[0],
        "microbatch_of": p.owner,
        "suspect": p.suspect,
        "suspect_node": topology.node_of(p.suspect),
        "seconds": round(bits_to_float(mine[1]), 3),
        "suspect_runs": runs,
        "witness": witness,
    }
    if tolerance is not None:
        record["tolerance"] = tolerance
    return record


__all__ = ["MAX_RUNS", "TriagePlan", "effective_budget", "plan", "repeat", "triage_alarm"]
