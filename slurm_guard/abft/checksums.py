"""The checksum passes of a checked GEMM: signed block sums, their comparison with the bound.

`checked.py` runs the three checked products of a layer; this module computes what each check
compares: the signed row-block sums of an operand, the product's own block sums, and the largest
residual over its rounding bound, in torch ops or in the one-pass C and Triton kernels
(`FusedCheck`). Everything stays on the tensor's device.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from slurm_guard.abft.bounds import (
    SUM_GROUP,
    Factors,
    check_dtype,
    residual_bound,
    roundoff,
)
from slurm_guard.abft.site import (
    GRAD_W,
    HALF,
    Passes,
    Site,
    squares_into_scratch,
)
from slurm_guard.kernels import abft_native as nk
from slurm_guard.kernels import abft_triton as at


@contextlib.contextmanager
def no_autocast(device: torch.device) -> Iterator[None]:
    """Checksums stay in float32/float64 even inside an autocast region."""
    if torch.is_autocast_enabled(device.type):
        with torch.autocast(device.type, enabled=False):
            yield
    else:
        yield


NO_CONTEXT = contextlib.nullcontext()

Rows = float | torch.Tensor  # rows per checksum block: one number when all blocks are equal

SIGN_HASH = 0x9E3779B9  # 2^32 / golden ratio


@functools.lru_cache(maxsize=64)
def signs(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The sign (+1 or -1) of each of n rows in its block's checksum: -1 where the top bit of
    (i * SIGN_HASH) mod 2^32 is set. A Weyl sequence: any run of rows has about as many of each,
    so rows that share an offset cancel it in the checksum instead of adding it up. The C passes
    read the same signs (float32, CPU). Made on the device itself: an upload from the host
    would synchronise a CUDA stream for every new row count."""
    i = torch.arange(n, dtype=torch.int64, device=device)
    top = ((i * SIGN_HASH) & 0xFFFFFFFF) >> 31
    return (1 - 2 * top).to(dtype=dtype)


def _rows(n: int, block: int, like: torch.Tensor) -> Rows:
    """Rows per block (the bound's n_b): one number when all blocks are equal, else (B,)."""
    if n % block == 0 or n < block:
        return float(min(n, block))
    full = n // block
    out = torch.full((full + 1,), float(block), dtype=like.dtype, device=like.device)
    out[-1] = n - full * block
    return out


def _blocks(t: torch.Tensor, block: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sums of consecutive blocks of `block` rows of a 2-D tensor, accumulated in `dtype`
    (default: its own); a ragged last block is a block of its own."""
    n, d = t.shape
    if n <= block:
        return t.sum(0, keepdim=True, dtype=dtype)
    full = n // block
    sums = t[: full * block].reshape(full, block, d).sum(1, dtype=dtype)
    if full * block == n:
        return sums
    return torch.cat([sums, t[full * block :].sum(0, keepdim=True, dtype=dtype)])


def row_sums(t: torch.Tensor, block: int) -> torch.Tensor:
    """Block sums of a 2-D tensor's rows in the check dtype (norms: squares, unsigned)."""
    return _blocks(t.to(check_dtype(t.dtype)), block)


def block_checksums(t: torch.Tensor, block: int) -> torch.Tensor:
    """The checksum rows of a 2-D tensor: its rows times their `signs` (exact in any float
    dtype), summed per block of `block` rows in float64 (B, d), in the summation model of the C
    passes (`bounds.SUM_GROUP`): float32 partial sums of 4 consecutive rows, added in float64.
    A quarter of the float64 work, and no float64 copy of the tensor (on CUDA this path is what
    runs). Blocks that are not a whole number of groups are summed in float64 directly."""
    n, d = t.shape
    signed = t * signs(n, t.dtype, t.device)[:, None]
    if block % SUM_GROUP or signed.dtype == torch.float64 or n < SUM_GROUP:
        return _blocks(signed, block, torch.float64)
    padded = -(-n // SUM_GROUP) * SUM_GROUP
    if padded != n:  # zero rows: exact, and they stay inside the last block
        signed = torch.nn.functional.pad(signed, (0, 0, 0, padded - n))
    partial = signed.reshape(padded // SUM_GROUP, SUM_GROUP, d).sum(1, dtype=check_dtype(t.dtype))
    return _blocks(partial, block // SUM_GROUP, torch.float64)


def col_checksums(t: torch.Tensor, block: int) -> torch.Tensor:
    """`block_checksums` of t's transpose, transposed back: (rows, blocks) float64."""
    return block_checksums(t.t(), block).t()


def _sign_sums(n: int, block: int, like: torch.Tensor) -> torch.Tensor:
    """(B,) float64: each block's sum of signs, the multiple of the bias its checksum holds."""
    return _blocks(signs(n, torch.float64, like.device)[:, None], block)[:, 0]


def check_product(
    site: Site,
    q: int,
    out_sums: torch.Tensor,
    a_sums: torch.Tensor,
    a_sq: torch.Tensor,
    m: torch.Tensor,
    m_sq: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    which: int,
) -> torch.Tensor:
    """(residual / bound)^2 per block and column of one product out = A M (+ bias): out_sums and
    a_sums (B, .) float64 the checksum rows (`block_checksums`) of out and A, a_sq (B,) the blocks'
    squared Frobenius norms, m_sq (p,) M's squared column norms, q the reduction length, out the
    product itself (2-D). Left on the device; `Abft.collect` reduces a whole step's at once.

    A NaN residual (a NaN or Inf out of the GEMM) gives NaN, which `collect` counts as a failed
    check. Non-finite inputs make one too: the guard judges non-finite values with its finite
    check (and replays) first, so a bad sample stays `numerical`."""
    dtype = out.dtype
    cdt = check_dtype(dtype)
    f64 = torch.float64
    block = site.block_for(dtype)
    # the checksum GEMM in the check dtype: its input, the float64 sums, rounded once
    predicted = (a_sums.to(cdt) @ (m if m.dtype == cdt else m.to(cdt))).to(f64)
    bias_sq = None
    if bias is not None:
        sign_sums = _sign_sums(out.shape[0], block, out)
        predicted.addcmul_(sign_sums[:, None], bias.to(f64)[None, :])
        bias_sq = site.bias_sq(bias)
    out_sq = row_sums(squares_into_scratch(out), block).to(f64) if dtype in HALF else None
    rows = _rows(out.shape[0], block, predicted)
    s_sq = a_sums.square().sum(1)
    r = roundoff(dtype, m.device)
    bound2 = residual_bound(
        q, rows, a_sq.to(f64), s_sq, m_sq.to(f64), bias_sq, r, site.margin, out_sq
    )
    if site.probe is not None and site.probe.get("which") == which and "bound2" not in site.probe:
        site.probe["bound2"] = bound2.detach().clone()
    ratio = predicted.sub_(out_sums).square_().div_(bound2)
    # a bound that overflowed (operands near the dtype's range) verifies nothing: fail closed
    return ratio.masked_fill_(torch.isinf(bound2), math.inf)


def check_weight_grad(
    site: Site,
    p: torch.Tensor,
    p_col_sq: torch.Tensor,
    q: torch.Tensor,
    q_col_sq: torch.Tensor,
    grad: torch.Tensor,
) -> torch.Tensor:
    """grad = P^T Q (stored layout, rows blocked): the columns of P are the checksum rows.

    For nn.Linear P = g, Q = x (grad of weight (out, in)); for Conv1D P = x, Q = g. The
    reduction runs over the n rows of the step's tokens.
    """
    block = site.block_for(grad.dtype)
    a_sums = col_checksums(p, block).t()  # (R, n)
    a_sq = row_sums(p_col_sq.unsqueeze(1), block)[:, 0]
    out_sums = block_checksums(grad, block)
    return check_product(site, p.shape[0], out_sums, a_sums, a_sq, q, q_col_sq, None, grad, GRAD_W)


def x_blocked(k: int, p: int) -> bool:
    """Whether the weight-gradient check's checksum rows run along x's width k (column blocks
    of x) rather than g's width p: along the longer side, which gives the checksum GEMM more
    rows (a much faster GEMM shape) for the same FLOPs. Both implementations follow it."""
    return k > p


def stored_is_checked(kind: str, k: int, p: int) -> bool:
    """Whether the weight gradient in its stored layout (g^T x for nn.Linear, x^T g for Conv1D)
    is the product the check blocks (else its transpose is), for input width k, output width p."""
    return x_blocked(k, p) == (kind == "addmm")


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def native_stats(kernel: Passes, a: torch.Tensor, block: int, rows: bool, cols: bool) -> Any:
    """One pass over a 2-D operand (`abft_native.stats` or `abft_triton.stats`) with the row
    and/or column signs of `signs`."""
    n, d = a.shape
    row_sign = signs(n, torch.float32, a.device) if rows else None
    col_sign = signs(d, torch.float32, a.device) if cols else None
    if isinstance(kernel, nk._Native):
        return nk.stats(kernel, _contiguous(a), block, row_sign, col_sign)
    return at.stats(_contiguous(a), block, row_sign, col_sign)


def compare_blocks(
    kernel: Passes,
    out: torch.Tensor,
    block: int,
    pred: torch.Tensor,
    bias: torch.Tensor | None,
    st: Any,
    m_sq: torch.Tensor,
    f: Factors,
) -> float | torch.Tensor:
    """The check of a product whose rows are blocked (`abft_native.compare`): a number from
    the C pass, a 0-dim device tensor from the Triton one (no host read per check)."""
    sign = signs(out.shape[0], torch.float32, out.device)
    out, b = _contiguous(out), None if bias is None else _contiguous(bias)
    if isinstance(kernel, nk._Native):
        return nk.compare(kernel, out, block, sign, pred, b, st.a_sq, st.s_sq, m_sq, f.native)
    factors_t = at.factors_on(f.numbers, out.device)
    return at.compare(out, block, sign, pred, b, st.a_sq, st.s_sq, m_sq, factors_t)


def _compare_transposed(
    kernel: Passes,
    out_t: torch.Tensor,
    block: int,
    pred: torch.Tensor,
    st: Any,
    m_sq: torch.Tensor,
    f: Factors,
) -> float | torch.Tensor:
    """`compare_blocks` for a product held transposed (its row blocks are out_t's column blocks)."""
    sign = signs(out_t.shape[1], torch.float32, out_t.device)
    out_t = _contiguous(out_t)
    if isinstance(kernel, nk._Native):
        args = (st.ca_sq, st.cs_sq, m_sq, f.native)
        return nk.compare_transposed(kernel, out_t, block, sign, pred, *args)
    factors_t = at.factors_on(f.numbers, out_t.device)
    return at.compare_transposed(out_t, block, sign, pred, st.ca_sq, st.cs_sq, m_sq, factors_t)


@dataclass(frozen=True)
class RowBlocks:
    """The bound's per-block norms of a checksum operand, under the names `compare_blocks` reads."""

    a_sq: Any
    s_sq: Any


class FusedCheck:
    """One layer's checks by the one-pass kernels (C on the CPU, Triton on CUDA), in cache
    order: each operand is read right before the GEMM that reads it too, each product right
    after the GEMM that wrote it (a pass over a cold multi-megabyte tensor costs several times
    one over a hot one).

    Forward: one read of x (its block sums and norms, and its column-block sums for Conv1D's
    weight-gradient check), the checksum GEMM in torch, one read of y. Backward: one read of g
    (block sums, norms, and its column-block sums for nn.Linear's weight-gradient check), then
    per product the checksum GEMM and one read of the product. x's statistics are kept from
    the forward for the weight-gradient check."""

    @staticmethod
    def before_forward(kernel: Passes, site: Site, x2: torch.Tensor, m: torch.Tensor) -> Any:
        cols = x_blocked(x2.shape[1], m.shape[1])
        st = native_stats(kernel, x2, site.block, rows=True, cols=cols)
        site.weight_norms(m, kernel)
        return st

    @staticmethod
    def forward(
        kernel: Passes,
        site: Site,
        st: Any,
        m: torch.Tensor,
        bias: torch.Tensor | None,
        y: torch.Tensor,
    ) -> float | torch.Tensor:
        col_sq, _ = site.weight_norms(m, kernel)
        assert st.rows is not None
        pred = torch.mm(st.rows, m)
        f = site.factors(m.shape[0], min(y.shape[0], site.block), y)
        return compare_blocks(kernel, y, site.block, pred, bias, st, col_sq, f)

    @staticmethod
    def grad_x(
        kernel: Passes, site: Site, st: Any, m: torch.Tensor, grad_x: torch.Tensor
    ) -> float | torch.Tensor:
        _, row_sq = site.weight_norms(m, kernel)
        assert st.rows is not None
        pred = torch.mm(st.rows, m.t())
        f = site.factors(m.shape[1], min(grad_x.shape[0], site.block), grad_x)
        return compare_blocks(kernel, grad_x, site.block, pred, None, st, row_sq, f)

    @staticmethod
    def grad_w(
        kernel: Passes,
        site: Site,
        g_stats: Any,
        x_stats: Any,
        g: torch.Tensor,
        x2: torch.Tensor,
        stored: torch.Tensor,
    ) -> float | torch.Tensor:
        """grad = P^T Q: the column blocks of P are the checksum rows, P = x (rows of x^T g)
        or P = g (rows of g^T x) as `x_blocked` says; the stored layout holds that product
        (g^T x for nn.Linear, x^T g for Conv1D) or its transpose."""
        n, k = x2.shape
        by_x = x_blocked(k, g.shape[1])
        if x_stats is None or (by_x and x_stats.cols is None):
            x_stats = native_stats(kernel, x2, site.block, rows=False, cols=by_x)
        if by_x:
            p_stats, q, q_col_sq = x_stats, g, g_stats.col_sq()
        else:
            p_stats, q, q_col_sq = g_stats, x2, x_stats.col_sq()
        assert p_stats.cols is not None
        pred = torch.mm(p_stats.cols.t(), q)
        product_rows = k if by_x else g.shape[1]
        f = site.factors(n, min(product_rows, site.block), stored)
        if stored_is_checked(site.kind, k, g.shape[1]):
            st = RowBlocks(p_stats.ca_sq, p_stats.cs_sq)
            return compare_blocks(kernel, stored, site.block, pred, None, st, q_col_sq, f)
        return _compare_transposed(kernel, stored, site.block, pred, p_stats, q_col_sq, f)
