"""Checked GEMMs under tensor parallel: each rank checks its own shard's product.

Real gloo processes, the model laid out with torch's `parallelize_module` as torchtitan's plan
does (tests/abft_tp_workers.py). What must hold: a checked clean run computes bit for bit what
the unchecked one does (the DTensor outputs keep their placements); a GEMM fault on one rank is
found on that rank only; a layout the local check cannot verify is refused by name; no kernel
receives a DTensor, and no rank dies of a signal.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from abft_tp_workers import refusals, unchecked_checked_faulty

from slurm_guard.local.launch import run_local


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"], strict=True)) and all(
        torch.equal(a["shards"][name], b["shards"][name]) for name in a["shards"]
    )


@pytest.mark.distributed
def test_fsdp2_tp_2x2_checks_local_shards_bit_identical_and_names_the_faulty_rank() -> None:
    # dp=2 x tp=2, the C passes; rank 3's rowwise `down` grad_x is wrong at step 1
    fault = "kind=gemm,rank=3,step=1,layer=1,pass=grad_x,factor=1"
    outcomes = run_local(unchecked_checked_faulty, 4, args=(2, 2, fault))
    assert [o.status for o in outcomes] == ["ok"] * 4, [o.value for o in outcomes]
    for rank, o in enumerate(outcomes):
        runs = o.value
        assert _same(runs["unchecked"], runs["checked"]), rank
        assert runs["checked"]["failures"] == [[], [], []], rank
        assert all(0 <= w < 0.2 for w in runs["checked"]["worst"]), runs["checked"]["worst"]
        expected = [[], [("down", "grad_x")], []] if rank == 3 else [[], [], []]
        assert runs["faulty"]["failures"] == expected, (rank, runs["faulty"]["failures"])


@pytest.mark.distributed
def test_tp_torch_path_bit_identical_and_unverifiable_layouts_refused_by_name() -> None:
    # tp=2 alone, the torch-op checks (what CUDA runs without Triton)
    fault = "kind=gemm,rank=0,step=2,layer=4,pass=fwd,factor=1"
    env = {"SLURM_GUARD_NATIVE": "0"}
    outcomes = run_local(unchecked_checked_faulty, 2, args=(1, 2, fault), extra_env=env)
    assert [o.status for o in outcomes] == ["ok"] * 2, [o.value for o in outcomes]
    for rank, o in enumerate(outcomes):
        runs = o.value
        assert _same(runs["unchecked"], runs["checked"]), rank
        assert runs["checked"]["failures"] == [[], [], []], rank
        expected = [[], [], [("head", "fwd")]] if rank == 0 else [[], [], []]
        assert runs["faulty"]["failures"] == expected, (rank, runs["faulty"]["failures"])
    outcomes = run_local(refusals, 2)
    assert [o.status for o in outcomes] == ["ok"] * 2, [o.value for o in outcomes]
    for o in outcomes:
        assert o.value["attach"].startswith("ShardLayoutError: abft: layer '0'"), o.value
        assert "placed P(sum)" in o.value["attach"]
        forward = o.value["forward"]
        assert forward.startswith("ShardLayoutError: abft: layer ''"), forward
        assert "R x S0 -> P" in forward, forward
        for error in o.value["kernels"]:
            assert error.startswith("KernelInputError:") and "DTensor" in error, error
