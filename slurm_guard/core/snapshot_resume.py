"""The collective resume from node-local snapshots: choose one step, load it everywhere, or none.

1. Every rank reads what its node holds (`snapshot_node.scan_node`) and offers, per step, the
   sealed fingerprint, whether it can load the step from its own node alone, and the ranks
   whose own state its node keeps. One gather gives every rank every offer.
2. Rank 0 picks the newest step its trust window allows and the run's ledger proves for every
   offer of it (`snapshot_peers.choose`, `snapshot_proof`) and broadcasts it; from the same
   offers every rank works out the same plan.
3. The ranks that can, load it and prove the sealed fingerprint. The first of them sends the
   weights to every rank that cannot, and a rank whose node keeps a copy sends each such rank
   its own state; those ranks prove the fingerprint too.
A failure anywhere in 3 reaches every rank through the agreement, and every rank tries the next
older snapshot step the rule allows; when none is left it returns -1, and the checkpoints
decide, exactly as without snapshots.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from slurm_guard.comm.collective import Collective
from slurm_guard.comm.errors import RankFailed
from slurm_guard.core import snapshot_peers as peers
from slurm_guard.core.snapshot_copy import SnapshotCopier
from slurm_guard.core.snapshot_node import NodeStep, scan_node
from slurm_guard.core.snapshot_proof import LedgerProof
from slurm_guard.errors import GuardError
from slurm_guard.fingerprint.tree import LANE_BITS, Fingerprinter, as_hex
from slurm_guard.rundir.snapshots import SnapshotStore

logger = logging.getLogger(__name__)

__all__ = [
    "NodeSnapshots",
    "SnapshotLoad",
    "allowed_except",
    "buffer_lanes",
    "resume_from_snapshots",
]

STEPS_OFFERED = 2  # the newest steps each rank offers (each node keeps two per rank)


@dataclass(frozen=True)
class SnapshotLoad:
    """What a rank restores into, and how it proves the result (as a checkpoint load does)."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    fingerprinter: Fingerprinter
    state_tensors: Callable[[], list[torch.Tensor]]  # the vote's first part (no buffers)
    restore_stateful: Callable[[Any], None] | None  # this rank's saved stateful state


class NodeSnapshots(Protocol):
    """What the resume needs of a rank's snapshots (`core.snapshots.NodeSnapshots`)."""

    comm: Collective
    rank: int
    run_id: str
    world_size: int
    store: SnapshotStore
    copier: SnapshotCopier
    target: SnapshotLoad | None
    restored_from_peers: list[int]
    resumed_from: int | None
    ledger: Path | None  # rank 0: what proves a snapshot's step (`core.snapshot_proof`)


def resume_from_snapshots(
    node: NodeSnapshots, allowed: Callable[[int], bool] | None, newest_checkpoint: int
) -> int:
    """The step every rank resumed from, or -1 (see the module docstring); all ranks call it."""
    into = node.target
    if into is None:
        raise GuardError("no state to restore a snapshot into (NodeSnapshots.target)")
    node.copier.wait()
    try:  # a rank whose memory cannot be read offers nothing; it must still join the gather
        held = scan_node(node.store.root, node.store.job_id, node.run_id, node.world_size)
        offers = {
            step: (entry.fingerprint_key(), _loadable(entry, node.rank), set(entry.provides()))
            for step, entry in held.items()
        }
    except Exception:
        logger.exception("rank %d: cannot read the snapshots on its node", node.rank)
        held, offers = {}, {}
    rows = node.comm.all_gather_rows(
        peers.row_of(offers, STEPS_OFFERED), "resume: the snapshots on each node"
    )
    if allowed is not None:  # rank 0: only what the run's own ledger vouches for
        proof = LedgerProof.read(node.ledger)
        unproven: dict[int, str] = {}
        for rank, entries in enumerate(peers.offered(rows)):
            for step, (fingerprint, _, _) in entries.items():
                if not proof.proves(step, fingerprint):
                    unproven.setdefault(
                        step, f"sealed fingerprint {fingerprint:015x} on rank {rank}"
                    )
        allowed = proof.restrict(allowed, unproven)
    rejected: set[int] = set()  # steps that failed to load somewhere: try the next older
    while True:
        chosen = -1
        if allowed is not None:
            found = peers.choose(rows, allowed_except(rejected, allowed), newest_checkpoint)
            chosen = -1 if found is None else found.step
        (chosen,) = node.comm.broadcast_ints([chosen], "resume: the snapshot chosen")
        if chosen < 0:
            return -1
        choice = peers.choose(rows, {chosen}.__contains__, -1)  # the same on every rank
        if choice is None:
            raise GuardError(f"snapshot step-{chosen:08d}: the ranks disagree about who holds it")
        entry = held.get(chosen)
        try:
            node.comm.agree(partial(_load_here, node, choice, entry, into), f"snapshot {chosen}")
            if choice.keepers:
                _give_to_the_others(node, choice, entry, into)
        except RankFailed as exc:  # a cache that failed somewhere: an older one, or checkpoints
            if node.rank == 0:
                logger.warning(
                    "snapshot step-%08d not usable on rank %d (%s): trying an older snapshot, "
                    "then the checkpoints",
                    chosen,
                    exc.rank,
                    exc.cause,
                )
            rejected.add(chosen)
            continue
        break
    node.resumed_from = chosen
    if node.rank == 0:
        others = f" ({len(choice.keepers)} ranks from other nodes)" if choice.keepers else ""
        logger.info("resumed from the node-local snapshots of step %d%s", chosen, others)
    return chosen


def allowed_except(rejected: set[int], allowed: Callable[[int], bool]) -> Callable[[int], bool]:
    """The rule's `allowed`, less the steps that already failed to load."""
    return lambda step: step not in rejected and allowed(step)


def _loadable(entry: NodeStep, rank: int) -> bool:
    return entry.weights is not None and rank in entry.provides()


def buffer_lanes(buffers: str, like: torch.Tensor) -> torch.Tensor:
    """A sealed fingerprint (hex) back as the lanes `Fingerprinter.combine` takes."""
    value = int(buffers, 16)
    return torch.tensor([value >> LANE_BITS, value & ((1 << LANE_BITS) - 1)], dtype=like.dtype)


def _prove(into: SnapshotLoad, step: int, fingerprint: int, buffers: str | None) -> None:
    """The loaded state reproduces the vote's fingerprint: its parameters and optimizer state,
    combined with the buffers' part as sealed (`core.state.ReplicatedState.vote_fingerprint`)."""
    weights = into.fingerprinter.tensors(into.state_tensors())
    parts = [weights] if buffers is None else [weights, buffer_lanes(buffers, weights)]
    found = as_hex(into.fingerprinter.combine(parts))
    if int(found[:15], 16) != fingerprint:
        raise GuardError(
            f"snapshot step-{step:08d}: the loaded state does not reproduce its sealed fingerprint"
        )


def _apply(into: SnapshotLoad, weights: dict[str, Any], own: dict[str, Any]) -> None:
    into.module.load_state_dict(weights["model"])
    into.optimizer.load_state_dict(weights["optimizer"])
    rng = own.get("rng") or {}
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])


def _load_here(
    node: NodeSnapshots, choice: peers.Choice, entry: NodeStep | None, into: SnapshotLoad
) -> None:
    """A holder loads the step from its own node's memory (no collectives)."""
    if node.rank not in choice.holders:
        return
    if entry is None:
        raise GuardError(f"snapshot step-{choice.step:08d} is gone from this node")
    own = entry.load_own(node.rank, node.run_id)
    _apply(into, entry.load_weights(node.run_id), own)
    _prove(into, choice.step, choice.fingerprint, entry.buffer_fingerprint())
    if into.restore_stateful is not None:
        into.restore_stateful(own.get("stateful"))


def _give_to_the_others(
    node: NodeSnapshots, choice: peers.Choice, entry: NodeStep | None, into: SnapshotLoad
) -> None:
    """Weights from the first holder, each rank's own state from a node keeping it (collective)."""
    rank = node.rank
    weights: dict[int, bytes] = {}
    own: dict[int, bytes] = {}
    problem = None
    try:  # what this rank sends; a failure here must reach every rank before any exchange
        if rank == choice.source:  # its module and optimizer hold the proven snapshot now
            state = {
                "model": into.module.state_dict(),
                "optimizer": into.optimizer.state_dict(),
                "buffer_fingerprint": None if entry is None else entry.buffer_fingerprint(),
            }
            weights = dict.fromkeys(sorted(choice.keepers), peers.to_bytes(state))
        for q, keeping in choice.keepers.items():
            if keeping == rank:
                if entry is None:
                    raise GuardError(f"snapshot step-{choice.step:08d} is gone from this node")
                own[q] = peers.to_bytes(entry.load_own(q, node.run_id))
    except Exception as exc:
        problem = f"rank {rank} cannot send what the ranks without the snapshot need ({exc})"
    node.comm.share_problem(problem, f"snapshot {choice.step}: what the others need")
    got_weights = peers.exchange_bytes(
        node.comm, weights, [choice.source] if rank in choice.keepers else [], "snapshot weights"
    )
    keeper = choice.keepers.get(rank)
    got_own = peers.exchange_bytes(
        node.comm, own, [keeper] if keeper is not None else [], "snapshot own state"
    )

    def apply() -> None:
        if keeper is None:
            return
        mine = peers.from_bytes(got_own[keeper])
        weights = peers.from_bytes(got_weights[choice.source])
        _apply(into, weights, mine)
        _prove(into, choice.step, choice.fingerprint, weights.get("buffer_fingerprint"))
        if into.restore_stateful is not None:
            into.restore_stateful(mine.get("stateful"))
        node.restored_from_peers = sorted({choice.source, keeper})

    node.comm.agree(apply, f"snapshot {choice.step}: the ranks without it")
