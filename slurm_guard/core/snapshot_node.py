"""What one node's memory holds of a job's snapshots, whatever rank wrote them.

After an in-job restart the ranks sit on other nodes than the ones that wrote the snapshots:
rank 1 may now run where rank 2 used to, next to rank 2's snapshot directory and the peer copy
of rank 1's own state that rank 2 keeps. So a resume looks at every rank directory of the job on
this node, not only its own: a step is usable here when one of them holds the weights, and
each rank's own state (RNG, `stateful`) can come from its own directory or a peer copy.

The small files are hashed when the node is scanned; the weights when they are loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_guard.core import snapshot_peers as peers
from slurm_guard.errors import GuardError
from slurm_guard.rundir.snapshots import (
    OWN_FILE,
    WEIGHTS_FILE,
    SnapshotSeal,
    SnapshotStore,
    ranks_on_node,
)

logger = logging.getLogger(__name__)

__all__ = ["NodeStep", "scan_node", "usable_seals"]


@dataclass
class NodeStep:
    """One snapshot step as this node holds it."""

    step: int
    fingerprint: str  # the sealed fingerprint, the same in every seal of the step on this node
    weights: tuple[SnapshotStore, SnapshotSeal] | None = None
    own: dict[int, tuple[SnapshotStore, SnapshotSeal]] = field(default_factory=dict)
    kept: dict[int, tuple[SnapshotStore, SnapshotSeal]] = field(default_factory=dict)

    def provides(self) -> list[int]:
        """The ranks whose own state this node can give: own directories, then peer copies."""
        return sorted(set(self.own) | set(self.kept))

    def fingerprint_key(self) -> int:
        return int(self.fingerprint[:15], 16)

    def buffer_fingerprint(self) -> str | None:
        """The buffers' part of the vote's fingerprint, as the weights' seal holds it."""
        return None if self.weights is None else self.weights[1].buffer_fingerprint

    def load_weights(self, run_id: str) -> dict[str, Any]:
        if self.weights is None:
            raise GuardError(f"snapshot step-{self.step:08d}: no weights on this node")
        return _checked_load(*self.weights, run_id, WEIGHTS_FILE)

    def load_own(self, rank: int, run_id: str) -> dict[str, Any]:
        """Rank `rank`'s RNG and stateful state: from its own directory, else a peer copy."""
        if rank in self.own:
            state = _checked_load(*self.own[rank], run_id, OWN_FILE)
            return {"rng": state.get("rng"), "stateful": state.get("stateful")}
        if rank in self.kept:
            state = _checked_load(*self.kept[rank], run_id, OWN_FILE)
            raw = (state.get("peers") or {}).get(str(rank))
            if raw is None:
                raise GuardError(f"snapshot step-{self.step:08d}: no copy of rank {rank}'s state")
            loaded: dict[str, Any] = peers.from_bytes(peers.tensor_bytes(raw))
            return loaded
        raise GuardError(f"snapshot step-{self.step:08d}: rank {rank}'s own state is not here")


def _checked_load(
    store: SnapshotStore, seal: SnapshotSeal, run_id: str, name: str
) -> dict[str, Any]:
    problem = store.problem(seal, run_id, (name,))
    if problem is not None:
        raise GuardError(f"snapshot step-{seal.step:08d} of rank {seal.rank}: {problem}")
    return store.load(seal, (name,))


def usable_seals(
    root: Path, key: str, run_id: str, world_size: int
) -> Iterator[tuple[SnapshotStore, SnapshotSeal]]:
    """Every seal of this run on this node, whichever rank directory holds it, whose small file
    (own.pt) matches its sha256; what is skipped is logged."""
    for rank in ranks_on_node(root, key):
        store = SnapshotStore(root, key, rank)
        seals, unusable = store.seals()
        for step, why in unusable.items():
            logger.warning("skipping snapshot step-%08d of rank %d: %s", step, rank, why)
        for seal in seals:
            if seal.run_id != run_id or seal.world_size != world_size:
                continue  # another run's, or another layout's: never this run's state
            try:
                int(seal.weight_fingerprint[:15], 16)
            except ValueError:
                continue
            problem = store.problem(seal, run_id, (OWN_FILE,))
            if problem is not None:
                logger.warning(
                    "skipping snapshot step-%08d of rank %d: %s", seal.step, rank, problem
                )
                continue
            yield store, seal


def scan_node(root: Path, key: str, run_id: str, world_size: int) -> dict[int, NodeStep]:
    """Every snapshot step this node holds for the run, by step.

    The small files (each rank's own state and its peers' copies) are hashed here, so a damaged
    one is never offered; the weights are hashed by the ranks that load them. A step whose seals
    on this node name two fingerprints is left out: two timelines met here.
    """
    steps: dict[int, NodeStep] = {}
    conflicting: set[int] = set()
    for store, seal in usable_seals(root, key, run_id, world_size):
        entry = steps.setdefault(seal.step, NodeStep(seal.step, seal.weight_fingerprint))
        if entry.fingerprint != seal.weight_fingerprint:
            conflicting.add(seal.step)
            continue
        if seal.weights and entry.weights is None:
            entry.weights = (store, seal)
        entry.own[seal.rank] = (store, seal)
        for q in seal.peers:
            entry.kept.setdefault(q, (store, seal))
    for step in conflicting:
        logger.warning("skipping snapshot step-%08d: this node holds two versions of it", step)
        steps.pop(step, None)
    return steps
