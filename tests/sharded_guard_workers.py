"""ShardedGuard training on gloo for tests (spawned processes import this module).

A tiny Llama-like model sharded with fully_shard per block and on the root, on a 2x2 HSDP mesh
(2 replica groups x 2 shards), a 3x2 one (3 replica groups of 2 shards) or a 1-D FSDP mesh;
every rank trains on its own microbatch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def _batch(step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 128, (2, 9), generator=gen)


def _digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    from slurm_guard.sharded.vote import local_state

    h = hashlib.sha256()
    for t in local_state(model, optimizer):
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def train(
    run_dir: str,
    steps: int,
    *,
    hsdp: bool = True,
    replicas: int = 2,
    config: dict[str, Any] | None = None,
    faults: tuple[Any, ...] = (),
    resume: bool = False,
    save_at: tuple[int, ...] = (),
    init_seed: int = 0,
    build: Callable[[Any], torch.nn.Module] | None = None,
    loss_fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None = None,
    batch: Callable[[int, int], torch.Tensor] = _batch,
) -> dict[str, Any]:
    """Train up to `steps` (from the resumed step with resume=True); return what tests read.

    `build(mesh)` gives another sharded model (the tiny Llama by default), `loss_fn` its loss.
    """
    from torch.distributed.device_mesh import init_device_mesh

    from slurm_guard import GuardConfig, ShardedGuard
    from slurm_guard.examples.tiny_llama import TinyLlama, next_token_loss, shard_model

    world = dist.get_world_size()
    if hsdp:
        shape = (replicas, world // replicas)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    torch.manual_seed(init_seed)
    model = shard_model(TinyLlama(), mesh) if build is None else build(mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    settings = {"replay_every": 2, "vote_every": 1, "seed": 7, **(config or {})}
    guard = ShardedGuard(
        model,
        optimizer,
        loss_fn or next_token_loss,
        run_dir,
        GuardConfig(faults=faults, **settings),
    )
    start = guard.resume() if resume else 0
    losses = []
    rank = dist.get_rank()
    for step in range(start, steps):
        losses.append(guard.step(batch(step, rank)))
        if guard.step_count in save_at:
            guard.save_checkpoint()
    guard.end_run()  # what exit_on_alarm does at a clean end: the batch check's last read
    snapshots = guard.snapshots
    if snapshots is not None:
        snapshots.copier.wait()  # the last snapshot is on the node before the test looks
    return {
        "start": start,
        "losses": losses,
        "digest": _digest(model, optimizer),
        "verified": list(guard.verified_steps),
        "restored_from_peers": snapshots.restored_from_peers if snapshots else [],
        "peer_bytes": snapshots.peer_bytes if snapshots else 0,
    }


def train_saving(run_dir: str, steps: int, save_at: int) -> dict[str, Any]:
    return train(run_dir, steps, save_at=(save_at,))


def train_resumed(run_dir: str, steps: int) -> dict[str, Any]:
    return train(run_dir, steps, resume=True, init_seed=99)


def _other_batch(step: int, rank: int) -> torch.Tensor:
    """Other data than `_batch` gives (an unseeded dataset would): the resume must warn."""
    return _batch(step + 100, rank)


def train_resumed_other_data(run_dir: str, steps: int) -> dict[str, Any]:
    """With a fault that changes no value (factor=1) on rank 1 at step 3: the end says so."""
    from slurm_guard import Fault

    no_change = (Fault("grad-scale", rank=1, step=3, factor=1.0),)
    return train(run_dir, steps, resume=True, init_seed=99, batch=_other_batch, faults=no_change)


def train_fsdp_abft(run_dir: str, steps: int) -> dict[str, Any]:
    return train(run_dir, steps, hsdp=False, config={"abft": True})


TRUST_ON_ABFT = {"abft": True, "trust_replays": 1}


def train_fsdp_abft_saving(run_dir: str, steps: int) -> dict[str, Any]:
    return train(run_dir, steps, hsdp=False, config=TRUST_ON_ABFT, save_at=(2, 4, 6))


def train_fsdp_abft_resumed(run_dir: str, steps: int) -> dict[str, Any]:
    return train(run_dir, steps, hsdp=False, config=TRUST_ON_ABFT, resume=True, init_seed=99)


def train_fsdp(run_dir: str, steps: int) -> dict[str, Any]:
    return train(run_dir, steps, hsdp=False)


def train_with_snapshots(
    run_dir: str, steps: int, shm: str, hsdp: bool, resume: bool = False
) -> dict[str, Any]:
    """Snapshots in a directory per "node" under `shm`: at each vote (HSDP, every 2 steps) or
    each trust point (pure FSDP2 with abft, every 2 steps); trusted after one more."""
    config: dict[str, Any] = {
        "snapshots": True,
        "snapshot_dir": f"{shm}/{{node}}",
        "trust_replays": 1,
        "vote_every": 2,
        "abft": not hsdp,
    }
    return train(
        run_dir, steps, hsdp=hsdp, config=config, resume=resume, init_seed=99 if resume else 0
    )


def train_three_groups(run_dir: str, steps: int) -> dict[str, Any]:
    return train(run_dir, steps, replicas=3)


def train_resumed_fsdp(run_dir: str, steps: int) -> dict[str, Any]:
    return train(run_dir, steps, hsdp=False, resume=True, init_seed=99)
