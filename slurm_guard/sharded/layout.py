"""Where each rank sits: its data-parallel and model-parallel coordinates, read from the model.

A rank of a sharded job has a data-parallel coordinate (replicate index i, shard index j) and
a model-parallel one (tensor-parallel index t). Replays, the conservation check and the shard
vote compare ranks only by these coordinates, so they must be right: a ("dp", "tp") mesh read
as HSDP takes each TP pair for a shard group and compares different shards.

They come from the two places that decide them, never from a mesh's shape or dimension names:
FSDP2's own mesh (`mesh_info` of each parameter group: the mesh it all-gathers and
reduce-scatters over, with its shard and replicate dimensions) and the parameters' DTensor
mesh (FSDP2 concatenates its data-parallel mesh in front of the TP mesh: torchtitan's
`apply_tp` then `apply_fsdp` gives each parameter placements like (_StridedShard(0), Shard(0))
on a (dp, tp) mesh). What cannot be placed that way is refused by name, on every rank, before
the first step: pipeline parallel (a model mesh that leaves ranks out), expert or context
parallel, several model-parallel dimensions, parameters on more than one mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from slurm_guard.errors import GuardError

PIPELINE = (
    "pipeline parallel is not supported: {what}. ShardedGuard guards one model replicated "
    "over data-parallel ranks (FSDP2, HSDP, with or without tensor parallel); a guard per "
    "pipeline stage cannot replay a stage without the others (docs/integrations/fsdp.md)"
)


@dataclass(frozen=True)
class Layout:
    """Global ranks by coordinate: `grid[i][j][t]` is replicate i, shard j, TP index t."""

    grid: tuple[tuple[tuple[int, ...], ...], ...]

    @property
    def replicas(self) -> int:
        return len(self.grid)

    @property
    def shards(self) -> int:
        return len(self.grid[0])

    @property
    def tp(self) -> int:
        return len(self.grid[0][0])

    @property
    def dp_indices(self) -> int:
        """Data-parallel indices: the microbatches a step trains on (replicas x shards)."""
        return self.replicas * self.shards

    def rank_at(self, dp: int, t: int) -> int:
        return self.grid[dp // self.shards][dp % self.shards][t]

    def coordinate(self, rank: int) -> tuple[int, int, int]:
        """(replicate, shard, TP) of a global rank."""
        for i, plane in enumerate(self.grid):
            for j, row in enumerate(plane):
                if rank in row:
                    return i, j, row.index(rank)
        raise ValueError(f"rank {rank} is not in the layout")

    def dp_index(self, rank: int) -> int:
        i, j, _ = self.coordinate(rank)
        return i * self.shards + j

    def tp_index(self, rank: int) -> int:
        return self.coordinate(rank)[2]

    def shard_groups(self) -> list[list[int]]:
        """The reduce-scatter groups: one per (replica, TP index), its ranks in shard order."""
        return [
            [self.grid[i][j][t] for j in range(self.shards)]
            for i in range(self.replicas)
            for t in range(self.tp)
        ]

    def copies(self) -> list[list[int]]:
        """The ranks that hold the same shard (one per (shard, TP index)), across replicas."""
        return [
            [self.grid[i][j][t] for i in range(self.replicas)]
            for j in range(self.shards)
            for t in range(self.tp)
        ]

    def pairs(self, shift: int) -> list[tuple[int, int]]:
        """(owner, replayer) for every rank: data-parallel index d is replayed by d - shift at
        the same TP index, so a whole TP group replays another's step together."""
        d_count = self.dp_indices
        return [
            (self.rank_at(d, t), self.rank_at((d - shift) % d_count, t))
            for d in range(d_count)
            for t in range(self.tp)
        ]

    def replay_shifts(self, node_of: Callable[[int], str]) -> tuple[int | None, int | None]:
        """(first round, settling round) shifts of the data-parallel index.

        The first puts every replayer on another node than its owner where any shift does;
        the settling round gives a disputed microbatch a third opinion (another shift, another
        node where possible). Two data-parallel indices have no third: (1, None).
        """
        count = self.dp_indices
        if count < 2:
            return None, None

        def apart(shift: int) -> bool:
            return all(node_of(owner) != node_of(rep) for owner, rep in self.pairs(shift))

        shifts = list(range(1, count))
        ordered = [s for s in shifts if apart(s)] + [s for s in shifts if not apart(s)]
        return ordered[0], (ordered[1] if len(ordered) > 1 else None)

    def coordinates(self) -> list[list[int]]:
        """Every rank's [replicate, shard, TP], in rank order (what a checkpoint records)."""
        world = self.replicas * self.shards * self.tp
        return [list(self.coordinate(rank)) for rank in range(world)]

    def describe(self) -> str:
        kind = "FSDP2" if self.replicas == 1 else "HSDP"
        shape = f"{self.shards}" if self.replicas == 1 else f"{self.replicas}x{self.shards}"
        return f"{kind} {shape}" + (f" x TP {self.tp}" if self.tp > 1 else "")


def refuse_pipeline_stage(model: object) -> None:
    """A PipelineStage (or anything else that is not a module) handed to the guard."""
    try:
        from torch.distributed.pipelining.stage import _PipelineStageBase
    except ImportError:  # a torch without pipelining has no stage to hand over
        return
    if isinstance(model, _PipelineStageBase):
        raise GuardError(PIPELINE.format(what=f"the model is a {type(model).__name__}"))


def _mesh_key(mesh: object) -> tuple[tuple[int, ...], tuple[str, ...]]:
    ranks = tuple(int(r) for r in mesh.mesh.reshape(-1).tolist())  # type: ignore[attr-defined]
    return ranks, tuple(getattr(mesh, "mesh_dim_names", None) or ())


def _names(mesh: object) -> list[str]:
    names = list(getattr(mesh, "mesh_dim_names", None) or ())
    root = getattr(mesh, "_get_root_mesh", None)
    if callable(root):
        names += list(getattr(root(), "mesh_dim_names", None) or ())
    return names


def _refuse_other_parallelism(names: Sequence[str]) -> None:
    """Context and expert parallel leave no trace in the parameters' placements of the shared
    weights (CP shares the data-parallel mesh, EP puts experts on another one): their mesh
    dimensions give them away, and comparing across them would compare different work."""
    for name in names:
        parts = set(name.lower().replace("-", "_").split("_"))
        if parts & {"cp", "context"}:
            raise GuardError(
                f"context parallel (mesh dimension {name!r}) is not supported: ranks of one "
                "data-parallel index compute different sequence chunks, so their gradients "
                "cannot be compared or replayed alone"
            )
        if parts & {"ep", "expert", "etp"}:
            raise GuardError(
                f"expert parallel (mesh dimension {name!r}) is not supported yet: experts live "
                "on their own mesh and are not replayed or voted on"
            )


def derive(model: nn.Module, fsdp_modules: Sequence[object], world_size: int) -> Layout:
    """The layout of a `fully_shard` model, or a GuardError that names what is not supported.

    Local and deterministic (the same mesh objects on every rank of one model), so every rank
    reaches the same answer without a collective.
    """
    params = list(model.parameters())
    if not params or any(getattr(p, "device_mesh", None) is None for p in params):
        raise GuardError("ShardedGuard: the model's parameters are not DTensors (no fully_shard?)")
    meshes = {_mesh_key(p.device_mesh): p.device_mesh for p in params}  # type: ignore[attr-defined]
    if len(meshes) > 1:
        raise GuardError(
            f"the model's parameters live on {len(meshes)} device meshes (expert parallel, or "
            "parts sharded differently): not supported; ShardedGuard needs one mesh for all"
        )
    spmd = next(iter(meshes.values()))
    infos = {}
    for module in fsdp_modules:
        state = getattr(module, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if callable(state) else None
        info = getattr(group, "mesh_info", None)
        if group is not None and info is None:
            raise GuardError("ShardedGuard cannot read FSDP2's mesh (mesh_info) on this torch")
        if info is not None:
            key = (_mesh_key(info.mesh), info.shard_mesh_dim, info.replicate_mesh_dim)
            infos[key] = info
    if len(infos) != 1:
        raise GuardError(
            f"FSDP2 shards the model over {len(infos)} different data-parallel meshes: "
            "ShardedGuard needs every fully_shard call on the same mesh"
        )
    info = next(iter(infos.values()))
    _refuse_other_parallelism(_names(spmd) + _names(info.mesh))
    if info.shard_mesh_dim is None:
        raise GuardError(
            "fully_shard with replication only (no shard dimension) is data parallelism: use "
            "DDP and sg.Guard"
        )
    dp = info.mesh.mesh
    full: torch.Tensor = spmd.mesh
    model_dims = full.ndim - dp.ndim
    if model_dims > 1:
        raise GuardError(
            f"{model_dims} model-parallel mesh dimensions ({list(spmd.mesh_dim_names or ())}): "
            "ShardedGuard supports tensor parallel on one dimension beside data parallel"
        )
    _check_leading(full, dp, model_dims)
    if model_dims == 1:
        _check_tp_placements(params, full.ndim - 1)
    replicas = dp.shape[info.replicate_mesh_dim] if info.replicate_mesh_dim is not None else 1
    shards = dp.shape[info.shard_mesh_dim]
    tp = full.shape[-1] if model_dims else 1
    ranks = full.reshape(replicas, shards, tp).tolist()
    if sorted(r for plane in ranks for row in plane for r in row) != list(range(world_size)):
        raise GuardError(
            PIPELINE.format(
                what=f"the model's mesh holds ranks {sorted(full.reshape(-1).tolist())} of the "
                f"{world_size} in the process group: the others train another part of the model "
                "(a stage), or nothing"
            )
        )
    return Layout(tuple(tuple(tuple(int(r) for r in row) for row in plane) for plane in ranks))


def _check_leading(full: torch.Tensor, dp: torch.Tensor, model_dims: int) -> None:
    """FSDP2 concatenates its mesh in front of the TP mesh: the data-parallel mesh must be the
    parameters' mesh at this rank's model-parallel coordinate, or the coordinates are unknown."""
    import torch.distributed as dist

    rank = dist.get_rank()
    where = (full == rank).nonzero()
    if where.shape[0] != 1:
        raise GuardError(f"rank {rank} is not in the parameters' device mesh: cannot place it")
    index = tuple(where[0].tolist())
    at_my_tp = full[(Ellipsis, *index[full.ndim - model_dims :])] if model_dims else full
    if at_my_tp.tolist() != dp.tolist():
        raise GuardError(
            f"cannot place the ranks: FSDP2's data-parallel mesh {dp.tolist()} is not the "
            f"leading dimensions of the parameters' mesh {full.tolist()}"
        )


def _check_tp_placements(params: Sequence[nn.Parameter], dim: int) -> None:
    """Tensor parallel shards or replicates each weight on the model-parallel dimension; a
    Partial (or anything else) there is not a layout whose shards can be compared."""
    from torch.distributed.tensor import Replicate, Shard

    for p in params:
        placement = p.placements[dim]  # type: ignore[attr-defined]
        if not isinstance(placement, (Shard, Replicate)):
            raise GuardError(
                f"a parameter has placement {placement} on the model-parallel mesh dimension: "
                "ShardedGuard places tensor parallel (Shard or Replicate there) only"
            )
