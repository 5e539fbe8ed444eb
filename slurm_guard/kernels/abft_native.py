"""The C checksum passes of checked GEMMs (`abft_check.c`) and their ctypes binding.

Why native: a checked GEMM needs, per product, the signed block sums and squared norms of one
operand and the signed block sums of the product, compared against a bound. As torch ops that
is ~90 small calls per layer and step, whose Python and dispatch cost alone exceeds the cost
goal on a small model; here it is two calls per product, each one read of a tensor. The torch
implementation in `slurm_guard.abft.checked` stays the specification and the fallback (CUDA,
other dtypes, SLURM_GUARD_NATIVE=0, no compiler); `tests/test_abft_native.py` holds the two to
each other.

Only float32, contiguous, CPU tensors go through here; callers check with `eligible`.
"""

from __future__ import annotations

import ctypes

import torch

from slurm_guard.kernels import native as _kernels
from slurm_guard.kernels.inputs import plain

C_SOURCE = "abft_check.c"


def kernel_defines() -> dict[str, int]:
    from slurm_guard.abft.bounds import SUM_GROUP  # (abft imports this module)

    return {"SUM_GROUP": SUM_GROUP}


class _Native:
    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self.stats = lib.sg_abft_stats
        self.stats.argtypes = [p, i64, i64, i64, p, p, p, p, p, p, p, p, p]
        self.stats.restype = ctypes.c_int
        self.weight_norms = lib.sg_abft_weight_norms
        self.weight_norms.argtypes = [p, i64, i64, p, p]
        self.weight_norms.restype = ctypes.c_int
        self.compare = lib.sg_abft_compare
        self.compare.argtypes = [p, i64, i64, i64, p, p, p, p, p, p, p]
        self.compare.restype = ctypes.c_double
        self.compare_t = lib.sg_abft_compare_t
        self.compare_t.argtypes = [p, i64, i64, i64, p, p, p, p, p, p]
        self.compare_t.restype = ctypes.c_double


native = _kernels.LazyKernel(C_SOURCE, kernel_defines, _Native)
"""The compiled kernel, built on first use (cached on disk); None if it cannot be built or
SLURM_GUARD_NATIVE=0."""


def eligible(t: torch.Tensor) -> bool:
    """Whether the C passes read this tensor as it is (float32, CPU, contiguous)."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


class Stats:
    """What one pass over an operand A (n, d) yields (see `stats`); None where not asked for.

    `rows` (B, d) float32: signed row-block sums (float64, rounded), the checksum GEMM's left
    operand. `norms` float64 holds a_sq (B,), s_sq (B,), col_sq (d,) and, with column blocks,
    ca_sq and cs_sq (C,), so one allocation serves them all; `a_sq`, `s_sq`, `ca_sq`, `cs_sq`
    are their addresses (what `compare` takes). `cols` (n, C) float32: signed column-block sums,
    the left operand (transposed) of the weight-gradient check.
    """

    __slots__ = ("_b", "a_sq", "ca_sq", "cols", "cs_sq", "norms", "rows", "s_sq", "width")

    def __init__(self, n: int, d: int, block: int, rows: bool, cols: bool) -> None:
        nb = -(-n // block) if rows else 0
        nc = -(-d // block) if cols else 0
        self.norms = torch.empty(2 * nb + d + 2 * nc, dtype=torch.float64)
        self.rows = torch.empty(nb, d, dtype=torch.float32) if rows else None
        self.cols = torch.empty(n, nc, dtype=torch.float32) if cols else None
        base = self.norms.data_ptr()
        self.a_sq, self.s_sq = base, base + 8 * nb
        self.ca_sq, self.cs_sq = base + 8 * (2 * nb + d), base + 8 * (2 * nb + d + nc)
        self.width, self._b = d, nb

    def col_sq(self) -> torch.Tensor:
        b = self._b
        return self.norms[2 * b : 2 * b + self.width]


def stats(
    kernel: _Native,
    a: torch.Tensor,
    block: int,
    row_sign: torch.Tensor | None,
    col_sign: torch.Tensor | None,
) -> Stats:
    """One read of A (n, d): squared norms always; with `row_sign` (n,) the signed row-block sums
    (with a_sq, s_sq); with `col_sign` (d,) the signed column-block sums (with ca_sq, cs_sq).
    A and the signs (float32 +-1, `checked.signs`) must be `eligible`."""
    plain("abft_native.stats", a, row_sign, col_sign, cpu=True)
    n, d = a.shape
    rows, cols = row_sign is not None, col_sign is not None
    out = Stats(n, d, block, rows, cols)
    rc = kernel.stats(
        a.data_ptr(),
        n,
        d,
        block,
        row_sign.data_ptr() if row_sign is not None else None,
        col_sign.data_ptr() if col_sign is not None else None,
        out.rows.data_ptr() if out.rows is not None else None,
        out.a_sq if rows else None,
        out.s_sq if rows else None,
        out.a_sq + 16 * out._b,  # col_sq
        out.cols.data_ptr() if out.cols is not None else None,
        out.cs_sq if cols else None,
        out.ca_sq if cols else None,
    )
    if rc != 0:
        raise MemoryError(f"abft stats kernel failed with code {rc}")
    return out


def weight_norms(kernel: _Native, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(squared row norms (R,), squared column norms (C,)) of a stored weight (R, C), float64,
    in one read. W must be `eligible`."""
    plain("abft_native.weight_norms", w, cpu=True)
    r, c = w.shape
    norms = torch.empty(r + c, dtype=torch.float64)
    base = norms.data_ptr()
    rc = kernel.weight_norms(w.data_ptr(), r, c, base, base + 8 * r)
    if rc != 0:
        raise MemoryError(f"abft weight-norm kernel failed with code {rc}")
    return norms[:r], norms[r:]


def compare(
    kernel: _Native,
    out: torch.Tensor,
    block: int,
    sign: torch.Tensor,
    pred: torch.Tensor,
    bias: torch.Tensor | None,
    a_sq: int,
    s_sq: int,
    m_sq: torch.Tensor,
    factors: ctypes.Array[ctypes.c_double],
) -> float:
    """Largest (residual / bound)^2 of the product `out` (R, p), rows weighted by `sign` (R,),
    against `pred` (ceil(R/block), p) (+ the block's sign sum times bias), +inf when any is NaN
    or a bound overflowed. a_sq, s_sq: addresses of float64
    (B,) vectors (`Stats.a_sq` and `Stats.s_sq`); m_sq (p,) float64; factors: the bound's five
    numbers (`slurm_guard.abft.bounds.Factors.native`). out, pred and bias must be `eligible`."""
    plain("abft_native.compare", out, sign, pred, bias, m_sq, cpu=True)
    r, p = out.shape
    return float(
        kernel.compare(
            out.data_ptr(),
            r,
            p,
            block,
            sign.data_ptr(),
            pred.data_ptr(),
            bias.data_ptr() if bias is not None else None,
            a_sq,
            s_sq,
            m_sq.data_ptr(),
            factors,
        )
    )


def compare_transposed(
    kernel: _Native,
    out_t: torch.Tensor,
    block: int,
    sign: torch.Tensor,
    pred: torch.Tensor,
    a_sq: int,
    s_sq: int,
    m_sq: torch.Tensor,
    factors: ctypes.Array[ctypes.c_double],
) -> float:
    """`compare` for a product held transposed: `out_t` (R, C) contiguous is the checked
    product's transpose, pred (ceil(C/block), R) its predicted row-block checksums (no bias),
    sign (C,) the signs of the checked product's rows (out_t's columns)."""
    plain("abft_native.compare_transposed", out_t, sign, pred, m_sq, cpu=True)
    r, c = out_t.shape
    return float(
        kernel.compare_t(
            out_t.data_ptr(),
            r,
            c,
            block,
            sign.data_ptr(),
            pred.data_ptr(),
            a_sq,
            s_sq,
            m_sq.data_ptr(),
            factors,
        )
    )
