"""A rank's shard state as a snapshot holds it, and as it travels to the peer node.

Under FSDP2 every rank holds a different part of the model, so a node's snapshot is worth
nothing without all of its ranks' shards. Each rank's snapshot is its local shards (parameters,
persistent buffers, optimizer state: plain tensors, not DTensors, so a file never depends on a
device mesh), its RNG state, its shard fingerprint and its place on the mesh (`mesh_of`).
Restoring checks the place, copies the saved shards into the model's and optimizer's own
DTensors, in place, and proves the fingerprint.

The copy for the peer node travels as one flat byte tensor on the backend's device (one send,
no serialization of the large part on the step's path) and a small description of its layout.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from slurm_guard.errors import GuardError
from slurm_guard.sharded.checkpoint import model_tensors
from slurm_guard.sharded.vote import shard

if TYPE_CHECKING:
    from torch import nn

    from slurm_guard.sharded.layout import Layout

Mesh = dict[str, Any]  # {"layout": "FSDP2 2 x TP 2", "coordinate": [replicate, shard, TP]}

__all__ = ["apply_shards", "flatten", "local_tree", "mesh_of", "shard_state", "unflatten"]

ALIGN = 16  # bytes: every tensor in the flat buffer starts aligned for any dtype's view
FLAT = "__flat__"  # marks a leaf that lives in the flat buffer: [offset, dtype, shape]


def _local(obj: Any) -> Any:
    """`obj` with every DTensor replaced by its local shard (a view, not a copy)."""
    if isinstance(obj, torch.Tensor):
        return shard(obj.detach())
    if isinstance(obj, dict):
        return {k: _local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_local(v) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def shard_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's and optimizer's state keyed by parameter path, as DTensors (DCP's form).

    `get_optimizer_state_dict` creates the optimizer's state where no step has run yet (a
    restarted run), so a restore always has tensors to copy into.
    """
    return {
        "model": model_tensors(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
    }


def local_tree(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh) -> dict[str, Any]:
    """This rank's shards of the state, as plain tensors viewing the live ones, and where on
    the mesh they belong (`mesh_of`)."""
    tree: dict[str, Any] = _local(shard_state(model, optimizer))
    return {**tree, "mesh": mesh}


def mesh_of(layout: Layout, rank: int) -> Mesh:
    """A rank's place as its snapshot records it: the layout's description and the rank's
    [replicate, shard, TP] coordinate."""
    return {"layout": layout.describe(), "coordinate": list(layout.coordinate(rank))}


def apply_shards(
    model: nn.Module, optimizer: torch.optim.Optimizer, saved: Any, mesh: Mesh
) -> None:
    """Copy saved local shards into the model's and optimizer's tensors, in place.

    Fails closed: a saved state whose keys, shapes or dtypes differ from this model's (another
    model, another mesh), or that records another place on the mesh than `mesh`, is a
    GuardError, never a partial load. A snapshot of an older slurm-guard records no place; its
    shapes and its sealed fingerprint prove it.
    """
    if not isinstance(saved, dict) or set(saved) < {"model", "optimizer"}:
        raise GuardError("not a shard snapshot (no model and optimizer state)")
    there = saved.get("mesh")
    if there is not None and there != mesh:
        raise GuardError(
            f"shard snapshot of {there} and this rank is at {mesh} (another layout: resume on "
            "the saved one, or from a checkpoint)"
        )
    target = shard_state(model, optimizer)
    with torch.no_grad():
        merged = _merge(target, {"model": saved["model"], "optimizer": saved["optimizer"]}, "")
    set_optimizer_state_dict(model, optimizer, merged["optimizer"])


def _merge(target: Any, saved: Any, path: str) -> Any:
    if isinstance(target, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            raise GuardError(f"shard snapshot: {path} is not a tensor")
        local = shard(target)
        if local.shape != saved.shape or local.dtype != saved.dtype:
            raise GuardError(
                f"shard snapshot: {path} is {tuple(saved.shape)} {saved.dtype} there and "
                f"{tuple(local.shape)} {local.dtype} here (another model or mesh)"
            )
        local.copy_(saved)
        return target
    if isinstance(target, dict):
        if not isinstance(saved, dict) or set(saved) != set(target):
            raise GuardError(f"shard snapshot: the keys under {path or '/'} differ from this run's")
        return {k: _merge(v, saved[k], f"{path}/{k}") for k, v in target.items()}
    if isinstance(target, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(target):
            raise GuardError(f"shard snapshot: {path} differs in length from this run's")
        items = [
            _merge(t, s, f"{path}/{i}") for i, (t, s) in enumerate(zip(target, saved, strict=True))
        ]
        return items if isinstance(target, list) else tuple(items)
    return saved  # a hyperparameter (lr, betas ...): the saved value, as a checkpoint does


def flatten(tree: Any, device: torch.device) -> tuple[bytes, torch.Tensor]:
    """(layout, flat bytes): the tensors on `device` packed into one uint8 tensor there.

    The layout is `tree` with each packed tensor replaced by its place in the flat buffer;
    other leaves (a CPU RNG state beside CUDA shards, hyperparameters) travel inside it.
    """
    parts: list[torch.Tensor] = []
    offset = 0

    def pack(obj: Any) -> Any:
        nonlocal offset
        if isinstance(obj, torch.Tensor) and obj.device == device:
            raw = obj.detach().contiguous().reshape(-1).view(torch.uint8)
            place = {FLAT: [offset, str(obj.dtype).removeprefix("torch."), list(obj.shape)]}
            padding = -raw.numel() % ALIGN
            parts.append(raw)
            if padding:
                parts.append(torch.zeros(padding, dtype=torch.uint8, device=device))
            offset += raw.numel() + padding
            return place
        if isinstance(obj, dict):
            return {k: pack(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [pack(v) for v in obj]
            return items if isinstance(obj, list) else tuple(items)
        return obj

    layout = pack(tree)
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    buffer = io.BytesIO()
    torch.save(layout, buffer)
    return buffer.getvalue(), flat


def unflatten(layout: bytes, flat: torch.Tensor) -> Any:
    """What `flatten` packed, with views into `flat` (a host copy) in place of the tensors."""
    tree = torch.load(io.BytesIO(layout), map_location="cpu", weights_only=True)

    def unpack(obj: Any) -> Any:
        if isinstance(obj, dict) and set(obj) == {FLAT}:
            offset, dtype_name, shape = obj[FLAT]
            dtype = getattr(torch, dtype_name, None)
            if not isinstance(dtype, torch.dtype):
                raise GuardError(f"shard snapshot: unknown dtype {dtype_name!r}")
            count = 1
            for size in shape:
                count *= size
            nbytes = count * torch.empty(0, dtype=dtype).element_size()
            if offset < 0 or offset + nbytes > flat.numel():
                raise GuardError("shard snapshot: the layout points outside the received bytes")
            return flat[offset : offset + nbytes].view(dtype).reshape(shape)
        if isinstance(obj, dict):
            return {k: unpack(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [unpack(v) for v in obj]
            return items if isinstance(obj, list) else tuple(items)
        return obj

    return unpack(tree)
