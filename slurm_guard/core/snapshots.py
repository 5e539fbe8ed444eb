"""The guard's snapshots: taken after each passing vote, offered to the resume before checkpoints.

After a passing weight vote every replica holds the same verified state. Each node keeps that
state in its own memory (`rundir.snapshots`, written off the step's path by
`core.snapshot_copy`): the node's first rank keeps the model and the optimizer, every rank its
own RNG and `stateful` state. A restart on the same nodes (in the allocation, or a local rerun)
then resumes from the newest snapshot that the resume rule allows, instead of from a checkpoint
up to a save interval older.

One rule, two stores: a snapshot step is a candidate only where the trust window of the pending
alarms allows it (`rundir.recovery.TrustWindow`), exactly as a checkpoint's step is; it must be
sealed by this run, undamaged on every rank, and must reproduce its sealed fingerprint once
loaded. Anything short of that falls back to the checkpoints, never to a start from nothing.
A node without the snapshot (a spare that just joined) means no snapshot is used this time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from slurm_guard.comm.collective import Collective
from slurm_guard.comm.errors import RankFailed
from slurm_guard.comm.topology import Topology
from slurm_guard.config import GuardConfig
from slurm_guard.core import snapshot_peers as peers
from slurm_guard.core import stateful
from slurm_guard.core.snapshot_copy import SnapshotCopier
from slurm_guard.errors import GuardError
from slurm_guard.fingerprint.tree import Fingerprinter, as_hex
from slurm_guard.rundir.checkpoint import rng_state
from slurm_guard.rundir.snapshots import SnapshotSeal, SnapshotStore, snapshot_root

logger = logging.getLogger(__name__)

__all__ = ["Guarded", "NodeSnapshots", "SnapshotLoad", "attach", "take"]

KEPT = 2  # snapshots kept per rank; the resume looks at this many per rank


@dataclass(frozen=True)
class SnapshotLoad:
    """What a rank restores into, and how it proves the result (as a checkpoint load does)."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    fingerprinter: Fingerprinter
    state_tensors: Callable[[], list[torch.Tensor]]
    restore_stateful: Callable[[Any], None] | None  # this rank's saved stateful state


class NodeSnapshots:
    """This rank's part of the node-local snapshots of one job (or one local run)."""

    def __init__(
        self,
        root: Any,
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
        self.topology = topology
        self.rank = rank
        self.leader = leader  # the node's first rank: it keeps the model and optimizer
        self.run_id = run_id
        self.world_size = world_size
        self.store = SnapshotStore(root, key, rank, keep=KEPT)
        self.leader_store = SnapshotStore(root, key, leader, keep=KEPT)
        self.copier = SnapshotCopier(self.store, device)
        self.loaded: SnapshotSeal | None = None  # the snapshot the last resume loaded
        self.target: SnapshotLoad | None = None  # what a resume restores into (the core's)
        self.restored_from_peers: list[int] = []  # ranks that sent this rank its snapshot
        self._kept: dict[int, bytes] = {}  # other ranks' own state, from the loaded snapshot

    # ------------------------------------------------------------------ taking

    def take(
        self,
        step: int,
        fingerprint: torch.Tensor,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        rng: dict[str, torch.Tensor],
        stateful: Any,
        seed: int,
    ) -> None:
        """Start a snapshot of the state after `step` completed steps; returns at once.

        `fingerprint` is the state's fingerprint on the device (what a checkpoint seals): the
        writer thread reads it to the host, so the step never waits for it.
        """
        own = {"rng": rng, "stateful": stateful}
        # The peer copy of each rank's own state: a collective (every rank is here, after the
        # same passing vote), small next to the weights.
        peer = peers.peer_of(self.topology, self.rank)
        sends = {peer: peers.to_bytes(own)} if peer is not None else {}
        kept = peers.exchange_bytes(
            self.comm, sends, peers.kept_for(self.topology, self.rank), "snapshot: peer copies"
        )
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
            fingerprint_seed=seed,
            world_size=self.world_size,
            peers=tuple(sorted(kept)),
        )

    def fence(self) -> None:
        """Before the optimizer changes the state: the snapshot's device copy has read it."""
        self.copier.fence()

    def close(self) -> None:
        self.copier.close()

    # ------------------------------------------------------------------ resuming

    def usable(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """(step, sealed fingerprint as an int, ranks whose own state it keeps) per snapshot.

        Newest first.
        A snapshot needs this rank's own files and the node's first rank's (the weights), both
        sealed by this run for this world size and undamaged.
        """
        self.copier.wait()
        found = []
        for seal in self.store.seals()[0]:
            leader = self._seal(self.leader_store, seal.step)
            problem = self._problem(seal, leader)
            if problem is not None:
                logger.warning("skipping snapshot step-%08d: %s", seal.step, problem)
                continue
            assert leader is not None
            found.append((seal.step, int(leader.weight_fingerprint[:15], 16), seal.peers))
        return found[:KEPT]

    @staticmethod
    def _seal(store: SnapshotStore, step: int) -> SnapshotSeal | None:
        return next((s for s in store.seals()[0] if s.step == step), None)

    def _problem(self, own: SnapshotSeal, leader: SnapshotSeal | None) -> str | None:
        if leader is None:
            return f"the node's first rank ({self.leader}) has no snapshot of this step"
        for store, seal in ((self.store, own), (self.leader_store, leader)):
            if seal.world_size != self.world_size:
                return f"saved on {seal.world_size} ranks, this run has {self.world_size}"
            problem = store.problem(seal, self.run_id)
            if problem is not None:
                return f"rank {seal.rank}'s part: {problem}"
        try:
            int(leader.weight_fingerprint[:15], 16)
        except ValueError:
            return f"its seal's fingerprint is not one ({leader.weight_fingerprint[:20]!r})"
        return None

    def discard_after(self, step: int) -> None:
        """Remove this rank's snapshots newer than `step`: a rollback made them the wrong past.

        Without this, a later restart with no alarm pending would find them allowed.
        """
        self.copier.wait()
        for seal in self.store.seals()[0]:
            if seal.step > step:
                self.store.remove(seal.step)

    def resume(self, allowed: Callable[[int], bool] | None, newest_checkpoint: int) -> int:
        """Resume every rank from the newest usable snapshot (all must call); -1 for none.

        `allowed` is rank 0's trust window (None on the other ranks) and `newest_checkpoint`
        rank 0's newest allowed checkpoint step: a snapshot older than that is not used. A rank
        without the snapshot gets the weights from the first holder and its own state from its
        peer's copy. Any failure on any rank: -1 on every rank, and the checkpoints decide.
        """
        target = self.target
        if target is None:
            raise GuardError("no state to restore a snapshot into (NodeSnapshots.target)")
        width = 2 + peers.PEERS_KEPT
        row: list[int] = []
        for step, fingerprint, kept in self.usable():
            padded = (list(kept) + [-1] * peers.PEERS_KEPT)[: peers.PEERS_KEPT]
            row += [step, fingerprint, *padded]
        row = (row + [-1] * width * KEPT)[: width * KEPT]
        rows = self.comm.all_gather_rows(row, "resume: the snapshots on each node")
        chosen = -1
        if allowed is not None:
            found = peers.choose(rows, width, allowed, newest_checkpoint)
            chosen = -1 if found is None else found.step
        (chosen,) = self.comm.broadcast_ints([chosen], "resume: the snapshot chosen")
        if chosen < 0:
            return -1
        # Every rank holds the same rows, so every rank works out the same plan.
        choice = peers.choose(rows, width, lambda s: s == chosen, -1)
        if choice is None:
            raise GuardError(f"snapshot step-{chosen:08d}: the ranks disagree about who holds it")
        try:
            self.comm.agree(lambda: self._load_held(choice, target), f"resume: snapshot {chosen}")
            if choice.keepers:
                self._give_to_lacking(choice, target)
        except RankFailed as exc:  # a cache that failed somewhere: the checkpoints decide
            if self.rank == 0:
                logger.warning(
                    "snapshot step-%08d not usable on rank %d (%s): resuming from a checkpoint",
                    chosen,
                    exc.rank,
                    exc.cause,
                )
            return -1
        if self.rank == 0:
            logger.info(
                "resumed from the node-local snapshots of step %d%s",
                chosen,
                f" ({len(choice.keepers)} ranks from their peers' copies)"
                if choice.keepers
                else "",
            )
        return chosen

    def _load_held(self, choice: peers.Choice, into: SnapshotLoad) -> None:
        if self.rank in choice.holders:
            self.load(choice.step, into)

    def _give_to_lacking(self, choice: peers.Choice, into: SnapshotLoad) -> None:
        """The weights from the first holder, each rank's own state from its keeper (collective)."""
        lacking = sorted(choice.keepers)
        weights = {}
        if self.rank == choice.source:
            data = peers.to_bytes(
                {"model": into.module.state_dict(), "optimizer": into.optimizer.state_dict()}
            )
            weights = dict.fromkeys(lacking, data)
        got_weights = peers.exchange_bytes(
            self.comm,
            weights,
            [choice.source] if self.rank in choice.keepers else [],
            "resume: the weights for ranks without the snapshot",
        )
        own = {q: self._kept[q] for q, keeper in choice.keepers.items() if keeper == self.rank}
        got_own = peers.exchange_bytes(
            self.comm,
            own,
            [choice.keepers[self.rank]] if self.rank in choice.keepers else [],
            "resume: own state from the peer copies",
        )

        def apply() -> None:
            if self.rank not in choice.keepers:
                return
            state = peers.from_bytes(got_weights[choice.source])
            mine = peers.from_bytes(got_own[choice.keepers[self.rank]])
            into.module.load_state_dict(state["model"])
            into.optimizer.load_state_dict(state["optimizer"])
            _set_rng(mine.get("rng") or {})
            fingerprint = as_hex(into.fingerprinter.tensors(into.state_tensors()))
            if int(fingerprint[:15], 16) != choice.fingerprint:
                raise GuardError(
                    f"the state received for snapshot step-{choice.step:08d} does not reproduce "
                    "its sealed fingerprint"
                )
            if into.restore_stateful is not None:
                into.restore_stateful(mine.get("stateful"))
            self.restored_from_peers = sorted({choice.source, choice.keepers[self.rank]})

        self.comm.agree(apply, f"resume: snapshot {choice.step} on the ranks without it")

    def load(self, step: int, into: SnapshotLoad) -> SnapshotSeal:
        """Restore snapshot `step` on this rank; raise where it is unusable (no collectives)."""
        own = self._seal(self.store, step)
        leader = self._seal(self.leader_store, step)
        if own is None:
            raise GuardError(f"snapshot step-{step:08d} is gone from this node")
        problem = self._problem(own, leader)
        if problem is not None:
            raise GuardError(f"snapshot step-{step:08d}: {problem}")
        assert leader is not None
        mine = self.store.load(own)
        weights = mine if self.rank == self.leader else self.leader_store.load(leader)
        into.module.load_state_dict(weights["model"])
        into.optimizer.load_state_dict(weights["optimizer"])
        _set_rng(mine.get("rng") or {})
        self._kept = {int(q): bytes(t.tolist()) for q, t in (mine.get("peers") or {}).items()}
        checker = into.fingerprinter
        fingerprint = as_hex(checker.tensors(into.state_tensors()))
        if checker.seed != leader.fingerprint_seed or fingerprint != leader.weight_fingerprint:
            raise GuardError(
                f"snapshot step-{step:08d} does not reproduce its sealed fingerprint "
                f"({fingerprint} != {leader.weight_fingerprint})"
            )
        if into.restore_stateful is not None:
            into.restore_stateful(mine.get("stateful"))
        self.loaded = leader
        return leader


def _set_rng(rng: dict[str, torch.Tensor]) -> None:
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])


class Guarded(Protocol):
    """What the snapshots need of the guard's core (`core.session.GuardCore`)."""

    config: GuardConfig
    comm: Collective
    topology: Topology
    rank: int
    world_size: int
    job_id: str | None
    run_id: str
    params: list[torch.nn.Parameter]
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
    # snapshots under the job id; a run outside Slurm under its run id.
    key = core.job_id or f"run-{core.run_id[:16]}"
    snapshots = NodeSnapshots(
        snapshot_root(core.config.snapshot_dir),
        key,
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

    snapshots.target = SnapshotLoad(
        core.module, core.optimizer, core.fingerprinter, core.state_tensors, restore_stateful
    )
    return snapshots


def take(core: Guarded, snapshots: NodeSnapshots, steps_done: int) -> None:
    """After a passing vote on the state after `steps_done` steps: snapshot it, off the path."""
    # An RNG drawn from between a step and a save (an eval) is not the state to restore.
    rng = core.rng_after_step if steps_done == core.step_count and core.rng_after_step else None
    snapshots.take(
        steps_done,
        core.fingerprinter.tensors(core.state_tensors()),
        core.module,
        core.optimizer,
        rng if rng is not None else rng_state(),
        stateful.collect(core.stateful, core.scaler),
        core.fingerprinter.seed,
    )
