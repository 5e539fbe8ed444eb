"""Sharded checkpoints of models whose state_dict hooks rename keys (torchtitan's fused QKV).

DCP's `get_model_state_dict` cannot map a key that a post-hook renamed back to a parameter
(`'FusedQKVLinear' object has no attribute 'wq'`), so such a model could not be checkpointed.
Real FSDP2 on gloo, real DCP files; torchtitan's own Llama3 where torchtitan is importable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sharded_hook_workers import train_fused, train_titan

from slurm_guard.local.launch import run_local

pytestmark = pytest.mark.distributed

NODES = ["n0", "n1"]


def _ok(outcomes: list[Any]) -> list[dict[str, Any]]:
    assert [o.status for o in outcomes] == ["ok"] * len(outcomes), [o.value for o in outcomes]
    return [o.value for o in outcomes]


def _save_then_resume(train: Any, run_dir: Path, steps: int, save_at: int) -> list[Any]:
    """Train with a save, resume from it in a fresh job; return (full, resumed) per rank."""
    full = _ok(run_local(train, 2, args=(str(run_dir), steps, save_at, False), nodes=NODES))
    meta = json.loads((run_dir / "checkpoints" / f"step-{save_at:08d}" / "meta.json").read_text())
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(meta["files"])
    resumed = _ok(run_local(train, 2, args=(str(run_dir), steps, save_at, True), nodes=NODES))
    for a, b in zip(full, resumed, strict=True):
        assert b["start"] == save_at
        assert b["losses"] == a["losses"][save_at:]  # bit for bit
        assert b["digest"] == a["digest"]
    return list(zip(full, resumed, strict=True))


def test_a_model_whose_hooks_rename_keys_saves_and_resumes_bit_identical(tmp_path: Path) -> None:
    pairs = _save_then_resume(train_fused, tmp_path, 5, 3)
    for _, resumed in pairs:
        # the resume read the parameters themselves: the hooks (which gather) never ran
        assert resumed["hook_calls"] == {"split": 0, "merge": 0}


def test_torchtitan_llama3_with_fused_qkv_saves_and_resumes_bit_identical(tmp_path: Path) -> None:
    pytest.importorskip(
        "torchtitan.models.llama3",
        reason="torchtitan 0.3.0 is not installed (it needs spmd_types, tyro and triton)",
    )
    _save_then_resume(train_titan, tmp_path, 4, 2)
