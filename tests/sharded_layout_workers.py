"""Training in the layouts large runs use, on gloo, for tests (spawned processes import this).

The tiny Llama with torchtitan's tensor-parallel plan and `fully_shard` over the data-parallel
dimensions: FSDP2 (1-D), HSDP, FSDP2 + TP on a ("dp", "tp") mesh, HSDP + TP on three
dimensions; and DDP. Every TP group trains on its data-parallel index's batch, as torchtitan's
data loader gives it. Each worker can train without the guard first, on the same mesh, so one
launch compares a guarded run with an unguarded one bit for bit.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import torch
import torch.distributed as dist

from slurm_guard.examples.tiny_llama import LlamaConfig

SMALL = LlamaConfig(vocab=48, dim=24, heads=2, hidden=48, layers=1)
"""Every weight divides evenly over 3 data-parallel x 2 TP ranks; a block, an embedding, a head."""


def batch(step: int, dp_index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + dp_index)
    return torch.randint(0, SMALL.vocab, (2, 9), generator=gen)


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _mesh(replicas: int, shards: int, tp: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if tp > 1 and replicas > 1:
        return init_device_mesh(
            "cpu", (replicas, shards, tp), mesh_dim_names=("replicate", "shard", "tp")
        )
    if tp > 1:
        return init_device_mesh("cpu", (shards, tp), mesh_dim_names=("dp", "tp"))
    if replicas > 1:
        return init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (shards,), mesh_dim_names=("shard",))


def build_titan(seed: int) -> torch.nn.Module:
    """torchtitan 0.3.0's own debug Llama3 (one layer, SDPA), parallelized by torchtitan itself:
    `model.parallelize(parallel_dims)` (its TP plan, sequence parallel) then
    `apply_fsdp_to_decoder` over its "fsdp" mesh, on a ("fsdp", "tp") = 2 x 2 layout.

    Two things for CPU: torchtitan builds its world mesh on `device_type` (cuda), and gloo has
    no PREMUL_SUM, so FSDP sums and divides separately.
    """
    import torchtitan.distributed.parallel_dims as titan_dims
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    titan_dims.device_type = "cpu"  # type: ignore[attr-defined]
    dims = titan_dims.ParallelDims(
        dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1, world_size=4,
        spmd_backend="partial_dtensor",
    )  # fmt: skip
    dims.build_mesh()
    config = model_registry("debugmodel").model
    config.layers = config.layers[:1]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_llama3_sharding_config(config, enable_sp=True)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_states(buffer_device=torch.device("cpu"))
    model.parallelize(dims)
    mesh = dims.get_mesh(["fsdp"])
    apply_fsdp_to_decoder(model, mesh, torch.float32, torch.float32, pp_enabled=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    built: torch.nn.Module = model
    return built


def titan_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    tokens = batch[:, :-1]
    positions = torch.arange(tokens.size(1)).expand_as(tokens)
    logits = model(tokens, positions)
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))


def _model(mesh: Any, tp: int, seed: int) -> torch.nn.Module:
    from slurm_guard.examples.tiny_llama import TinyLlama, shard_model, shard_model_tp

    if mesh is None:
        return build_titan(seed)
    torch.manual_seed(seed)
    model = TinyLlama(SMALL)
    return shard_model_tp(model, mesh) if tp > 1 else shard_model(model, mesh)


def _unguarded(mesh: Any, tp: int, steps: int) -> dict[str, Any]:
    from slurm_guard.examples.tiny_llama import next_token_loss
    from slurm_guard.sharded.vote import local_state

    loss_fn = next_token_loss if mesh is not None else titan_loss
    model = _model(mesh, tp, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp_index = dist.get_rank() // tp
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch(step, dp_index))
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "digest": _digest(local_state(model, optimizer))}


def train(
    run_dir: str,
    steps: int,
    *,
    shards: int,
    tp: int = 1,
    replicas: int = 1,
    config: dict[str, Any] | None = None,
    compare: bool = False,
    resume: bool = False,
    save_at: tuple[int, ...] = (),
    titan: bool = False,
    shm: str | None = None,
    opaque_on: int | None = None,
    hooked_on: int | None = None,
) -> dict[str, Any]:
    """Train `steps` guarded (from the resumed step with resume=True); with compare=True,
    first the same steps unguarded on the same mesh. Returns what the tests read.

    `titan`: torchtitan's own Llama3 and parallelization (FSDP2 2 x TP 2) instead.
    `shm`: snapshots on, in a directory per node under it (standing in for /dev/shm).
    `opaque_on`: that rank puts an object into its param_group after the guard's start (as a
    callback might), which its update's checker cannot load.
    `hooked_on`: that rank alone gives its optimizer a step hook before the guard starts."""
    from slurm_guard import GuardConfig, ShardedGuard
    from slurm_guard.examples.tiny_llama import next_token_loss
    from slurm_guard.sharded.vote import local_state

    mesh = None if titan else _mesh(replicas, shards, tp)
    plain = _unguarded(mesh, tp, steps) if compare else None
    model = _model(mesh, tp, 99 if resume else 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    settings = {"replay_every": 2, "vote_every": 2, "seed": 7, **(config or {})}
    if shm is not None:
        settings.update(snapshots=True, snapshot_dir=f"{shm}/{{node}}")
    loss_fn = titan_loss if titan else next_token_loss
    if hooked_on == dist.get_rank():
        optimizer.register_step_post_hook(lambda *_: None)
    guard = ShardedGuard(model, optimizer, loss_fn, run_dir, GuardConfig(**settings))
    start = guard.resume() if resume else 0
    if opaque_on == dist.get_rank():
        optimizer.param_groups[0]["note"] = Opaque()
    dp_index = dist.get_rank() // tp
    losses = []
    for step in range(start, steps):
        losses.append(guard.step(batch(step, dp_index)))
        if guard.step_count in save_at:
            guard.save_checkpoint()
    snapshots = guard.snapshots
    if snapshots is not None:
        snapshots.copier.wait()  # the last snapshot is on its node before the test looks
    return {
        "start": start,
        "restored_from_peers": snapshots.restored_from_peers if snapshots else [],
        "losses": losses,
        "digest": _digest(local_state(model, optimizer)),
        "verified": list(guard.verified_steps),
        "layout": guard.layout.describe(),
        "plain": plain,
    }


class Opaque:
    """A param_group value that `torch.load(weights_only=True)` refuses."""


TRUST_ONE = {"trust_replays": 1}  # a checkpoint is trusted after the next passing replay


def train_3x2(run_dir: str, steps: int, compare: bool = False) -> dict[str, Any]:
    return train(run_dir, steps, shards=3, tp=2, compare=compare, save_at=(2, 4), config=TRUST_ONE)


def resume_3x2(run_dir: str, steps: int) -> dict[str, Any]:
    return train(run_dir, steps, shards=3, tp=2, resume=True, config=TRUST_ONE)


def pipeline(run_dir: str, fsdp: bool) -> str:
    """Two pipeline stages (ranks 0-1 and 2-3), each data parallel over its own two ranks, a
    guard per stage as a user would write it; what the guard said."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import slurm_guard as sg

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = dist.get_rank() // 2
    torch.manual_seed(stage)
    module = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))

    def loss_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = model(x).sum()
        return out

    optimizer_of = torch.optim.SGD
    try:
        if fsdp:
            for layer in module:
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(module, mesh=mesh["dp"])
            sg.ShardedGuard(module, optimizer_of(module.parameters(), lr=0.1), loss_fn, run_dir)
        else:
            ddp = DistributedDataParallel(module, process_group=mesh["dp"].get_group())
            sg.Guard(ddp, optimizer_of(ddp.parameters(), lr=0.1), loss_fn, run_dir)
    except sg.GuardError as exc:
        return str(exc)
    return "accepted"


def ddp_over_tp(run_dir: str) -> str:
    """DDP over a tensor-parallel model (DTensor weights): refused by name."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    import slurm_guard as sg

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    module = parallelize_module(nn.Linear(8, 8), mesh, ColwiseParallel())
    try:
        ddp = DistributedDataParallel(module)
        sg.Guard(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), lambda m, x: m(x).sum(), run_dir)
    except sg.GuardError as exc:
        return str(exc)
    except Exception as exc:  # DDP itself may refuse DTensors first
        return f"DDP: {type(exc).__name__}: {exc}"
    return "accepted"


def ddp_clean(run_dir: str, steps: int) -> dict[str, Any]:
    """DDP: the same steps unguarded, then guarded with a replay on every step."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import slurm_guard as sg

    def loss_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = (model(x) ** 2).mean()
        return out

    def data(step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(step * 10 + dist.get_rank())
        return torch.randn(4, 8, generator=gen)

    runs = []
    for guarded in (False, True):
        torch.manual_seed(0)
        ddp = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        losses = []
        if guarded:
            guard = sg.Guard(ddp, optimizer, loss_fn, run_dir, sg.GuardConfig(replay_every=1))
            losses = [guard.step(data(s)) for s in range(steps)]
        else:
            for s in range(steps):
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(ddp, data(s))
                loss.backward()  # type: ignore[no-untyped-call]
                optimizer.step()
                losses.append(loss.item())
        bits = [struct.pack("<d", x).hex() for x in losses]
        runs.append({"losses": bits, "digest": _digest(list(ddp.parameters()))})
    return {"plain": runs[0], "guarded": runs[1]}
