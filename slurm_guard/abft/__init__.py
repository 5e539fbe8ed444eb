"""Checked GEMMs (algorithm-based fault tolerance): every Linear checked on every step.

Replay samples one step in K, and a one-off wrong value on an unverified step that reaches every
replica the same way is invisible to it. Matrix multiplies are nearly all of a transformer's
FLOPs, and each can be checked on the step it runs, forward and backward, for the price of a few
passes over its operands and a GEMM `block` times smaller: see `checked.py` for the checksums,
`bounds.py` for the rounding bound they are compared with, `wrap.py` for which layers are
checked, `coverage.py` for the share of the model's matmul FLOPs that is.

    handle = attach(model)              # or GuardConfig(abft=True) under the Guard
    loss_fn(model, batch).backward()
    failures = handle.findings(handle.collect())
"""

from __future__ import annotations

from slurm_guard.abft.bounds import Roundoff, residual_bound, roundoff, unit_roundoff
from slurm_guard.abft.checked import CheckedGemm
from slurm_guard.abft.coverage import Coverage, measure_coverage
from slurm_guard.abft.shards import ShardLayoutError
from slurm_guard.abft.site import FWD, GRAD_W, GRAD_X, PASSES, Site
from slurm_guard.abft.wrap import Abft, Finding, attach, is_conv1d

__all__ = [
    "FWD",
    "GRAD_W",
    "GRAD_X",
    "PASSES",
    "Abft",
    "CheckedGemm",
    "Coverage",
    "Finding",
    "Roundoff",
    "ShardLayoutError",
    "Site",
    "attach",
    "is_conv1d",
    "measure_coverage",
    "residual_bound",
    "roundoff",
    "unit_roundoff",
]
