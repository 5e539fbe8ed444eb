"""A tiny GPT-style language model and a deterministic synthetic corpus.

Small enough to train on two CPU cores in seconds, real enough to exercise what the guard must
handle: embeddings, causal self-attention, layer norm, dropout (the RNG must replay) and AdamW
state (the vote covers it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class TinyGPTConfig:
    vocab: int = 64
    context: int = 16
    width: int = 32
    heads: int = 2
    layers: int = 2
    dropout: float = 0.1


class Block(nn.Module):
    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.width)
        self.attn = nn.MultiheadAttention(
            cfg.width, cfg.heads, dropout=cfg.dropout, batch_first=True
        )
        self.norm2 = nn.LayerNorm(cfg.width)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.width, 4 * cfg.width),
            nn.GELU(),
            nn.Linear(4 * cfg.width, cfg.width),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class TinyGPT(nn.Module):
    def __init__(self, cfg: TinyGPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or TinyGPTConfig()
        c = self.cfg
        self.tokens = nn.Embedding(c.vocab, c.width)
        self.positions = nn.Embedding(c.context, c.width)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.width)
        self.head = nn.Linear(c.width, c.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        length = idx.shape[1]
        pos = torch.arange(length, device=idx.device)
        x = self.drop(self.tokens(idx) + self.positions(pos))
        mask = torch.triu(torch.ones(length, length, dtype=torch.bool, device=idx.device), 1)
        for block in self.blocks:
            x = block(x, mask)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss_fn contract: (model, batch) -> scalar; next-token cross-entropy."""
    logits = model(batch["tokens"])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1))


def make_batch(
    step: int, rank: int, cfg: TinyGPTConfig | None = None, batch_size: int = 4
) -> dict[str, torch.Tensor]:
    """The same tokens for the same (step, rank), in every run: resume can be checked bit for bit.

    The corpus is a noisy arithmetic progression modulo the vocabulary, so there is something to
    learn and the loss falls.
    """
    c = cfg or TinyGPTConfig()
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    start = torch.randint(0, c.vocab, (batch_size, 1), generator=gen)
    stride = torch.randint(1, 4, (batch_size, 1), generator=gen)
    seq = (start + stride * torch.arange(c.context + 1)) % c.vocab
    noise = torch.rand(seq.shape, generator=gen) < 0.05
    seq = torch.where(noise, torch.randint(0, c.vocab, seq.shape, generator=gen), seq)
    return {"tokens": seq[:, :-1], "targets": seq[:, 1:]}
