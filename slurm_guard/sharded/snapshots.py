"""Snapshots of a sharded (FSDP2 / HSDP) run: every rank's shards, and a copy on a peer node.

The DDP guard's snapshots (`core.snapshots`) keep one copy of the weights per node, since every
replica holds them all. Under FSDP2 each rank holds a part no other rank of its node has, and
pure FSDP2 has no replica at all: losing a node's memory would lose its shards. So at each
snapshot every rank also sends its whole shard state to its peer, the rank at the same position
on the next node (GEMINI's placement), and the peer writes it on its own node as that rank's
snapshot (`rank-<q>/step-N`, sealed with that rank's fingerprint). Any one node can then be
lost, or its memory cleared, and every shard is still on some node.

What it costs on the wire: each rank sends its shard state (parameters, optimizer state) once
per snapshot, the same number of bytes it keeps; `stats.peer_bytes` counts them.

Snapshots are taken after a passing shard vote (HSDP) and, under pure FSDP2 with `abft=True`,
after a step that counted as a trust point. A restart resumes from a snapshot step only where
every rank's shards are on some node with one agreed fingerprint per rank; each rank proves its
loaded shards against that fingerprint, and any failure falls back to the checkpoints.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from slurm_guard.comm.errors import RankFailed
from slurm_guard.core import snapshot_peers as peers
from slurm_guard.core.snapshot_node import usable_seals
from slurm_guard.core.snapshot_proof import LedgerProof
from slurm_guard.core.snapshot_resume import allowed_except
from slurm_guard.core.snapshots import KEPT, NodeSnapshots
from slurm_guard.errors import GuardError
from slurm_guard.fingerprint.tree import as_hex
from slurm_guard.rundir.snapshots import (
    SnapshotSeal,
    SnapshotStore,
    snapshot_key,
    snapshot_root,
)
from slurm_guard.sharded.snapshot_state import apply_shards, flatten, local_tree, mesh_of, unflatten

if TYPE_CHECKING:
    from torch import nn

    from slurm_guard.comm.collective import Collective
    from slurm_guard.comm.topology import Topology
    from slurm_guard.config import GuardConfig
    from slurm_guard.fingerprint.tree import Fingerprinter
    from slurm_guard.rundir.layout import RunDir
    from slurm_guard.sharded.layout import Layout


class ShardedRun(Protocol):
    """What the snapshots need of `sharded.guard.ShardedGuard` (a protocol: no import cycle)."""

    config: GuardConfig
    run_dir: RunDir
    comm: Collective
    topology: Topology
    node: str
    rank: int
    world_size: int
    job_id: str | None
    run_id: str
    params: list[torch.nn.Parameter]
    model: nn.Module
    optimizer: torch.optim.Optimizer
    fingerprinter: Fingerprinter
    layout: Layout

    def shard_fingerprint(self) -> torch.Tensor: ...


logger = logging.getLogger(__name__)

__all__ = ["ShardSnapshots", "attach", "choose_shards"]

Held = tuple[SnapshotStore, SnapshotSeal]  # one rank's snapshot of one step, on this node
PROVIDED = 16  # rank snapshots one node offers per step at most (its own ranks, its peers')
WIDTH = 1 + 2 * PROVIDED  # ints per offered step: step, then (rank, fingerprint) pairs


class ShardSnapshots(NodeSnapshots):
    """This rank's shard snapshots and the peer copies it keeps (see the module docstring)."""

    guard: ShardedRun
    peer_bytes: int = 0  # sent to the peer at the last snapshot

    def take(  # type: ignore[override]
        self, step: int, fingerprint: torch.Tensor, rng: dict[str, torch.Tensor]
    ) -> None:
        """Snapshot the shards after `step` completed steps, and copy them to the peer.

        Collective: every rank is here after the same passing vote or trust point.
        `fingerprint` is this rank's shard fingerprint on the device; it is read on the writer
        thread. Only the exchange's sizes are read on this thread.
        """
        guard = self.guard
        device = self.comm.device
        own: dict[str, Any] | None = None
        layout, flat = b"", torch.empty(0, dtype=torch.uint8, device=device)
        try:  # a rank that cannot build its copy sends an empty one: its peer waits for one
            own = {
                **local_tree(guard.model, guard.optimizer, mesh_of(guard.layout, self.rank)),
                "rng": rng,
                "fingerprint": fingerprint,
            }
            if self.peer is not None:
                layout, flat = flatten(own, device)
        except Exception:
            logger.exception("rank %d: no shard snapshot this time", self.rank)
        sent = {self.peer: (layout, flat)} if self.peer is not None else {}
        received = exchange_flat(self.comm, sent, self.keeps, "snapshot: shard copies")
        self.peer_bytes = int(flat.numel()) + len(layout)
        if own is None:
            return
        layouts = {q: lay for q, (lay, _) in received.items() if lay}
        state = {"own": own, "peers": {str(q): received[q][1] for q in layouts}}
        self.copier.start(state, write=lambda host: self._write(host, layouts, step), step=step)

    def _write(self, host: dict[str, Any], layouts: dict[int, bytes], step: int) -> SnapshotSeal:
        """On the writer thread: the peers' copies first, then this rank's own snapshot."""
        for q, layout in layouts.items():
            try:
                copy = unflatten(layout, host["peers"][str(q)])
                self._write_one(SnapshotStore(self.store.root, self.store.job_id, q), copy, step)
            except Exception as exc:  # that rank's own snapshot may still serve
                logger.warning("no copy of rank %d's shard snapshot at step %d: %s", q, step, exc)
        return self._write_one(self.store, host["own"], step)

    def _write_one(self, store: SnapshotStore, state: dict[str, Any], step: int) -> SnapshotSeal:
        rng = {k: v.clone() for k, v in state["rng"].items()}  # not the flat storage
        small = {"rng": rng, "mesh": state.get("mesh")}
        return store.write(
            {**small, "model": state["model"], "optimizer": state["optimizer"]},
            step=step,
            run_id=self.run_id,
            weight_fingerprint=as_hex(state["fingerprint"]),
            fingerprint_seed=self.guard.fingerprinter.seed,
            world_size=self.world_size,
        )

    def resume(self, allowed: Callable[[int], bool] | None, newest_checkpoint: int) -> int:
        """Every rank resumes from the same snapshot step, or none (-1); all ranks call it."""
        self.copier.wait()
        try:  # a rank whose memory cannot be read offers nothing; it still joins the gather
            held = scan_shards(self.store.root, self.store.job_id, self.run_id, self.world_size)
        except Exception:
            logger.exception("rank %d: cannot read the snapshots on its node", self.rank)
            held = {}
        rows = self.comm.all_gather_rows(_row(held), "resume: the shard snapshots on each node")
        if allowed is not None:  # rank 0: only what the run's own ledger vouches for
            allowed = proven(LedgerProof.read(self.ledger), allowed, rows)
        rejected: set[int] = set()  # steps that failed to load somewhere: try the next older
        while True:
            chosen = -1
            if allowed is not None:
                found = choose_shards(rows, allowed_except(rejected, allowed), newest_checkpoint)
                chosen = -1 if found is None else found.step
            (chosen,) = self.comm.broadcast_ints([chosen], "resume: the snapshot chosen")
            if chosen < 0:
                return -1
            choice = choose_shards(rows, {chosen}.__contains__, -1)
            if choice is None:
                raise GuardError(f"snapshot step-{chosen:08d}: the ranks disagree about it")
            try:
                self._load(choice, held.get(chosen, {}))
            except RankFailed as exc:
                if self.rank == 0:
                    logger.warning(
                        "shard snapshot step-%08d not usable on rank %d (%s): trying an older "
                        "snapshot, then the checkpoints",
                        chosen,
                        exc.rank,
                        exc.cause,
                    )
                rejected.add(chosen)
                continue
            self.resumed_from = chosen
            return chosen

    def _load(self, choice: ShardChoice, here: dict[int, Held]) -> None:
        rank, comm = self.rank, self.comm
        holder, place = choice.holders[rank], mesh_of(self.guard.layout, rank)

        def load(state: dict[str, Any]) -> None:
            apply_shards(self.guard.model, self.guard.optimizer, state, place)
            rng = state.get("rng") or {}
            if "cpu" in rng:
                torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
            found = as_hex(self.guard.shard_fingerprint())
            if int(found[:15], 16) != choice.fingerprints[rank]:
                raise GuardError(
                    f"snapshot step-{choice.step:08d}: rank {rank}'s loaded shards do not "
                    "reproduce their sealed fingerprint"
                )

        comm.agree(
            lambda: load(_read(here, rank, self.run_id)) if holder == rank else None,
            f"snapshot {choice.step}",
        )
        sends: dict[int, bytes] = {}
        problem = None
        try:  # what this rank sends; a failure reaches every rank before any exchange
            for q, h in enumerate(choice.holders):
                if h == rank and q != rank:
                    sends[q] = peers.to_bytes(_read(here, q, self.run_id))
        except Exception as exc:
            problem = f"rank {rank} cannot send the shard snapshots it holds for others ({exc})"
        comm.share_problem(problem, f"snapshot {choice.step}: shards for the ranks without them")
        if not any(h != q for q, h in enumerate(choice.holders)):
            return
        got = peers.exchange_bytes(
            comm, sends, [holder] if holder != rank else [], "snapshot: shards from peers"
        )

        def load_received() -> None:
            if holder != rank:
                load(peers.from_bytes(got[holder]))
                self.restored_from_peers = [holder]

        comm.agree(load_received, f"snapshot {choice.step}: the ranks without it")


def _read(here: dict[int, Held], rank: int, run_id: str) -> dict[str, Any]:
    """Rank `rank`'s sealed shard snapshot from this node, both files hash-checked."""
    if rank not in here:
        raise GuardError(f"rank {rank}'s shard snapshot is not on this node")
    store, seal = here[rank]
    problem = store.problem(seal, run_id)
    if problem is not None:
        raise GuardError(f"shard snapshot step-{seal.step:08d} of rank {rank}: {problem}")
    return store.load(seal)


def scan_shards(root: Any, key: str, run_id: str, world_size: int) -> dict[int, dict[int, Held]]:
    """{step: {rank: its snapshot}} for every sealed shard snapshot of this run on this node.

    The small file is hashed here, so a damaged one is never offered; the shards are hashed by
    the rank that loads them.
    """
    found: dict[int, dict[int, Held]] = {}
    for store, seal in usable_seals(root, key, run_id, world_size):
        if seal.weights:
            found.setdefault(seal.step, {})[seal.rank] = (store, seal)
    return found


def _key(seal: SnapshotSeal) -> int:
    """The sealed fingerprint's first 60 bits: what the resume's gather carries."""
    return int(seal.weight_fingerprint[:15], 16)


def _row(held: dict[int, dict[int, Held]]) -> list[int]:
    """The newest KEPT steps this node holds: step, then (rank, fingerprint key) pairs."""
    row: list[int] = []
    for step in sorted(held, reverse=True)[:KEPT]:
        pairs = [(q, _key(seal)) for q, (_, seal) in sorted(held[step].items())][:PROVIDED]
        flat_pairs = [x for pair in pairs for x in pair]
        row += [step, *flat_pairs, *[-1] * (2 * PROVIDED - len(flat_pairs))]
    return (row + [-1] * WIDTH * KEPT)[: WIDTH * KEPT]


@dataclass(frozen=True)
class ShardChoice:
    """The snapshot step, each rank's sealed fingerprint, and who gives each rank its shards."""

    step: int
    fingerprints: list[int]
    holders: list[int]  # holders[q]: q itself where its node has them, else a rank that does


def shard_offers(rows: Sequence[Sequence[int]]) -> dict[int, dict[int, dict[int, int]]]:
    """{step: {rank q: {offering rank: q's sealed fingerprint key}}} from the gathered rows."""
    offers: dict[int, dict[int, dict[int, int]]] = {}
    for offering, row in enumerate(rows):
        for i in range(0, len(row), WIDTH):
            step, rest = row[i], row[i + 1 : i + WIDTH]
            if step < 0:
                continue
            for q, fp in zip(rest[0::2], rest[1::2], strict=True):
                if q >= 0:
                    offers.setdefault(step, {}).setdefault(q, {})[offering] = fp
    return offers


def proven(
    proof: LedgerProof, allowed: Callable[[int], bool], rows: Sequence[Sequence[int]]
) -> Callable[[int], bool]:
    """`allowed` less the steps the ledger does not prove for every offer (`snapshot_proof`)."""
    unproven: dict[int, str] = {}
    for step, by_rank in shard_offers(rows).items():
        keys = set(by_rank.get(0, {}).values())
        if not proof.proves_shards(step, keys):
            sealed = ", ".join(f"{k:015x}" for k in sorted(keys)) or "none offered"
            unproven[step] = f"rank 0's shards sealed with {sealed}"
    return proof.restrict(allowed, unproven)


def choose_shards(
    rows: Sequence[Sequence[int]], allowed: Callable[[int], bool], newest_checkpoint: int
) -> ShardChoice | None:
    """The newest allowed step for which every rank's shards are on some node, each with one
    fingerprint wherever it is offered; None if there is none."""
    offers = shard_offers(rows)
    world = len(rows)
    for step in sorted(offers, reverse=True):
        if step < newest_checkpoint or not allowed(step):
            continue
        by_rank = offers[step]
        fingerprints, holders = [], []
        for q in range(world):
            offered = by_rank.get(q, {})
            if len(set(offered.values())) != 1:
                break  # nowhere, or two versions of one rank's shards: not this step
            fingerprints.append(next(iter(offered.values())))
            holders.append(q if q in offered else min(offered))
        else:
            return ShardChoice(step, fingerprints, holders)
    return None


def exchange_flat(
    comm: Any, sends: dict[int, tuple[bytes, torch.Tensor]], recvs: Sequence[int], what: str
) -> dict[int, tuple[bytes, torch.Tensor]]:
    """Send each (layout, flat) to its rank; receive one from each of `recvs` (all ranks call).

    Two rounds of batched point-to-point operations on the backend's device: the sizes (the
    one host read), then the layouts and the flat tensors, received on the device.
    """
    device = comm.device
    sizes_out = {
        dst: torch.tensor([len(lay), flat.numel()], dtype=torch.int64, device=device)
        for dst, (lay, flat) in sends.items()
    }
    sizes_in = {src: torch.zeros(2, dtype=torch.int64, device=device) for src in recvs}
    ops = [comm.send(size, dst) for dst, size in sizes_out.items()]
    ops += [comm.recv(size, src) for src, size in sizes_in.items()]
    comm.p2p(ops, f"{what}: sizes")
    counts = torch.stack(list(sizes_in.values())).tolist() if recvs else []
    layouts = {
        src: torch.empty(int(n), dtype=torch.uint8, device=device)
        for src, (n, _) in zip(sizes_in, counts, strict=True)
    }
    flats = {
        src: torch.empty(int(m), dtype=torch.uint8, device=device)
        for src, (_, m) in zip(sizes_in, counts, strict=True)
    }
    ops = []
    for dst, (lay, flat) in sends.items():
        if lay:
            raw = torch.frombuffer(bytearray(lay), dtype=torch.uint8)
            ops.append(comm.send(raw.to(device), dst))
        if flat.numel():
            ops.append(comm.send(flat, dst))
    for src in recvs:
        if layouts[src].numel():
            ops.append(comm.recv(layouts[src], src))
        if flats[src].numel():
            ops.append(comm.recv(flats[src], src))
    comm.p2p(ops, f"{what}: bytes")
    return {src: (peers.tensor_bytes(layouts[src]), flats[src]) for src in recvs}


def attach(guard: ShardedRun) -> ShardSnapshots:
    """The snapshots of a ShardedGuard's run on this node (GuardConfig(snapshots=True))."""
    snapshots = ShardSnapshots(
        snapshot_root(guard.config.snapshot_dir, guard.node),
        snapshot_key(guard.job_id, guard.run_id),
        guard.rank,
        guard.rank,  # every rank keeps its own shards
        guard.run_id,
        guard.world_size,
        guard.params[0].device,
        guard.comm,
        guard.topology,
    )
    snapshots.guard = guard
    if guard.rank == 0:
        snapshots.record_in(guard.run_dir.snapshot_index)
        snapshots.ledger = guard.run_dir.ledger
    return snapshots
