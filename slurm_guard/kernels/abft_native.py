"""The C checksum passes of checked GEMMs (`abft_check.c`) and their ctypes binding.

Why native: a checked GEMM needs, per product, the block sums and squared norms of one operand
and the block sums of the product, compared against a bound. As torch ops that is ~90 small
calls per layer and step, whose Python and dispatch cost alone exceeds the cost goal on a small
model; here it is two calls per product, each one read of a tensor. The torch implementation in
`slurm_guard.abft.checked` stays the specification and the fallback (CUDA, other dtypes,
SLURM_GUARD_NATIVE=0, no compiler); `tests/test_abft_native.py` holds the two to each other.

Only float32, contiguous, CPU tensors go through here; callers check with `eligible`.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import torch

from slurm_guard.kernels import native as _kernels

C_SOURCE = "abft_check.c"


def kernel_defines() -> dict[str, int]:
    return {}


class _Native:
    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self.stats = lib.sg_abft_stats
        self.stats.argtypes = [p, i64, i64, i64, p, p, p, p, p, p, p, p]
        self.stats.restype = ctypes.c_int
        self.compare = lib.sg_abft_compare
        self.compare.argtypes = [p, i64, i64, i64, p, p, p, p, p, p]
        self.compare.restype = ctypes.c_double


_lock = threading.Lock()
_native: _Native | None = None
_tried = False


def native() -> _Native | None:
    """The compiled kernel, built on first use (cached on disk); None if it cannot be built or
    SLURM_GUARD_NATIVE=0."""
    global _native, _tried
    if not _tried:
        with _lock:
            if not _tried:
                lib = _kernels.load(C_SOURCE, kernel_defines())
                _native = _Native(lib) if lib is not None else None
                _tried = True
    return _native


def eligible(t: torch.Tensor) -> bool:
    """Whether the C passes read this tensor as it is (float32, CPU, contiguous)."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


@dataclass
class Stats:
    """What one pass over an operand A (n, d) yields (see `stats`); None where not asked for.

    `rows` (B, d) float32: row-block sums, the checksum GEMM's left operand. `norms` float64
    holds a_sq (B,), s_sq (B,), col_sq (d,) and, with column blocks, ca_sq and cs_sq (C,) at
    the offsets below, so one allocation serves them all. `cols` (n, C) float32: column-block
    sums, the left operand (transposed) of the weight-gradient check.
    """

    rows: torch.Tensor | None
    norms: torch.Tensor
    cols: torch.Tensor | None
    n_blocks: int
    n_col_blocks: int
    width: int

    def ptr(self, name: str) -> int:
        """Address of one of a_sq, s_sq, col_sq, ca_sq, cs_sq inside `norms`."""
        b, c, d = self.n_blocks, self.n_col_blocks, self.width
        offset = {"a_sq": 0, "s_sq": b, "col_sq": 2 * b, "ca_sq": 2 * b + d, "cs_sq": 2 * b + d + c}
        return self.norms.data_ptr() + 8 * offset[name]

    def col_sq(self) -> torch.Tensor:
        b, d = self.n_blocks, self.width
        return self.norms[2 * b : 2 * b + d]


def stats(kernel: _Native, a: torch.Tensor, block: int, rows: bool, cols: bool) -> Stats:
    """One read of A (n, d): squared norms always; row-block sums (with a_sq, s_sq) if `rows`;
    column-block sums (with ca_sq, cs_sq) if `cols`. A must be `eligible`."""
    n, d = a.shape
    nb = -(-n // block) if rows else 0
    nc = -(-d // block) if cols else 0
    norms = torch.empty(2 * nb + d + 2 * nc, dtype=torch.float64)
    rsum = torch.empty(nb, d, dtype=torch.float32) if rows else None
    csum = torch.empty(n, nc, dtype=torch.float32) if cols else None
    out = Stats(rsum, norms, csum, nb, nc, d)
    rc = kernel.stats(
        a.data_ptr(),
        n,
        d,
        block,
        rsum.data_ptr() if rsum is not None else None,
        out.ptr("a_sq") if rows else None,
        out.ptr("s_sq") if rows else None,
        out.ptr("col_sq"),
        None,
        csum.data_ptr() if csum is not None else None,
        out.ptr("cs_sq") if cols else None,
        out.ptr("ca_sq") if cols else None,
    )
    if rc != 0:
        raise MemoryError(f"abft stats kernel failed with code {rc}")
    return out


def weight_norms(kernel: _Native, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(squared row norms (R,), squared column norms (C,)) of a stored weight (R, C), float64,
    in one read. W must be `eligible`."""
    r, c = w.shape
    norms = torch.empty(r + c, dtype=torch.float64)
    base = norms.data_ptr()
    rc = kernel.stats(
        w.data_ptr(), r, c, 32, None, None, None, base + 8 * r, base, None, None, None
    )
    if rc != 0:
        raise MemoryError(f"abft weight-norm kernel failed with code {rc}")
    return norms[:r], norms[r:]


def compare(
    kernel: _Native,
    out: torch.Tensor,
    block: int,
    pred: torch.Tensor,
    bias: torch.Tensor | None,
    a_sq: int,
    s_sq: int,
    m_sq: torch.Tensor,
    factors: ctypes.Array[ctypes.c_double],
) -> float:
    """Largest (residual / bound)^2 of the product `out` (R, p) against `pred` (ceil(R/block), p)
    (+ n_b bias), +inf when any is NaN. a_sq, s_sq: addresses of float64 (B,) vectors (see
    `Stats.ptr`); m_sq (p,) float64; factors: the bound's five numbers
    (`slurm_guard.abft.bounds.Factors.native`). out, pred and bias must be `eligible`."""
    r, p = out.shape
    return float(
        kernel.compare(
            out.data_ptr(),
            r,
            p,
            block,
            pred.data_ptr(),
            bias.data_ptr() if bias is not None else None,
            a_sq,
            s_sq,
            m_sq.data_ptr(),
            factors,
        )
    )
