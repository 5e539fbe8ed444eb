"""ShardedGuard on FSDP2 + TP (dp=2 x tp=2) with abft=True: a GEMM fault on rank 3 is `sdc` on
rank 3, and no rank dies of a signal.

It needs both halves: ShardedGuard placing the ("dp", "tp") mesh as FSDP2 + TP
(sharded/layout.py) and the checked GEMMs on local DTensor shards (abft/shards.py). Two 4-rank
launches; the spawned ranks import this module for its worker.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from slurm_guard.local.launch import run_local

NODES = ["n0", "n0", "n1", "n1"]  # each TP pair on one node, as torchtitan places them


class _FfnBlock(torch.nn.Module):
    """A Llama block without attention (tiny_llama's Attention reshapes to the full width, which
    a TP shard does not have): RMSNorm and the SwiGLU MLP, residual."""

    def __init__(self) -> None:
        from slurm_guard.examples.tiny_llama import FeedForward, LlamaConfig

        super().__init__()
        self.ffn_norm = torch.nn.RMSNorm(64)
        self.feed_forward = FeedForward(LlamaConfig())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.feed_forward(self.ffn_norm(x))
        return out


class _TpLm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(128, 64)
        self.layers = torch.nn.ModuleList(_FfnBlock() for _ in range(2))
        self.norm = torch.nn.RMSNorm(64)
        self.output = torch.nn.Linear(64, 128, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        out: torch.Tensor = self.output(self.norm(x))
        return out


def _tp_llama(mesh: Any) -> torch.nn.Module:
    """torchtitan's TP plan on mesh["tp"] (rowwise embedding, sequence-parallel norms, colwise
    w1/w3 and head, rowwise w2), then fully_shard over "dp"."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    model = _TpLm()
    tp = mesh["tp"]
    parallelize_module(
        model,
        tp,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            tp,
            {
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def train_tp(run_dir: str, steps: int) -> dict[str, Any]:
    """dp=2 x tp=2 under ShardedGuard(abft=True); each TP pair trains on its DP index's batch."""
    from torch.distributed.device_mesh import init_device_mesh

    from slurm_guard import GuardConfig, ShardedGuard
    from slurm_guard.examples.tiny_llama import next_token_loss

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = _tp_llama(mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = ShardedGuard(
        model,
        optimizer,
        next_token_loss,
        run_dir,
        GuardConfig(abft=True, replay_every=2, vote_every=1, seed=7),
    )
    dp_index = mesh.get_local_rank("dp")
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + dp_index)
        losses.append(guard.step(torch.randint(0, 128, (2, 9), generator=gen)))
    return {"losses": losses, "rank": dist.get_rank()}


@pytest.mark.distributed
def test_fsdp2_tp_abft_clean_run_passes_and_a_gemm_fault_on_rank_3_is_sdc_on_rank_3(
    tmp_path: Path,
) -> None:
    clean = run_local(train_tp, 4, args=(str(tmp_path / "clean"), 3), nodes=NODES)
    assert [o.status for o in clean] == ["ok"] * 4, [o.value for o in clean]
    assert not list((tmp_path / "clean" / "alarms").glob("*.json"))

    inject = {"SLURM_GUARD_INJECT": "kind=gemm,rank=3,step=1,layer=1,pass=grad_w"}
    outcomes = run_local(
        train_tp, 4, args=(str(tmp_path / "fault"), 3), nodes=NODES, extra_env=inject
    )
    # every rank stops with the alarm: none lost (a signal), none in error (a refusal)
    assert [o.status for o in outcomes] == ["alarm"] * 4, [o.value for o in outcomes]
    alarms = [json.loads(o.value) if isinstance(o.value, str) else o.value for o in outcomes]
    assert len({a["alarm_id"] for a in alarms}) == 1
    alarm = alarms[0]
    assert (alarm["check"], alarm["verdict"], alarm["step"]) == ("abft", "sdc", 1)
    assert alarm["suspect_ranks"] == [3] and alarm["suspect_nodes"] == ["n1"]
    assert alarm.get("injected") is True
