"""Which rank runs where, and who replays whom.

A rank's node is `SLURMD_NODENAME` (what Slurm drains) when set, else the host name. Replays go to
a rank on another node, so that one broken node can never check its own work; the pairing is a
permutation (each rank replays exactly one microbatch per verification step), built as a ring over
nodes. Only when one node holds more than half of the ranks (a single node, above all) does the
ring fall back to neighbouring ranks.
"""

from __future__ import annotations

import functools
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from slurm_guard.comm.collective import Collective
from slurm_guard.comm.devices import gpu_identity
from slurm_guard.rundir.gpus import GpuIdentity
from slurm_guard.rundir.records import RankInfo

_NAME_BYTES = 256
_GPU_BYTES = 64  # a UUID (40 characters with "GPU-"), a PCI bus id (16)


def local_rank_info(rank: int, device: torch.device | None = None) -> RankInfo:
    """Where this rank runs; `device` is the one it computes on (its GPU is recorded)."""
    hostname = socket.gethostname()
    return RankInfo(
        rank=rank,
        node=os.environ.get("SLURMD_NODENAME") or hostname,
        hostname=hostname,
        gpu=gpu_identity(device),
    )


def _encode(text: str, size: int = _NAME_BYTES) -> list[int]:
    """A name as int64 words (8 UTF-8 bytes each, zero-padded): it travels in an int row."""
    data = text.encode()[:size].ljust(size, b"\0")
    return [int.from_bytes(data[i : i + 8], "little", signed=True) for i in range(0, size, 8)]


def _encode_gpu(gpu: GpuIdentity | None) -> list[int]:
    """index (-2: no GPU), node index (-1: unknown), UUID and PCI bus id (empty: unknown)."""
    if gpu is None:
        return [-2, -1] + _encode("", _GPU_BYTES) * 2
    node = -1 if gpu.node_index is None else gpu.node_index
    uuid, pci = _encode(gpu.uuid or "", _GPU_BYTES), _encode(gpu.pci_bus_id or "", _GPU_BYTES)
    return [gpu.index, node, *uuid, *pci]


def _decode_gpu(words: list[int]) -> GpuIdentity | None:
    if words[0] == -2:
        return None
    half = _GPU_BYTES // 8
    uuid, pci = _decode(words[2 : 2 + half]), _decode(words[2 + half :])
    node = None if words[1] < 0 else words[1]
    return GpuIdentity(words[0], node, uuid or None, pci or None)


def _decode(words: list[int]) -> str:
    data = b"".join(w.to_bytes(8, "little", signed=True) for w in words)
    return data.rstrip(b"\0").decode(errors="replace")


def gather_rank_infos(
    me: RankInfo,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    comm: Collective | None = None,
) -> list[RankInfo]:
    """All ranks' node and host names and GPUs through one all-gather of int rows (no
    pickling, no numpy).

    `device` is accepted for old callers and ignored: the group's backend decides the device.
    """
    del device
    comm = comm if comm is not None else Collective(group, me.node)
    words = _NAME_BYTES // 8
    rows = comm.all_gather_rows(_encode(me.node) + _encode(me.hostname) + _encode_gpu(me.gpu))
    return [
        RankInfo(
            rank=r,
            node=_decode(row[:words]),
            hostname=_decode(row[words : 2 * words]),
            gpu=_decode_gpu(row[2 * words :]),
        )
        for r, row in enumerate(rows)
    ]


@dataclass(frozen=True)
class Topology:
    ranks: tuple[RankInfo, ...]
    replayer: tuple[int, ...]  # replayer[owner] recomputes owner's microbatch

    @classmethod
    def build(cls, ranks: list[RankInfo]) -> Topology:
        world = len(ranks)
        node_order: list[str] = []
        for info in ranks:
            if info.node not in node_order:
                node_order.append(info.node)
        ordered = sorted(ranks, key=lambda i: (node_order.index(i.node), i.rank))
        largest = max(sum(1 for i in ranks if i.node == n) for n in node_order)
        # Shifting the node-sorted list by the largest node's size lands every rank on another
        # node iff no node holds more than half of the ranks.
        shift = largest if 2 * largest <= world else 1
        replayer = [0] * world
        for pos, info in enumerate(ordered):
            replayer[info.rank] = ordered[(pos + shift) % world].rank if world > 1 else info.rank
        return cls(ranks=tuple(sorted(ranks, key=lambda i: i.rank)), replayer=tuple(replayer))

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def nodes(self) -> list[str]:
        seen: list[str] = []
        for info in self.ranks:
            if info.node not in seen:
                seen.append(info.node)
        return seen

    def node_of(self, rank: int) -> str:
        return self.ranks[rank].node

    def owner_of(self, replayer: int) -> int:
        return self._owners[replayer]

    @functools.cached_property
    def _owners(self) -> tuple[int, ...]:
        """The inverse of `replayer`, built once: a replay step asks for its owner without
        a scan of every rank (O(W) Python per step at 8,192 ranks)."""
        owners = [0] * len(self.replayer)
        for owner, replayer in enumerate(self.replayer):
            owners[replayer] = owner
        return tuple(owners)

    def ring_pairs(self, rank: int) -> list[tuple[int, int]]:
        """The (owner, replayer) pairs of the ring that involve `rank`: what `exchange` needs
        on this rank, without the list of all W pairs."""
        return [(rank, self.replayer[rank]), (self.owner_of(rank), rank)]

    def third_rank(self, owner: int, replayer: int) -> int | None:
        """A rank to settle a single failed comparison, or None when none can be impartial.

        It must sit on neither node involved: a node-wide fault would otherwise vote twice. On a
        single node (ring over GPUs) any other rank will do.
        """
        involved = {self.node_of(owner), self.node_of(replayer)}
        for info in self.ranks:
            if info.node not in involved:
                return info.rank
        if len(self.nodes) == 1:
            for info in self.ranks:
                if info.rank not in (owner, replayer):
                    return info.rank
        return None
