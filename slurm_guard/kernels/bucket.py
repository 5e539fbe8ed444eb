"""Which implementation of the fused bucket check runs where (see `sketch` for its definition).

Kept apart from `sketch` (the definition, the torch spec, the C kernel) and `triton_kernels`
(which builds on `sketch`), so that neither imports the other back.
"""

from __future__ import annotations

import torch

from slurm_guard.kernels.sketch import (
    DIVIDABLE,
    DTYPES,
    divide,
    native,
    native_check,
    reference_check,
)
from slurm_guard.kernels.triton_kernels import available, triton_check


def bucket_check(
    bucket: torch.Tensor, words: tuple[int, int], *, l1: bool = True, divide_by: int = 1
) -> torch.Tensor:
    """float64 [S, A, nonfinite] of a bucket, on its device, by the fastest implementation here.

    CPU: the C kernel (torch spec when it cannot be built or the dtype is not a float type it
    reads). CUDA: the Triton kernel when Triton is installed, the torch spec otherwise.
    l1=False: the sketch-only variant, [S, 0.0, nonfinite of S] (see `kernels.sketch`).
    divide_by > 1: divide the bucket in place first (IEEE division, `sketch.divide`) and check
    the quotient; the C and Triton kernels do both in one read of the bucket.
    """
    fused = divide_by == 1 or (bucket.dtype in DIVIDABLE and bucket.is_contiguous())
    if bucket.dtype in DTYPES and fused:
        if bucket.device.type == "cpu":
            kernel = native()
            if kernel is not None:
                return native_check(kernel, bucket, words, l1=l1, divide_by=divide_by)
        elif bucket.is_cuda and available(bucket.device):
            return triton_check(bucket, words, l1=l1, divide_by=divide_by)
    divide(bucket, divide_by)
    return reference_check(bucket, words, l1=l1)


def backend(device: torch.device) -> str:
    """'native', 'triton' or 'torch': what `bucket_check` uses for a float32 bucket there."""
    if device.type == "cpu":
        return "native" if native() is not None else "torch"
    return "triton" if device.type == "cuda" and available(device) else "torch"
