"""Snapshots across nodes: each rank's own state kept on a peer node, and a node that has none.

A node's snapshot holds the weights (identical on every replica after a passing vote) and each
rank's own state: its RNG and `stateful` state, which no other replica has. A node that left the
job takes the second with it, so at every snapshot each rank also sends that small state to its
peer: the rank at the same position on the next node. The peer keeps it inside its own sealed
snapshot.

A rank without the snapshot (a spare that joined after an in-job restart, a node whose memory
was cleared) then gets, over the process group, the weights from the first rank that holds them
and its own state from its peer's copy, and proves the result against the sealed fingerprint
like everyone else. Where any rank's own state cannot be found, no snapshot is used.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from slurm_guard.comm.collective import Collective
from slurm_guard.comm.topology import Topology

__all__ = [
    "PROVIDED",
    "WIDTH",
    "Choice",
    "choose",
    "exchange_bytes",
    "from_bytes",
    "offered",
    "peers_of",
    "row_of",
    "tensor_bytes",
    "to_bytes",
]

PROVIDED = 16  # ranks whose own state one rank offers at most (its node's directories)
WIDTH = 3 + PROVIDED  # ints per offered step in the resume's gather


def peers_of(topology: Topology) -> list[int | None]:
    """Who keeps each rank's own state: the rank at the same position on the next node (the
    last one there if that node has fewer ranks); None everywhere on a single node. O(W)."""
    nodes = topology.nodes
    if len(nodes) < 2:
        return [None] * topology.world_size
    on: dict[str, list[int]] = {node: [] for node in nodes}
    for rank in range(topology.world_size):
        on[topology.node_of(rank)].append(rank)
    following = {node: on[nodes[(i + 1) % len(nodes)]] for i, node in enumerate(nodes)}
    out: list[int | None] = []
    for rank in range(topology.world_size):
        node = topology.node_of(rank)
        nxt = following[node]
        out.append(nxt[min(on[node].index(rank), len(nxt) - 1)])
    return out


def to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes of a uint8 tensor, without a Python int per byte (`tolist`: slow for weights)."""
    host = tensor.detach().cpu()
    storage = host.untyped_storage()
    if host.storage_offset() or storage.nbytes() != host.numel():
        host = host.clone()  # a view: its storage holds more than these bytes
    return bytes(host.untyped_storage())


def from_bytes(data: bytes) -> Any:
    """What `to_bytes` wrote, loaded as a checkpoint is: plain data and tensors only."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def exchange_bytes(
    comm: Collective, sends: Mapping[int, bytes], recvs: Sequence[int], what: str
) -> dict[int, bytes]:
    """Send each `sends[dst]` to rank dst and receive one payload from each of `recvs`.

    All ranks call it (those with nothing to do too): two rounds of batched point-to-point
    operations on the backend's device, sizes first, then the bytes.
    """
    device = comm.device
    sizes_out = {
        dst: torch.tensor([len(b)], dtype=torch.int64, device=device) for dst, b in sends.items()
    }
    sizes_in = {src: torch.zeros(1, dtype=torch.int64, device=device) for src in recvs}
    ops = [comm.send(size, dst) for dst, size in sizes_out.items()]
    ops += [comm.recv(size, src) for src, size in sizes_in.items()]
    comm.p2p(ops, f"{what}: sizes")
    counts = torch.cat(list(sizes_in.values())).tolist() if recvs else []  # one host read
    # An empty payload travels as its size alone: both sides know it from the first round.
    buffers = {
        src: torch.empty(int(n), dtype=torch.uint8, device=device)
        for src, n in zip(sizes_in, counts, strict=True)
        if n > 0
    }
    ops = [
        comm.send(torch.frombuffer(bytearray(b), dtype=torch.uint8).to(device), dst)
        for dst, b in sends.items()
        if b
    ]
    ops += [comm.recv(buffer, src) for src, buffer in buffers.items()]
    comm.p2p(ops, f"{what}: bytes")
    return {src: tensor_bytes(buffers[src]) if src in buffers else b"" for src in recvs}


@dataclass(frozen=True)
class Choice:
    """The snapshot step every rank resumes from, and who supplies the ranks without it."""

    step: int
    fingerprint: int  # the sealed fingerprint's first 60 bits, as every rank offered it
    holders: list[int]  # ranks whose node holds the weights and their own state
    source: int  # the first holder: it sends the weights to every rank without them
    keepers: dict[int, int]  # rank without the snapshot -> a rank whose node keeps its state


Offer = tuple[int, bool, set[int]]  # fingerprint key, loadable here, ranks whose state is here


def row_of(offers: dict[int, Offer], kept_steps: int) -> list[int]:
    """This rank's offers as fixed-width ints, newest steps first: step, fingerprint, loadable
    (0/1), then up to PROVIDED ranks whose own state this node holds (-1 padding)."""
    row: list[int] = []
    for step in sorted(offers, reverse=True)[:kept_steps]:
        fingerprint, loadable, provided = offers[step]
        padded = (sorted(provided) + [-1] * PROVIDED)[:PROVIDED]
        row += [step, fingerprint, int(loadable), *padded]
    return (row + [-1] * WIDTH * kept_steps)[: WIDTH * kept_steps]


def offered(rows: Sequence[Sequence[int]]) -> list[dict[int, Offer]]:
    """Each rank's row back as {step: offer}."""
    out = []
    for row in rows:
        entries: dict[int, Offer] = {}
        for i in range(0, len(row), WIDTH):
            step, fingerprint, loadable, *provided = row[i : i + WIDTH]
            if step >= 0:
                entries[step] = (fingerprint, loadable == 1, {q for q in provided if q >= 0})
        out.append(entries)
    return out


def choose(
    rows: Sequence[Sequence[int]], allowed: Callable[[int], bool], newest_checkpoint: int
) -> Choice | None:
    """The newest snapshot step that the rule allows and that every rank can be given.

    Every rank that offers the step must offer the same fingerprint; at least one must be able
    to load it; every other rank's own state must be on some rank's node.
    """
    ranks = offered(rows)
    steps = sorted({s for entries in ranks for s in entries}, reverse=True)
    for step in steps:
        if step < newest_checkpoint or not allowed(step):
            continue
        fingerprints = {entries[step][0] for entries in ranks if step in entries}
        holders = [r for r, entries in enumerate(ranks) if step in entries and entries[step][1]]
        if len(fingerprints) != 1 or not holders:
            continue
        keepers: dict[int, int] = {}
        for lacking in (r for r in range(len(ranks)) if r not in holders):
            keeping = [k for k, e in enumerate(ranks) if step in e and lacking in e[step][2]]
            if not keeping:
                break
            keepers[lacking] = keeping[0]
        else:
            return Choice(step, fingerprints.pop(), holders, holders[0], keepers)
    return None
