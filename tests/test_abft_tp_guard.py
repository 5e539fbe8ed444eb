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


def train_tp(run_dir: str, steps: int) -> dict[str, Any]:
    """dp=2 x tp=2 under ShardedGuard(abft=True); each TP pair trains on its DP index's batch."""
    from torch.distributed.device_mesh import init_device_mesh

    from slurm_guard import GuardConfig, ShardedGuard
    from slurm_guard.examples.tiny_llama import TinyLlama, next_token_loss, shard_model_tp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = shard_model_tp(TinyLlama(), mesh)  # torchtitan's TP plan, then fully_shard on dp
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
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    clean = run_local(train_tp, 4, args=(str(tmp_path / "clean"), 3), nodes=NODES)
    assert [o.status for o in clean] == ["ok"] * 4, [o.value for o in clean]
    assert not list((tmp_path / "clean" / "alarms").glob("*.json"))
    # rank 0's start line names the layout, and promises no vote: no shard has a second copy
    out = capfd.readouterr().err
    start = "slurm-guard: guarding 4 ranks on 2 nodes (FSDP2 2 x TP 2); finite + reduce-scatter "
    assert out.count(start) == 1, out
    assert "replay every 2 steps, no vote (" in out and "checked GEMMs every step" in out, out

    # checked GEMM 5 is layers.0.feed_forward.w2 (wq wk wv wo w1 w2 ...), a rowwise TP shard
    inject = {"SLURM_GUARD_INJECT": "kind=gemm,rank=3,step=1,layer=5,pass=grad_w"}
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
