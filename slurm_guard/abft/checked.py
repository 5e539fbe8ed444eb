"""One checked GEMM layer: y = x M + b forward, grad_x = g M^T and grad_M = x^T g backward.

Each of the three products is checked by block checksums (algorithm-based fault tolerance): the
rows of the output are summed in blocks of `block` rows, each row with a fixed sign (`signs`), and
compared with the same signed sums computed from the input rows, a GEMM `block` times smaller than
the one checked. A wrong output element changes exactly one block checksum by the size of its
error, which is then compared with the rounding bound of `bounds.py`. The sums are accumulated in
float64, so the bound is the GEMM's own rounding, not the checksum's; the signs keep a block's
checksum row small when its rows share an offset (post-GELU activations), which keeps the
checksum GEMM's rounding small too. Nothing leaves the device: each check leaves one scalar (the
largest residual divided by its bound) that the site keeps for the per-step reduction.

`M` is the (in, out) matrix: `weight.t()` for `nn.Linear` (whose forward still calls
`F.linear(x, weight, bias)`, the very kernel an unchecked layer runs) and `weight` itself for
HuggingFace's `Conv1D` (`torch.addmm(bias, x, weight)`, as its own forward does). The weight
gradient is produced in the weight's own layout, as autograd's linear backward does, so
gradient accumulation does not copy it. Every reduction runs along a contiguous dimension or
over the middle of a contiguous view: strided reductions cost more than the GEMM they check.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch.nn import functional as F

from slurm_guard.abft.bounds import (
    SUM_GROUP,
    Factors,
    check_dtype,
    factors,
    residual_bound,
    roundoff,
)
from slurm_guard.kernels import abft_native as nk
from slurm_guard.kernels import abft_triton as at

FWD, GRAD_X, GRAD_W = 0, 1, 2
PASSES = ("fwd", "grad_x", "grad_w")
# Rows per checksum block at most for float16/bfloat16 products: their bound is the rounding of
# each stored output element, which grows as sqrt(block), not the GEMM's (docs/coverage.md)
HALF_BLOCK = 32
HALF = (torch.float16, torch.bfloat16)

Injector = Callable[[torch.Tensor], None]
# What checks a float32 product in one pass per tensor: the C passes (CPU) or the Triton ones
# (the module `abft_triton`: CUDA, or CPU under the interpreter in tests)
Passes = nk._Native | ModuleType


@dataclass
class Site:
    """One checked layer (or one projection inside attention) and what it has seen this step.

    `results` collects (pass, (residual / bound)^2): per block and column as a device tensor
    (torch path), its largest value as a 0-dim device tensor (the Triton path, CUDA), or as a
    number (the C path, CPU only, where the number is on the host anyway). `checking` False
    keeps the layer wrapped for fault injection only.
    `injectors[pass]` corrupt that pass's output in place before it is checked (software
    faults, `slurm_guard.faults`).
    """

    index: int
    name: str
    kind: str  # "linear" (M = weight.t()) or "addmm" (M = weight)
    margin: float = 10.0
    block: int = 64
    checking: bool = True
    results: list[tuple[int, torch.Tensor | float]] = field(default_factory=list)
    injectors: dict[int, list[Injector]] = field(default_factory=dict)
    flops: list[int] | None = None  # coverage accounting: FLOPs of the GEMMs checked
    suspended: Callable[[], bool] = lambda: False
    norms: tuple[tuple[int, int, int, bool], torch.Tensor, torch.Tensor] | None = None
    bias_norms: tuple[tuple[int, int, int], torch.Tensor] | None = None
    # testing aid (benchmarks/campaign.py): {"which": pass} keeps that pass's next squared
    # bound under "bound2", so a harness can tell whether an injected error was above it
    probe: dict[str, Any] | None = None
    _factors: dict[tuple[int, int, float], Factors] = field(default_factory=dict, repr=False)

    def active(self) -> bool:
        return self.checking and not self.suspended()

    def block_for(self, dtype: torch.dtype) -> int:
        """Rows per checksum block for a product of this dtype."""
        return min(self.block, HALF_BLOCK) if dtype in HALF else self.block

    def inject(self, which: int, out: torch.Tensor) -> None:
        for fn in self.injectors.get(which, ()):
            fn(out)

    def count(self, n: int, k: int, m: int) -> None:
        if self.flops is not None:
            self.flops.append(2 * n * k * m)

    def bias_sq(self, b: torch.Tensor) -> torch.Tensor:
        """beta^2 in float64, kept like the weight norms (the bias changes only at the update)."""
        key = (b.data_ptr(), b._version, -1)
        if self.bias_norms is None or self.bias_norms[0] != key:
            self.bias_norms = (key, b.double().square())
        return self.bias_norms[1]

    def weight_norms(
        self, m: torch.Tensor, kernel: Passes | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(||M[:, c]||^2 per output column, ||M[l, :]||^2 per input row), one pass over the
        weight per step: kept until the weight changes (version counter) or the step ends.
        With the one-pass kernels they are float64 (what their compare passes read), else the
        check dtype."""
        key = (m.data_ptr(), m._version, m.shape[0], kernel is not None)
        norms = self.norms
        if norms is not None and norms[0] == key:
            return norms[1], norms[2]
        w = m.t() if self.kind == "linear" else m  # the stored, contiguous layout
        if isinstance(kernel, nk._Native):
            along, across = nk.weight_norms(kernel, w if w.is_contiguous() else w.contiguous())
        elif kernel is not None:
            along, across = at.weight_norms(w)
        else:
            sq = _squares(w)
            along = sq.sum(1)
            across = torch.mv(sq.t(), torch.ones(sq.shape[0], dtype=sq.dtype, device=sq.device))
        col, row = (along, across) if self.kind == "linear" else (across, along)
        self.norms = (key, col, row)
        return col, row

    def kernel(self, which: int, *tensors: torch.Tensor | None) -> Passes | None:
        """The one-pass kernels when they can check this pass: float32 operands on one device
        (the C passes on the CPU, if built; the Triton ones on CUDA, if installed), outside
        autocast, and no bound probe waiting for this pass (the probe needs the torch path's
        per-element bound). None: the torch path."""
        probe = self.probe
        if probe is not None and probe.get("which") == which and "bound2" not in probe:
            return None
        device = next(t.device for t in tensors if t is not None)
        if torch.is_autocast_enabled(device.type):
            return None  # (autocast casts the operands to a half type first anyway)
        for t in tensors:
            if t is not None and (t.dtype != torch.float32 or t.device != device):
                return None
        if at.available(device):
            return at
        return nk.native() if device.type == "cpu" else None

    def factors(self, q: int, n_max: int, like: torch.Tensor) -> Factors:
        """The bound's numbers for a float32 product (`bounds.factors`), kept per shape: per
        step only the norms change, and hashing the full key costs more than the lookup here."""
        key = (q, n_max, self.margin)
        f = self._factors.get(key)
        if f is None:
            r = roundoff(like.dtype, like.device)
            f = self._factors[key] = factors(q, float(n_max), r, self.margin)
        return f


_SCRATCH: dict[tuple[torch.dtype, torch.device, int], torch.Tensor] = {}
_SCRATCH_LIMIT = 1 << 24  # elements kept for reuse (64 MiB in float32)


def _squares(t: torch.Tensor) -> torch.Tensor:
    """Elementwise squares in the check dtype (float16 squares overflow above 256), written into
    a reused buffer: a fresh multi-megabyte temporary costs more in page faults than the squaring.
    Valid until the next call."""
    cdt = check_dtype(t.dtype)
    n = t.numel()
    if n > _SCRATCH_LIMIT:
        return t.to(cdt).square()
    key = (cdt, t.device, threading.get_ident())
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < n:
        buf = _SCRATCH[key] = torch.empty(n, dtype=cdt, device=t.device)
    out = buf[:n].view(t.shape)
    return torch.mul(t, t, out=out) if t.dtype == cdt else out.copy_(t).square_()


@contextlib.contextmanager
def _no_autocast(device: torch.device) -> Iterator[None]:
    """Checksums stay in float32/float64 even inside an autocast region."""
    if torch.is_autocast_enabled(device.type):
        with torch.autocast(device.type, enabled=False):
            yield
    else:
        yield


_NO_CONTEXT = contextlib.nullcontext()

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


def _row_sums(t: torch.Tensor, block: int) -> torch.Tensor:
    """Block sums of a 2-D tensor's rows in the check dtype (norms: squares, unsigned)."""
    return _blocks(t.to(check_dtype(t.dtype)), block)


def _checksums(t: torch.Tensor, block: int) -> torch.Tensor:
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


def _col_checksums(t: torch.Tensor, block: int) -> torch.Tensor:
    """`_checksums` of t's transpose, transposed back: (rows, blocks) float64."""
    return _checksums(t.t(), block).t()


def _sign_sums(n: int, block: int, like: torch.Tensor) -> torch.Tensor:
    """(B,) float64: each block's sum of signs, the multiple of the bias its checksum holds."""
    return _blocks(signs(n, torch.float64, like.device)[:, None], block)[:, 0]


def _check(
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
    a_sums (B, .) float64 the checksum rows (`_checksums`) of out and A, a_sq (B,) the blocks'
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
    out_sq = _row_sums(_squares(out), block).to(f64) if dtype in HALF else None
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


def _check_weight_grad(
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
    a_sums = _col_checksums(p, block).t()  # (R, n)
    a_sq = _row_sums(p_col_sq.unsqueeze(1), block)[:, 0]
    out_sums = _checksums(grad, block)
    return _check(site, p.shape[0], out_sums, a_sums, a_sq, q, q_col_sq, None, grad, GRAD_W)


def _x_blocked(k: int, p: int) -> bool:
    """Whether the weight-gradient check's checksum rows run along x's width k (column blocks
    of x) rather than g's width p: along the longer side, which gives the checksum GEMM more
    rows (a much faster GEMM shape) for the same FLOPs. Both implementations follow it."""
    return k > p


def stored_is_checked(kind: str, k: int, p: int) -> bool:
    """Whether the weight gradient in its stored layout (g^T x for nn.Linear, x^T g for Conv1D)
    is the product the check blocks (else its transpose is), for input width k, output width p."""
    return _x_blocked(k, p) == (kind == "addmm")


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


def _compare(
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
    """`_compare` for a product held transposed (its row blocks are out_t's column blocks)."""
    sign = signs(out_t.shape[1], torch.float32, out_t.device)
    out_t = _contiguous(out_t)
    if isinstance(kernel, nk._Native):
        args = (st.ca_sq, st.cs_sq, m_sq, f.native)
        return nk.compare_transposed(kernel, out_t, block, sign, pred, *args)
    factors_t = at.factors_on(f.numbers, out_t.device)
    return at.compare_transposed(out_t, block, sign, pred, st.ca_sq, st.cs_sq, m_sq, factors_t)


class _FusedCheck:
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
        cols = _x_blocked(x2.shape[1], m.shape[1])
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
        return _compare(kernel, y, site.block, pred, bias, st, col_sq, f)

    @staticmethod
    def grad_x(
        kernel: Passes, site: Site, st: Any, m: torch.Tensor, grad_x: torch.Tensor
    ) -> float | torch.Tensor:
        _, row_sq = site.weight_norms(m, kernel)
        assert st.rows is not None
        pred = torch.mm(st.rows, m.t())
        f = site.factors(m.shape[1], min(grad_x.shape[0], site.block), grad_x)
        return _compare(kernel, grad_x, site.block, pred, None, st, row_sq, f)

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
        or P = g (rows of g^T x) as `_x_blocked` says; the stored layout holds that product
        (g^T x for nn.Linear, x^T g for Conv1D) or its transpose."""
        n, k = x2.shape
        by_x = _x_blocked(k, g.shape[1])
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
            st = _RowBlocks(p_stats.ca_sq, p_stats.cs_sq)
            return _compare(kernel, stored, site.block, pred, None, st, q_col_sq, f)
        return _compare_transposed(kernel, stored, site.block, pred, p_stats, q_col_sq, f)


@dataclass(frozen=True)
class _RowBlocks:
    """The bound's per-block norms of a checksum operand, under the names `_compare` reads."""

    a_sq: Any
    s_sq: Any


class CheckedGemm(torch.autograd.Function):
    """The layer's GEMM with its three products checked (see the module docstring)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None, site: Site
    ) -> torch.Tensor:
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        active = site.active()
        kernel = site.kernel(FWD, x2, m, bias) if active else None
        x_stats = None
        if kernel is not None:  # (a Function's forward records no graph: no no_grad needed)
            x_stats = _FusedCheck.before_forward(kernel, site, x2, m)
        if site.kind == "linear":
            out = F.linear(x, m.t(), bias)  # exactly what an unchecked nn.Linear computes
        elif bias is not None:
            out = torch.addmm(bias, x2, m).view(*x.shape[:-1], m.shape[1])
        else:
            out = (x2 @ m).view(*x.shape[:-1], m.shape[1])
        y = out.reshape(-1, m.shape[1])
        if site.injectors:
            site.inject(FWD, y)
            if kernel is not None and site.kernel(FWD, x2, m, bias) is None:
                kernel = None  # the fault armed the bound probe: the torch path reports bound2
        ctx.site = site
        ctx.in_shape = x.shape
        ctx.x_sq = None
        ctx.x_stats = x_stats
        if site.flops is not None:
            site.count(x2.shape[0], k, m.shape[1])
        if kernel is not None:
            assert x_stats is not None
            site.results.append((FWD, _FusedCheck.forward(kernel, site, x_stats, m, bias, y)))
        elif active:
            with torch.no_grad(), _no_autocast(y.device):
                block = site.block_for(y.dtype)
                x_sq = _row_sums(_squares(x2), block)  # (B, k)
                col_sq, _ = site.weight_norms(m)
                ratio = _check(
                    site,
                    k,
                    _checksums(y, block),
                    _checksums(x2, block),
                    x_sq.sum(1),
                    m,
                    col_sq,
                    bias,
                    y,
                    FWD,
                )
            site.results.append((FWD, ratio))
            ctx.x_sq = x_sq  # its column sums bound the weight gradient's check
        ctx.save_for_backward(x2, m)
        return out

    @staticmethod
    def backward(
        ctx: Any, grad_y: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        x2, m = ctx.saved_tensors
        site: Site = ctx.site
        g = grad_y.reshape(-1, grad_y.shape[-1])
        need_x, need_m, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_m = grad_b = None
        n, k = x2.shape
        linear = site.kind == "linear"
        counting = site.flops is not None
        active = site.active() and (need_x or need_m)
        kx = site.kernel(GRAD_X, g, m) if active and need_x else None
        kw = site.kernel(GRAD_W, g, x2) if active and need_m else None
        g_stats = None
        quiet = torch.no_grad() if torch.is_grad_enabled() else _NO_CONTEXT  # create_graph
        if kx is not None or kw is not None:
            with quiet:
                g_stats = native_stats(
                    kx or kw,  # type: ignore[arg-type]
                    g,
                    site.block,
                    rows=kx is not None,
                    cols=kw is not None and not _x_blocked(k, g.shape[1]),
                )
        if need_x:
            grad_x = g @ m.t()
            if site.injectors:
                site.inject(GRAD_X, grad_x)
                if kx is not None and site.kernel(GRAD_X, g, m) is None:
                    kx = None  # the probe was armed by the fault (see forward)
            if counting:
                site.count(n, m.shape[1], k)
            if kx is not None:
                assert g_stats is not None
                with quiet:
                    ratio = _FusedCheck.grad_x(kx, site, g_stats, m, grad_x)
                site.results.append((GRAD_X, ratio))
        stored = None  # the weight gradient in the weight's layout
        if need_m:
            stored = g.t() @ x2 if linear else x2.t() @ g
            if site.injectors:
                site.inject(GRAD_W, stored)
                if kw is not None and site.kernel(GRAD_W, g, x2) is None:
                    kw = None
            grad_m = stored.t() if linear else stored
            if counting:
                site.count(n, k, m.shape[1])
            if kw is not None:
                assert g_stats is not None
                with quiet:
                    ratio = _FusedCheck.grad_w(kw, site, g_stats, ctx.x_stats, g, x2, stored)
                site.results.append((GRAD_W, ratio))
        if need_b:
            grad_b = g.sum(0)
        if active and (kx is None or kw is None):
            _torch_backward(
                ctx,
                site,
                g,
                x2,
                m,
                grad_x if kx is None else None,
                stored if kw is None else None,
            )
        if grad_x is not None:
            grad_x = grad_x.view(ctx.in_shape)
        return grad_x, grad_m, grad_b, None


def _torch_backward(
    ctx: Any,
    site: Site,
    g: torch.Tensor,
    x2: torch.Tensor,
    m: torch.Tensor,
    grad_x: torch.Tensor | None,
    stored: torch.Tensor | None,
) -> None:
    """The backward checks in torch ops (the specification) for the passes given."""
    if grad_x is None and stored is None:
        return
    n = x2.shape[0]
    with torch.no_grad(), _no_autocast(g.device):
        block = site.block_for(g.dtype)  # (grad_x has g's dtype)
        g_sq = _row_sums(_squares(g), block)  # (B, out)
        if grad_x is not None:
            _, row_sq = site.weight_norms(m)
            ratio = _check(
                site,
                m.shape[1],
                _checksums(grad_x, block),
                _checksums(g, block),
                g_sq.sum(1),
                m.t(),
                row_sq,
                None,
                grad_x,
                GRAD_X,
            )
            site.results.append((GRAD_X, ratio))
        if stored is not None:
            x_sq = ctx.x_sq if ctx.x_sq is not None else _row_sums(_squares(x2), n)
            x_col_sq, g_col_sq = x_sq.sum(0), g_sq.sum(0)
            k, p = x2.shape[1], g.shape[1]
            product = stored if stored_is_checked(site.kind, k, p) else stored.t()
            if _x_blocked(k, p):
                ratio = _check_weight_grad(site, x2, x_col_sq, g, g_col_sq, product)
            else:
                ratio = _check_weight_grad(site, g, g_col_sq, x2, x_col_sq, product)
            site.results.append((GRAD_W, ratio))
