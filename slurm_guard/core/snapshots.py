"""The guard's snapshots: taken after each passing vote, offered to the resume before checkpoints.

After a passing weight vote every replica holds the same verified state. Each node keeps that
state in its own memory (`rundir.snapshots`, written off the step's path by
`core.snapshot_copy`): the node's first rank keeps the model and the optimizer, every rank its
own RNG and `stateful` state, and a copy of its peer's (`core.snapshot_peers`). A restart then
resumes from the newest snapshot that the resume rule allows (`core.snapshot_resume`), instead
of from a checkpoint up to a save interval older.

One rule, two stores: a snapshot step is a candidate only where the trust window of the pending
alarms allows it (`rundir.recovery.TrustWindow`), exactly as a checkpoint's step is; it must be
sealed by this run, its sealed fingerprint must be the one the run's ledger records for a
passing vote of that step (`core.snapshot_proof`), and it must reproduce that fingerprint once
loaded on every rank. Anything short of that falls back to the checkpoints, never to a start
from nothing.

The seal's fingerprint is the vote's own (`take` gets it from the vote): nothing is
fingerprinted twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from slurm_guard.comm.collective import Collective
from slurm_guard.comm.topology import Topology
from slurm_guard.config import GuardConfig
from slurm_guard.core import snapshot_peers as peers
from slurm_guard.core import stateful
from slurm_guard.core.snapshot_copy import SnapshotCopier
from slurm_guard.core.snapshot_resume import SnapshotLoad, resume_from_snapshots
from slurm_guard.core.state import ReplicatedState
from slurm_guard.fingerprint.tree import Fingerprinter, as_hex
from slurm_guard.rundir.checkpoint import rng_state
from slurm_guard.rundir.layout import RunDir
from slurm_guard.rundir.records import RecordError, atomic_write_json, read_json_file
from slurm_guard.rundir.snapshots import (
    SnapshotSeal,
    SnapshotStore,
    ranks_on_node,
    snapshot_key,
    snapshot_root,
)

logger = logging.getLogger(__name__)

__all__ = ["Guarded", "NodeSnapshots", "SnapshotLoad", "attach", "take"]

KEPT = 2  # snapshots kept per rank


class NodeSnapshots:
    """This rank's part of the node-local snapshots of one job (or one local run)."""

    def __init__(
        self,
        root: Path,
        key: str,
        rank: int,
        leader: int,
        run_id: str,
        world_size: int,
        device: torch.device,
        comm: Collective,
        topology: Topology,
    ) -> None:
        self.comm = comm
        self.rank = rank
        # Fixed for the run: who keeps this rank's own state, and whose it keeps.
        keepers = peers.peers_of(topology)
        self.peer = keepers[rank]
        self.keeps = [q for q, keeper in enumerate(keepers) if keeper == rank]
        self.leader = leader  # the node's first rank: it keeps the model and optimizer
        self.run_id = run_id
        self.world_size = world_size
        self.store = SnapshotStore(root, key, rank, keep=KEPT)
        self.copier = SnapshotCopier(self.store, device)
        self.target: SnapshotLoad | None = None  # what a resume restores into (the core's)
        self.restored_from_peers: list[int] = []  # ranks that sent this rank its snapshot
        self.resumed_from: int | None = None  # the snapshot step the last resume loaded
        self._index: Path | None = None  # rank 0's note in the run directory (`record_in`)
        self.ledger: Path | None = None  # rank 0: the run's ledger, which proves a step

    def record_in(self, index: Path) -> None:
        """Rank 0: after each sealed snapshot, note its step in the run directory for `status`.

        Only a note: what a restart loads is decided from the nodes' memory, never from it.
        """
        steps: list[int] = _noted_before(index, self.store.job_id)
        self._index = index

        def note(seal: SnapshotSeal) -> None:
            steps[:] = sorted({*steps, seal.step})[-KEPT:]
            record = {"schema": 1, "steps": steps, "written": time.time(), "job": self.store.job_id}
            try:
                atomic_write_json(index, record)
            except OSError as exc:
                logger.warning(
                    "could not note the snapshot of step %d in %s: %s", seal.step, index, exc
                )

        self.copier.on_written = note

    def take(
        self,
        step: int,
        fingerprint: torch.Tensor,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        rng: dict[str, torch.Tensor],
        own_stateful: Any,
        seed: int,
        buffers: torch.Tensor | None = None,
    ) -> None:
        """Start a snapshot of the state after `step` completed steps; returns at once.

        `fingerprint` is the vote's fingerprint on the device (what the ledger records), and
        `buffers` the buffers' part of it where the vote took them in: the writer thread reads
        both to the host, so the step never waits for them. The peer copy of
        each rank's own state is a collective: every rank is here, after the same passing vote.
        """
        own = {"rng": rng, "stateful": own_stateful}
        sends: dict[int, bytes] = {}
        if self.peer is not None:
            try:  # an empty copy, never a missing send: the peer waits for one
                sends[self.peer] = peers.to_bytes(own)
            except Exception:
                logger.exception("rank %d: no peer copy of its own state this time", self.rank)
                sends[self.peer] = b""
        received = peers.exchange_bytes(self.comm, sends, self.keeps, "snapshot: peer copies")
        kept = {q: b for q, b in received.items() if b}  # an empty one keeps nothing
        state: dict[str, Any] = {
            **own,
            "peers": {
                str(q): torch.frombuffer(bytearray(b), dtype=torch.uint8) for q, b in kept.items()
            },
        }
        if self.rank == self.leader:
            state["model"] = module.state_dict()
            state["optimizer"] = optimizer.state_dict()
        self.copier.start(
            state,
            step=step,
            run_id=self.run_id,
            weight_fingerprint=lambda: as_hex(fingerprint),
            buffer_fingerprint=None if buffers is None else (lambda: as_hex(buffers)),
            fingerprint_seed=seed,
            world_size=self.world_size,
            peers=tuple(sorted(kept)),
        )

    def fence(self) -> None:
        """Before the state changes again: the snapshot's device copy has read it."""
        self.copier.fence()

    def close(self) -> None:
        self.copier.close()

    def resume(self, allowed: Callable[[int], bool] | None, newest_checkpoint: int) -> int:
        """Every rank resumes from the same snapshot, or none (-1): `core.snapshot_resume`."""
        return resume_from_snapshots(self, allowed, newest_checkpoint)

    def discard_after(self, step: int) -> None:
        """Remove the node's snapshots of this job newer than `step`, whoever wrote them.

        A rollback made them the wrong past; a later restart with no alarm pending would
        otherwise find them allowed. Every rank of the node does it: removing twice is harmless.
        """
        self.copier.wait()
        root, key = self.store.root, self.store.job_id
        for rank in ranks_on_node(root, key):
            store = SnapshotStore(root, key, rank)
            seals, unusable = store.seals()
            for newer in {s.step for s in seals} | set(unusable):
                if newer > step:
                    store.remove(newer)
        if self._index is not None and self._index.exists():
            try:
                record = read_json_file(self._index)
                record["steps"] = [s for s in record.get("steps", []) if s <= step]
                atomic_write_json(self._index, record)
            except (RecordError, OSError, TypeError, AttributeError) as exc:
                logger.warning("could not update %s: %s", self._index, exc)


class Guarded(Protocol):
    """What the snapshots need of the guard's core (`core.session.GuardCore`)."""

    config: GuardConfig
    run_dir: RunDir
    comm: Collective
    topology: Topology
    rank: int
    world_size: int
    job_id: str | None
    run_id: str
    params: list[torch.nn.Parameter]
    replicated: ReplicatedState
    module: nn.Module
    optimizer: torch.optim.Optimizer
    fingerprinter: Fingerprinter
    stateful: dict[str, stateful.Stateful]
    scaler: torch.amp.GradScaler | None
    step_count: int
    rng_after_step: dict[str, torch.Tensor] | None

    def state_tensors(self, buffers: bool = True) -> list[torch.Tensor]: ...


def attach(core: Guarded) -> NodeSnapshots:
    """The snapshots of `core`'s run on this node (GuardConfig(snapshots=True))."""
    node = core.topology.node_of(core.rank)
    leader = min(r for r in range(core.world_size) if core.topology.node_of(r) == node)
    # A job's restarts (in the allocation or requeued onto the same nodes) find their
    # snapshots under the job and run id; a run outside Slurm under its run id.
    snapshots = NodeSnapshots(
        snapshot_root(core.config.snapshot_dir, node),
        snapshot_key(core.job_id, core.run_id),
        core.rank,
        leader,
        core.run_id,
        core.world_size,
        core.params[0].device,
        core.comm,
        core.topology,
    )

    def restore_stateful(saved: Any) -> None:
        if saved is not None:
            stateful.restore(saved, core.stateful, core.scaler)

    if core.rank == 0:
        snapshots.record_in(core.run_dir.snapshot_index)
        snapshots.ledger = core.run_dir.ledger
    snapshots.target = SnapshotLoad(
        core.module,
        core.optimizer,
        core.fingerprinter,
        lambda: core.state_tensors(buffers=False),  # the vote's first part (`ReplicatedState`)
        restore_stateful,
    )
    return snapshots


def take(
    core: Guarded, snapshots: NodeSnapshots, steps_done: int, fingerprint: torch.Tensor
) -> None:
    """After a passing vote on the state after `steps_done` steps: snapshot it, off the path.

    `fingerprint` is the vote's (`GuardCore.vote_fingerprint`), sealed as it is: the ledger
    records the same value, and the load proves it (`core.snapshot_resume`).
    """
    # An RNG drawn from between a step and a save (an eval) is not the state to restore.
    rng = core.rng_after_step if steps_done == core.step_count and core.rng_after_step else None
    snapshots.take(
        steps_done,
        fingerprint,
        core.module,
        core.optimizer,
        rng if rng is not None else rng_state(),
        stateful.collect(core.stateful, core.scaler),
        core.fingerprinter.seed,
        core.replicated.buffer_fingerprint,
    )


def _noted_before(index: Path, job_id: str) -> list[int]:
    """The steps an earlier start of this job noted: a restart keeps them (its nodes may still
    hold them), instead of forgetting them until its own next snapshot."""
    try:
        record = read_json_file(index)
        if record.get("job") != job_id:
            return []
        return sorted({int(s) for s in record.get("steps", [])})[-KEPT:]
    except (RecordError, TypeError, ValueError, AttributeError):
        return []
