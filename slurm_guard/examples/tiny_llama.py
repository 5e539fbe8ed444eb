"""A tiny Llama-like model, sharded the way torchtitan shards one: `fully_shard` per block,
then on the root. Small enough for tests and the drill on CPU (gloo), the same structure as
the real thing: token embedding, blocks of causal attention (wq/wk/wv/wo) and a SwiGLU MLP,
RMSNorm, an output head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 128
    dim: int = 64
    heads: int = 4
    hidden: int = 128
    layers: int = 2


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = c.dim // c.heads
        self.wq = nn.Linear(c.dim, c.dim, bias=False)
        self.wk = nn.Linear(c.dim, c.dim, bias=False)
        self.wv = nn.Linear(c.dim, c.dim, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallel wq/wk/wv give this rank its own heads only
        q, k, v = (
            w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        mixed: torch.Tensor = self.wo(out.transpose(1, 2).reshape(b, t, -1))
        return mixed


class FeedForward(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w2 = nn.Linear(c.hidden, c.dim, bias=False)
        self.w3 = nn.Linear(c.dim, c.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class Block(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(c.dim)
        self.attention = Attention(c)
        self.ffn_norm = nn.RMSNorm(c.dim)
        self.feed_forward = FeedForward(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        out: torch.Tensor = x + self.feed_forward(self.ffn_norm(x))
        return out


class TinyLlama(nn.Module):
    def __init__(self, c: LlamaConfig | None = None) -> None:
        super().__init__()
        c = c or LlamaConfig()
        self.tok_embeddings = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.RMSNorm(c.dim)
        self.output = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        out: torch.Tensor = self.output(self.norm(x))
        return out


def shard_model(model: TinyLlama, mesh: DeviceMesh) -> TinyLlama:
    """torchtitan's layout: each block its own FSDP unit, then the root (embedding, head)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def parallelize_tp(model: TinyLlama, tp_mesh: DeviceMesh) -> TinyLlama:
    """torchtitan's tensor-parallel plan (`apply_tp`): rowwise embedding into sequence-sharded
    activations, sequence-parallel norms, colwise wq/wk/wv/w1/w3, rowwise wo/w2 back into
    sequence shards, a colwise head whose output is gathered (no loss parallel)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    block_plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, block_plan)
    return model


def shard_model_tp(model: TinyLlama, mesh: DeviceMesh) -> TinyLlama:
    """torchtitan's 2-D (or 3-D) layout: the TP plan on `mesh["tp"]`, then `fully_shard` over
    the data-parallel dimensions (`"dp"`, or `("replicate", "shard")` for HSDP + TP)."""
    names = mesh.mesh_dim_names or ()
    dp = mesh["dp"] if "dp" in names else mesh["replicate", "shard"]
    return shard_model(parallelize_tp(model, mesh["tp"]), dp)


def next_token_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The loss_fn the guard calls: predict token t+1 from tokens up to t."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
