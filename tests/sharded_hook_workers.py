"""Sharded models whose state_dict hooks rename keys, for tests/test_sharded_state_hooks.py.

`FusedQKV` does what torchtitan 0.3.0's `FusedQKVLinear` does: one `wqkv` parameter, saved by
`state_dict()` as `wq`/`wk`/`wv` (a post-hook that first gathers a DTensor to Replicate, a
collective) and merged back by a load pre-hook. The hooks count their calls, so a test can
show that a resume never runs them. `train_titan` trains torchtitan's own Llama3 (fused QKV,
`apply_fsdp_to_decoder`) where torchtitan is importable.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from sharded_guard_workers import _batch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

HOOK_CALLS = {"split": 0, "merge": 0}


class FusedQKV(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.register_state_dict_post_hook(self._split)
        self.register_load_state_dict_pre_hook(self._merge)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (p.view(b, t, self.heads, -1).transpose(1, 2) for p in self.wqkv(x).chunk(3, -1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        mixed: torch.Tensor = self.wo(out.transpose(1, 2).reshape(b, t, d))
        return mixed

    @staticmethod
    def _split(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
        HOOK_CALLS["split"] += 1
        fused = state.pop(f"{prefix}wqkv.weight")
        if isinstance(fused, DTensor):
            fused = fused.redistribute(fused.device_mesh, [Replicate()])
        for name, part in zip(("wq", "wk", "wv"), fused.chunk(3, 0), strict=True):
            state[f"{prefix}{name}.weight"] = part.contiguous()

    @staticmethod
    def _merge(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
        HOOK_CALLS["merge"] += 1
        parts = [state.pop(f"{prefix}{name}.weight") for name in ("wq", "wk", "wv")]
        state[f"{prefix}wqkv.weight"] = torch.cat(parts, 0)


def build_fused(mesh: Any) -> nn.Module:
    from slurm_guard.examples.tiny_llama import LlamaConfig, TinyLlama, shard_model

    config = LlamaConfig()
    model = TinyLlama(config)
    for layer in model.layers:
        layer.attention = FusedQKV(config.dim, config.heads)
    return shard_model(model, mesh)  # type: ignore[arg-type]


def _save_or_resume(
    run_dir: str, steps: int, save_at: int, resume: bool, **model: Any
) -> dict[str, Any]:
    """FSDP2 on every rank; a resumed run starts from other weights, so the load must work."""
    from sharded_guard_workers import train

    init_seed = 99 if resume else 0
    return train(
        run_dir, steps, hsdp=False, save_at=(save_at,), resume=resume, init_seed=init_seed, **model
    )


def train_fused(run_dir: str, steps: int, save_at: int, resume: bool) -> dict[str, Any]:
    HOOK_CALLS.update(split=0, merge=0)
    result = _save_or_resume(run_dir, steps, save_at, resume, build=build_fused)
    return {**result, "hook_calls": dict(HOOK_CALLS)}


def _titan_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    tokens = batch[:, :-1]
    positions = torch.arange(tokens.size(1)).expand_as(tokens)
    logits = model(tokens, positions)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))


def build_titan(mesh: Any) -> nn.Module:
    """torchtitan's debug Llama3 (fused QKV), 2 of its 6 layers, sharded by torchtitan.

    SDPA in place of FlexAttention: flex has no backward on CPU in torch 2.13. gloo has no
    PREMUL_SUM, so FSDP sums and divides separately (docs/integrations/fsdp.md).
    """
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    config = model_registry("debugmodel").model
    config.layers = config.layers[:2]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_states(buffer_device=torch.device("cpu"))
    apply_fsdp_to_decoder(model, mesh, torch.float32, torch.float32, pp_enabled=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


def train_titan(run_dir: str, steps: int, save_at: int, resume: bool) -> dict[str, Any]:
    return _save_or_resume(
        run_dir,
        steps,
        save_at,
        resume,
        build=build_titan,
        loss_fn=_titan_loss,
        batch=lambda step, rank: _batch(step, rank) * 16,  # the debug model's 2048 tokens
    )
