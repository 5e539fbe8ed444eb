"""The checksum passes of checked GEMMs in Triton: what `abft_check.c` does on the CPU, for
float32 CUDA tensors (and CPU tensors under the interpreter, which is how CI tests them).

Why: the torch-op checks (`slurm_guard.abft.checked`, the specification) launch about a hundred
small kernels per layer and step, each with its Python and dispatch cost; on a GPU that launch
cost, not the arithmetic, is what a checked step pays. Here an operand is one or two launches
(its signed row-block sums and norms, and for the weight-gradient check its signed column-block
sums) and a product one launch plus a two-element reduction, all on the device: the result of a
check is a 0-dim device tensor that `Abft.collect` reduces with the others once per step.

Summation model, as in the C passes and `bounds.py`: a block sum adds float32 partial sums of
at most SUM_GROUP (4) signed terms in float64. The row-block sums use the C passes' very order
(four consecutive rows, left to right, then float64 in row order), so an operand's checksum rows
and a product's block sums are bit-identical to theirs; the column-block sums group four
consecutive columns (any order within a group, which the bound allows). Norms only scale the
bound (its 1.01 factor covers their rounding) and are reduced in a different order than in C.
Every reduction across programs writes per-program partials that torch then sums in a fixed
order: no atomics, so the same input gives the same bits on every rank and every run.

Only float32, contiguous tensors (callers check); the signs are the float32 +-1 vectors of
`checked.signs` on the tensor's device.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.nn import functional as F

from slurm_guard.kernels import triton_kernels as _tk
from slurm_guard.kernels.inputs import plain

triton: Any = None
tl: Any = None
_compiled: dict[str, Any] = {}
_variance: Any = None  # jitted helpers; kernels find them among the module's globals
_keep_worst: Any = None
_ROW_TILE = 32  # rows per program of the column-block pass
_FLOAT64_MAX = torch.finfo(torch.float64).max

force_on_cpu = False
"""Tests only: route float32 CPU tensors here (under TRITON_INTERPRET=1) instead of the C
passes, so that the path CUDA takes runs through the checked layers in CI."""


def available(device: torch.device) -> bool:
    """Whether these passes can run on tensors of `device` here."""
    if device.type == "cpu" and not force_on_cpu:
        return False
    return _tk.available(device)


def _column_tile(d: int) -> int:
    return int(min(256, triton.next_power_of_2(max(d, 1))))


def _kernels() -> dict[str, Any]:
    """The jitted kernels, defined on first use (after TRITON_INTERPRET has been read)."""
    global triton, tl
    if _compiled:
        return _compiled
    if not _tk._import_triton():
        raise RuntimeError("Triton is not installed: pip install 'slurm-guard[gpu]'")
    triton, tl = _tk.triton, _tk.tl
    global _variance, _keep_worst

    @triton.jit
    def variance(f_ptr, nr, a_sq, s_sq):  # type: ignore[no-untyped-def]
        """k1(n_b) a_sq + k3 s_sq of `bounds.residual_bound` (the bound per unit column norm)."""
        f0, f1, f2, f3 = tl.load(f_ptr), tl.load(f_ptr + 1), tl.load(f_ptr + 2), tl.load(f_ptr + 3)
        return (2.0 * f0 + (3.0 * nr + 8.0) * nr * f2) * f3 * a_sq + 2.0 * f1 * f3 * s_sq

    @triton.jit
    def keep_worst(  # type: ignore[no-untyped-def]
        residual, bound2, mask, f_ptr, best_ptr, bad_ptr, pid
    ):
        """The program's largest residual^2 / bound2, and whether any check failed outright: a
        NaN (non-finite product or operand) or an overflowed bound verifies nothing."""
        q = residual * residual / bound2
        failed = ((q != q) | (bound2 > tl.load(f_ptr + 5))) & mask
        tl.store(best_ptr + pid, tl.max(tl.where(mask & ~failed, q, 0.0), axis=0))
        tl.store(bad_ptr + pid, tl.max(failed.to(tl.int32), axis=0))

    _variance, _keep_worst = variance, keep_worst

    @triton.jit  # type: ignore[untyped-decorator]
    def row_blocks(  # type: ignore[no-untyped-def]
        a_ptr,
        sign_ptr,
        n,
        d,
        block,
        rsum_ptr,
        a_part_ptr,
        s_part_ptr,
        col_part_ptr,
        pred_ptr,
        bias_ptr,
        a_sq_ptr,
        s_sq_ptr,
        m_sq_ptr,
        f_ptr,
        best_ptr,
        bad_ptr,
        n_tiles,
        BD: tl.constexpr,
        COMPARE: tl.constexpr,
        HAS_BIAS: tl.constexpr,
    ):
        """One block of rows and one tile of columns: the block's signed row sum (float32
        groups of 4 rows in order, float64 across groups) and, for an operand, its squares;
        for a product, the residual against the prediction and its bound."""
        b = tl.program_id(0)
        t = tl.program_id(1)
        cols = t * BD + tl.arange(0, BD)
        cmask = cols < d
        r0 = b * block
        r1 = tl.minimum(r0 + block, n)
        full = r0 + ((r1 - r0) // 4) * 4
        acc = tl.zeros([BD], dtype=tl.float64)
        sq = tl.zeros([BD], dtype=tl.float32)
        sign_sum = tl.zeros([1], dtype=tl.float64)
        r0_64 = r0.to(tl.int64)
        for i in range(r0, full, 4):
            row = a_ptr + (r0_64 + (i - r0)) * d + cols  # int64 offsets (the loop index may not be)
            x0 = tl.load(row, mask=cmask, other=0.0)
            x1 = tl.load(row + d, mask=cmask, other=0.0)
            x2 = tl.load(row + 2 * d, mask=cmask, other=0.0)
            x3 = tl.load(row + 3 * d, mask=cmask, other=0.0)
            s0 = tl.load(sign_ptr + i)
            s1 = tl.load(sign_ptr + i + 1)
            s2 = tl.load(sign_ptr + i + 2)
            s3 = tl.load(sign_ptr + i + 3)
            part = x0 * s0 + x1 * s1  # products by +-1 are exact: FMA or not, the same bits
            part = part + x2 * s2
            part = part + x3 * s3
            acc += part.to(tl.float64)
            sign_sum += (s0 + s1 + s2 + s3).to(tl.float64)
            if not COMPARE:
                sq = sq + x0 * x0
                sq = sq + x1 * x1
                sq = sq + x2 * x2
                sq = sq + x3 * x3
        for i in range(full, r1):
            x = tl.load(a_ptr + (r0_64 + (i - r0)) * d + cols, mask=cmask, other=0.0)
            s = tl.load(sign_ptr + i)
            acc += (x * s).to(tl.float64)
            sign_sum += s.to(tl.float64)
            if not COMPARE:
                sq = sq + x * x
        pid = b * n_tiles + t
        if COMPARE:
            nr = (r1 - r0).to(tl.float64)
            v = _variance(f_ptr, nr, tl.load(a_sq_ptr + b), tl.load(s_sq_ptr + b))
            predicted = tl.load(pred_ptr + b * d + cols, mask=cmask, other=0.0).to(tl.float64)
            bound2 = v * tl.load(m_sq_ptr + cols, mask=cmask, other=0.0) + tl.load(f_ptr + 4)
            if HAS_BIAS:
                f0, f1, f2 = tl.load(f_ptr), tl.load(f_ptr + 1), tl.load(f_ptr + 2)
                beta = tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float64)
                predicted += tl.sum(sign_sum, axis=0) * beta
                k24 = (
                    (2.0 * f0 + (2.0 * nr + 8.0) * nr * f2) * nr + (2.0 * f1 + 4.0 * f2) * nr * nr
                ) * tl.load(f_ptr + 3)
                bound2 += k24 * beta * beta
            _keep_worst(predicted - acc, bound2, cmask, f_ptr, best_ptr, bad_ptr, pid)
        else:
            tl.store(rsum_ptr + b * d + cols, acc.to(tl.float32), mask=cmask)
            tl.store(a_part_ptr + pid, tl.sum(sq.to(tl.float64), axis=0))
            tl.store(s_part_ptr + pid, tl.sum(acc * acc, axis=0))
            tl.store(col_part_ptr + b * d + cols, sq.to(tl.float64), mask=cmask)

    @triton.jit  # type: ignore[untyped-decorator]
    def col_blocks(  # type: ignore[no-untyped-def]
        a_ptr,
        sign_ptr,
        n,
        d,
        block,
        n_blocks,
        cblk_ptr,
        cs_part_ptr,
        pred_ptr,
        a_sq_ptr,
        s_sq_ptr,
        m_sq_ptr,
        f_ptr,
        best_ptr,
        bad_ptr,
        n_row_tiles,
        BR: tl.constexpr,
        BLK: tl.constexpr,
        COMPARE: tl.constexpr,
    ):
        """BR rows and one block of columns: each row's signed sum over the block (float32
        groups of 4 columns, float64 across groups); for a transposed product, the residual."""
        rt = tl.program_id(0)
        c = tl.program_id(1)
        rows = rt * BR + tl.arange(0, BR)
        rmask = rows < n
        c0 = c * block
        width = tl.minimum(block, d - c0)
        j = tl.arange(0, BLK // 4)[:, None] * 4 + tl.arange(0, 4)[None, :]  # (groups, 4)
        jmask = j < width
        offsets = rows.to(tl.int64)[:, None, None] * d + c0 + j[None, :, :]
        x = tl.load(a_ptr + offsets, mask=rmask[:, None, None] & jmask[None, :, :], other=0.0)
        s = tl.load(sign_ptr + c0 + j, mask=jmask, other=0.0)
        part = tl.sum(x * s[None, :, :], axis=2)  # float32: four terms
        total = tl.sum(part.to(tl.float64), axis=1)  # (BR,)
        pid = c * n_row_tiles + rt
        if COMPARE:
            v = _variance(f_ptr, width.to(tl.float64), tl.load(a_sq_ptr + c), tl.load(s_sq_ptr + c))
            predicted = tl.load(pred_ptr + c * n + rows, mask=rmask, other=0.0).to(tl.float64)
            bound2 = v * tl.load(m_sq_ptr + rows, mask=rmask, other=0.0) + tl.load(f_ptr + 4)
            _keep_worst(predicted - total, bound2, rmask, f_ptr, best_ptr, bad_ptr, pid)
        else:
            tl.store(cblk_ptr + rows.to(tl.int64) * n_blocks + c, total.to(tl.float32), mask=rmask)
            tl.store(cs_part_ptr + pid, tl.sum(total * total, axis=0))

    _compiled.update(row_blocks=row_blocks, col_blocks=col_blocks)
    return _compiled


class Stats:
    """What the operand passes yield, as device tensors (the fields of `abft_native.Stats`):
    rows (B, d) float32, a_sq and s_sq (B,), cols (n, C) float32, cs_sq and ca_sq (C,), and
    col_sq() (d,), all float64 but the two checksum operands. None where not asked for."""

    __slots__ = ("_col_sq", "a_sq", "ca_sq", "cols", "cs_sq", "rows", "s_sq")

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None
        self.cols: torch.Tensor | None = None
        self.a_sq: torch.Tensor | None = None
        self.s_sq: torch.Tensor | None = None
        self.cs_sq: torch.Tensor | None = None
        self.ca_sq: torch.Tensor | None = None
        self._col_sq: torch.Tensor | None = None

    def col_sq(self) -> torch.Tensor:
        assert self._col_sq is not None
        return self._col_sq


def stats(
    a: torch.Tensor, block: int, row_sign: torch.Tensor | None, col_sign: torch.Tensor | None
) -> Stats:
    """`abft_native.stats` on the device: squared column norms always; with `row_sign` the
    signed row-block sums (with a_sq, s_sq); with `col_sign` the signed column-block sums (with
    cs_sq, ca_sq)."""
    plain("abft_triton.stats", a, row_sign, col_sign)
    k = _kernels()
    n, d = a.shape
    out = Stats()

    def f64(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=torch.float64, device=a.device)

    if row_sign is not None:
        nb, tile = -(-n // block), _column_tile(d)
        tiles = -(-d // tile)
        out.rows = torch.empty(nb, d, dtype=torch.float32, device=a.device)
        a_part, s_part, col_part = f64(nb, tiles), f64(nb, tiles), f64(nb, d)
        k["row_blocks"][(nb, tiles)](
            a, row_sign, n, d, block, out.rows, a_part, s_part, col_part,
            a, a, a_part, a_part, a_part, a_part, a_part, a_part, tiles,
            BD=tile, COMPARE=False, HAS_BIAS=False,
        )  # fmt: skip
        out.a_sq, out.s_sq, out._col_sq = a_part.sum(1), s_part.sum(1), col_part.sum(0)
    else:
        out._col_sq = a.square().sum(0, dtype=torch.float64)
    if col_sign is not None:
        nc = -(-d // block)
        row_tiles = -(-n // _ROW_TILE)
        out.cols = torch.empty(n, nc, dtype=torch.float32, device=a.device)
        cs_part = f64(nc, row_tiles)
        k["col_blocks"][(row_tiles, nc)](
            a, col_sign, n, d, block, nc, out.cols, cs_part,
            a, cs_part, cs_part, cs_part, cs_part, cs_part, cs_part, row_tiles,
            BR=_ROW_TILE, BLK=triton.next_power_of_2(max(block, 4)), COMPARE=False,
        )  # fmt: skip
        out.cs_sq = cs_part.sum(1)
        out.ca_sq = F.pad(out.col_sq(), (0, nc * block - d)).view(nc, block).sum(1)
    return out


def weight_norms(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(squared row norms (R,), squared column norms (C,)) of a stored weight, float64."""
    plain("abft_triton.weight_norms", w)
    sq = w.square()
    return sq.sum(1, dtype=torch.float64), sq.sum(0, dtype=torch.float64)


_FACTORS: dict[tuple[object, ...], torch.Tensor] = {}


def factors_on(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """A bound's five factors (`bounds.Factors`) and float64's largest value, as a float64
    tensor on the device: uploaded once per shape, not per check (a blocking upload waits for
    the GPU). Triton would pass Python floats as float32, and the floor (~1e-76) underflows."""
    key = (*values, device)
    t = _FACTORS.get(key)
    if t is None:
        t = _FACTORS[key] = torch.tensor([*values, _FLOAT64_MAX], dtype=torch.float64).to(device)
    return t


def _worst(best: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """The largest residual^2 / bound^2, +inf if any check failed outright; 0-dim, on device."""
    return torch.where(bad.amax() > 0, math.inf, best.amax())


def compare(
    out: torch.Tensor,
    block: int,
    sign: torch.Tensor,
    pred: torch.Tensor,
    bias: torch.Tensor | None,
    a_sq: torch.Tensor,
    s_sq: torch.Tensor,
    m_sq: torch.Tensor,
    factors: torch.Tensor,
) -> torch.Tensor:
    """`abft_native.compare` on the device: the check of a product `out` (R, p) whose rows are
    blocked, against pred (B, p) (+ the block's sign sum times bias)."""
    plain("abft_triton.compare", out, sign, pred, bias, a_sq, s_sq, m_sq)
    k = _kernels()
    r, p = out.shape
    nb, tile = -(-r // block), _column_tile(p)
    tiles = -(-p // tile)
    best = torch.empty(nb * tiles, dtype=torch.float64, device=out.device)
    bad = torch.empty(nb * tiles, dtype=torch.int32, device=out.device)
    k["row_blocks"][(nb, tiles)](
        out, sign, r, p, block, out, best, best, best,
        pred, bias if bias is not None else out, a_sq, s_sq, m_sq, factors, best, bad, tiles,
        BD=tile, COMPARE=True, HAS_BIAS=bias is not None,
    )  # fmt: skip
    return _worst(best, bad)


def compare_transposed(
    out_t: torch.Tensor,
    block: int,
    sign: torch.Tensor,
    pred: torch.Tensor,
    a_sq: torch.Tensor,
    s_sq: torch.Tensor,
    m_sq: torch.Tensor,
    factors: torch.Tensor,
) -> torch.Tensor:
    """`abft_native.compare_transposed` on the device: `out_t` (R, C) is the checked product's
    transpose, pred (ceil(C / block), R), sign (C,) the signs of out_t's columns."""
    plain("abft_triton.compare_transposed", out_t, sign, pred, a_sq, s_sq, m_sq)
    k = _kernels()
    r, c = out_t.shape
    nc, row_tiles = -(-c // block), -(-r // _ROW_TILE)
    best = torch.empty(nc * row_tiles, dtype=torch.float64, device=out_t.device)
    bad = torch.empty(nc * row_tiles, dtype=torch.int32, device=out_t.device)
    k["col_blocks"][(row_tiles, nc)](
        out_t, sign, r, c, block, nc, best, best,
        pred, a_sq, s_sq, m_sq, factors, best, bad, row_tiles,
        BR=_ROW_TILE, BLK=triton.next_power_of_2(max(block, 4)), COMPARE=True,
    )  # fmt: skip
    return _worst(best, bad)
