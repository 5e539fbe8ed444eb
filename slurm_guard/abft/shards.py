"""Checked GEMMs on tensor-parallel shards: the local product each rank computes.

Under tensor parallelism (torch's `parallelize_module`, torchtitan's plans) a Linear's weight,
bias, input and output are DTensors. The checked layer still computes its product with the
DTensor op itself (`F.linear` on DTensors, exactly what the unchecked layer runs, so the output
keeps the placements and the bits the unchecked op gives), but the checks, the fault injectors
and the C and Triton passes read the local tensors: every rank checks the matrix multiply its
own device ran, and no kernel ever sees a DTensor (`kernels.inputs` refuses one by name).

That is sound only when the DTensor op ran on the local shards as they were, without
redistributing an operand first. For a product O = A M (A (n, q), M (q, p), both 2-D), each
mesh dimension's placements (A, M, O) must be one of:

    (Replicate, Replicate, Replicate)    every rank the whole product
    (Replicate, Shard(1),  Shard(1))     colwise: a block of output columns (ColwiseParallel)
    (Shard(0),  Replicate, Shard(0))     a block of rows (sequence or batch sharded)
    (Shard(1),  Shard(0),  Partial(sum)) rowwise: a partial sum over q (RowwiseParallel)

Then O_local = A_local M_local (+ the local bias) exactly as the GEMM computed it. A Partial
output holds the bias divided by the mesh size (DTensor's Replicate -> Partial split), which the
check adds back in the same proportion. Anything else is refused by name (`ShardLayoutError`),
at `attach` for weights it can judge there, else at the first checked product; every rank of a
tensor-parallel group has the same layout, so every rank refuses together.
"""

from __future__ import annotations

from typing import Any

import torch

from slurm_guard.errors import GuardError

try:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except ImportError:  # a torch built without distributed support has no DTensors at all
    DTensor = None  # type: ignore[assignment,misc]


class ShardLayoutError(GuardError):
    """A checked GEMM whose DTensor layout the local check cannot verify."""


def is_dtensor(t: object) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own shard of a DTensor (the same storage, no copy, no graph), else t itself."""
    if not is_dtensor(t):
        return t
    with torch.no_grad():
        out: torch.Tensor = t.to_local()  # type: ignore[attr-defined]
    return out


def _kind(p: Any) -> str:
    """One placement of a 2-D DTensor as the rules read it: R, S0, S1, P, or '?'."""
    if isinstance(p, Replicate):
        return "R"
    if type(p) is Shard:  # (not FSDP's _StridedShard: its local rows are interleaved)
        return f"S{p.dim % 2}"
    if isinstance(p, Partial):
        return "P" if p.reduce_op == "sum" else "?"
    return "?"


# (A, M, O) per mesh dimension for O = A @ M with no redistribution (module docstring)
_LOCAL_PRODUCTS = {("R", "R", "R"), ("R", "S1", "S1"), ("S0", "R", "S0"), ("S1", "S0", "P")}
_TRANSPOSED = {"S0": "S1", "S1": "S0"}


def _kinds(t: torch.Tensor, transposed: bool) -> tuple[str, ...]:
    kinds = tuple(_kind(p) for p in t.placements)  # type: ignore[attr-defined]
    return tuple(_TRANSPOSED.get(k, k) for k in kinds) if transposed else kinds


def local_product(
    name: str,
    what: str,
    a: torch.Tensor,
    m: torch.Tensor,
    out: torch.Tensor,
    *,
    a_transposed: bool = False,
    m_transposed: bool = False,
) -> int:
    """Check that `out` = `a` @ `m` (each possibly the transpose of the tensor given) ran on
    the local shards; returns what the local bias was divided by (the size of the Partial mesh
    dimensions, else 1). Raises ShardLayoutError, naming the layer, otherwise."""
    if not (is_dtensor(a) and is_dtensor(m) and is_dtensor(out)):
        raise ShardLayoutError(
            f"abft: layer {name!r} ({what}) mixes DTensors and plain tensors; checked GEMMs "
            "need the operands and the product all plain or all DTensors on one mesh"
        )
    mesh = out.device_mesh  # type: ignore[attr-defined]
    if a.device_mesh != mesh or m.device_mesh != mesh:  # type: ignore[attr-defined]
        raise ShardLayoutError(
            f"abft: layer {name!r} ({what}): operands on different device meshes"
        )
    layout = zip(_kinds(a, a_transposed), _kinds(m, m_transposed), _kinds(out, False), strict=True)
    divisor = 1
    for dim, triple in enumerate(layout):
        if triple not in _LOCAL_PRODUCTS:
            a_p, m_p, o_p = triple
            raise ShardLayoutError(
                f"abft: layer {name!r} ({what}) cannot be checked on its local shards: on mesh "
                f"dimension {dim} the operands are {a_p} x {m_p} -> {o_p} (R: Replicate, "
                "S0/S1: Shard(0)/Shard(1) of the 2-D operand, P: Partial). Checked: R x R, "
                "R x S1 (colwise), S0 x R (rows), S1 x S0 -> P (rowwise); run this layer "
                "unchecked (abft=False) or lay it out as ColwiseParallel/RowwiseParallel"
            )
        if triple[2] == "P":
            divisor *= mesh.size(dim)
    return divisor


def check_weight(name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """At attach: refuse weights no layout above can hold (a Partial weight, a mesh placement
    other than Replicate or a Shard), on every rank, before the first step."""
    for label, t in (("weight", weight), ("bias", bias)):
        if t is None or not is_dtensor(t):
            continue
        for dim, p in enumerate(t.placements):  # type: ignore[attr-defined]
            # a shard of any kind has a dim (FSDP's _StridedShard over a TP shard too)
            if not (p.is_replicate() or isinstance(getattr(p, "dim", None), int)):
                raise ShardLayoutError(
                    f"abft: layer {name!r}: its {label} is a DTensor placed {p} on mesh "
                    f"dimension {dim}; checked GEMMs read Replicate or Shard weights only "
                    "(run it unchecked with abft=False)"
                )
    if bias is not None and is_dtensor(bias) != is_dtensor(weight):
        raise ShardLayoutError(
            f"abft: layer {name!r}: one of weight and bias is a DTensor and the other is not"
        )
