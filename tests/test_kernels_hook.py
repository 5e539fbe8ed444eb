"""The communication hook with its fused kernel on real gloo processes.

fp16/bf16 buckets are divided by the world size before the all-reduce, as in DDP's default hook:
a bucket whose sum overflows float16 but whose mean does not must stay finite (otherwise the
guard would report `finite_reduced` where plain DDP trains on).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from slurm_guard.checks.comm_hook import HookState, SignVectors, guard_comm_hook
from slurm_guard.fingerprint.tree import Fingerprinter
from slurm_guard.kernels import bucket as kb
from slurm_guard.kernels import sketch as sk
from slurm_guard.local.launch import run_local

pytestmark = pytest.mark.distributed

BIG = 40_000.0  # fits float16 (max 65504); twice it does not


def _fp16_worker(hooked: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1, bias=False).half()
    with torch.no_grad():
        model.weight.fill_(1.0)
    ddp = DDP(model)
    state = HookState(
        group=None,
        world_size=dist.get_world_size(),
        fingerprinter=Fingerprinter(7),
        signs=SignVectors(7),
        param_index={id(p): i for i, p in enumerate(model.parameters())},
    )
    if hooked:
        ddp.register_comm_hook(state, guard_comm_hook)
    x = torch.full((1, 1), BIG, dtype=torch.float16)  # d(sum(w x))/dw = x on every rank
    ddp(x).sum().backward()
    grad = model.weight.grad
    assert grad is not None
    reduced = [state.reduced_sketches[i] for i in sorted(state.reduced_sketches)]
    return {
        "grad": float(grad.float().reshape(-1)[0]),
        "local": [float(s) for s in state.local_sketches],
        "l1": [float(a) for a in state.local_l1],
        "reduced": [float(s) for s in reduced],
    }


@pytest.mark.parametrize("hooked", [False, True], ids=["plain-ddp", "guard-hook"])
def test_fp16_bucket_whose_sum_overflows_stays_finite_as_in_plain_ddp(hooked: bool) -> None:
    outcomes = run_local(_fp16_worker, 2, (hooked,), timeout=120)
    assert [o.status for o in outcomes] == ["ok", "ok"], [o.value for o in outcomes]
    for o in outcomes:
        assert o.value["grad"] == BIG  # (BIG/2 + BIG/2), never inf
        if hooked:
            assert [abs(s) for s in o.value["local"]] == [BIG]  # one bucket, sign +-1
            assert o.value["l1"] == [BIG]
            assert o.value["reduced"] == o.value["local"]  # conserved exactly here


def test_fp16_sum_of_the_same_bucket_overflows_without_pre_division() -> None:
    """The teeth of the test above: summing first, as the hook used to, gives inf."""
    a = torch.tensor([BIG], dtype=torch.float16)
    assert torch.isinf(a + a).all()
    assert torch.isfinite(a / 2 + a / 2).all()
    # and the fused check sees such an inf as non-finite
    assert kb.bucket_check(a + a, sk.seed_words(7))[2].item() == 1.0
