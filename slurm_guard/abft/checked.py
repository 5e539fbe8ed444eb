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

from typing import Any

import torch
from torch.nn import functional as F

from slurm_guard.abft.checksums import (
    NO_CONTEXT,
    FusedCheck,
    block_checksums,
    check_product,
    check_weight_grad,
    native_stats,
    no_autocast,
    row_sums,
    stored_is_checked,
    x_blocked,
)
from slurm_guard.abft.shards import is_dtensor, local, local_product
from slurm_guard.abft.site import (
    FWD,
    GRAD_W,
    GRAD_X,
    Site,
    squares_into_scratch,
)


class CheckedGemm(torch.autograd.Function):
    """The layer's GEMM with its three products checked (see the module docstring)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None, site: Site
    ) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        sharded = is_dtensor(m) or is_dtensor(x2)
        # the rank's own operands: the GEMM below runs on DTensors, every check on these
        x2l, ml = local(x2), local(m)
        bl = None if bias is None else local(bias)
        k = x2l.shape[1]
        active = site.active()
        kernel = site.kernel(FWD, x2l, ml, bl) if active else None
        x_stats = None
        if kernel is not None:  # (a Function's forward records no graph: no no_grad needed)
            x_stats = FusedCheck.before_forward(kernel, site, x2l, ml)
        if site.kind == "linear":
            out = F.linear(x, m.t(), bias)  # exactly what an unchecked nn.Linear computes
        elif bias is not None:
            out = torch.addmm(bias, x2, m).view(*x.shape[:-1], m.shape[1])
        else:
            out = (x2 @ m).view(*x.shape[:-1], m.shape[1])
        y = out.reshape(-1, m.shape[1])
        if sharded and (active or site.injectors):
            divisor = local_product(site.name, "fwd", x2, m, y)
            y = local(y)  # a view of the output's own shard: injected faults reach it
            if bl is not None and divisor > 1:
                bl = bl / divisor  # what DTensor's Replicate -> Partial left on this rank
        if site.injectors:
            site.inject(FWD, y)
            if kernel is not None and site.kernel(FWD, x2l, ml, bl) is None:
                kernel = None  # the fault armed the bound probe: the torch path reports bound2
        ctx.site = site
        ctx.in_shape = x.shape
        ctx.x_sq = None
        ctx.x_stats = x_stats
        if site.flops is not None:
            site.count(x2l.shape[0], k, ml.shape[1])
        if kernel is not None:
            assert x_stats is not None
            site.results.append((FWD, FusedCheck.forward(kernel, site, x_stats, ml, bl, y)))
        elif active:
            with torch.no_grad(), no_autocast(y.device):
                block = site.block_for(y.dtype)
                x_sq = row_sums(squares_into_scratch(x2l), block)  # (B, k)
                col_sq, _ = site.weight_norms(ml)
                ratio = check_product(
                    site,
                    k,
                    block_checksums(y, block),
                    block_checksums(x2l, block),
                    x_sq.sum(1),
                    ml,
                    col_sq,
                    bl,
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
        linear = site.kind == "linear"
        counting = site.flops is not None
        active = site.active() and (need_x or need_m)
        sharded = (active or bool(site.injectors)) and is_dtensor(m)
        gl, x2l, ml = local(g), local(x2), local(m)  # the checks read the rank's own shards
        n, k = x2l.shape
        kx = site.kernel(GRAD_X, gl, ml) if active and need_x else None
        kw = site.kernel(GRAD_W, gl, x2l) if active and need_m else None
        g_stats = None
        quiet = torch.no_grad() if torch.is_grad_enabled() else NO_CONTEXT  # create_graph
        if kx is not None or kw is not None:
            with quiet:
                g_stats = native_stats(
                    kx or kw,  # type: ignore[arg-type]
                    gl,
                    site.block,
                    rows=kx is not None,
                    cols=kw is not None and not x_blocked(k, gl.shape[1]),
                )
        grad_xl = stored_l = None  # the rank's own shards of grad_x and the weight gradient
        if need_x:
            grad_x = grad_xl = g @ m.t()
            if sharded:
                local_product(site.name, "grad_x", g, m, grad_x, m_transposed=True)
                grad_xl = local(grad_x)
            if site.injectors:
                site.inject(GRAD_X, grad_xl)
                if kx is not None and site.kernel(GRAD_X, gl, ml) is None:
                    kx = None  # the probe was armed by the fault (see forward)
            if counting:
                site.count(n, ml.shape[1], k)
            if kx is not None:
                assert g_stats is not None
                with quiet:
                    ratio = FusedCheck.grad_x(kx, site, g_stats, ml, grad_xl)
                site.results.append((GRAD_X, ratio))
        if need_m:  # the weight gradient in the weight's layout
            stored = stored_l = g.t() @ x2 if linear else x2.t() @ g
            if sharded:
                a, b = (g, x2) if linear else (x2, g)
                local_product(site.name, "grad_w", a, b, stored, a_transposed=True)
                stored_l = local(stored)
            if site.injectors:
                site.inject(GRAD_W, stored_l)
                if kw is not None and site.kernel(GRAD_W, gl, x2l) is None:
                    kw = None
            grad_m = stored.t() if linear else stored
            if counting:
                site.count(n, k, ml.shape[1])
            if kw is not None:
                assert g_stats is not None
                with quiet:
                    ratio = FusedCheck.grad_w(kw, site, g_stats, ctx.x_stats, gl, x2l, stored_l)
                site.results.append((GRAD_W, ratio))
        if need_b:
            grad_b = g.sum(0)
        if active and (kx is None or kw is None):
            _torch_backward(
                ctx,
                site,
                gl,
                x2l,
                ml,
                grad_xl if kx is None else None,
                stored_l if kw is None else None,
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
    with torch.no_grad(), no_autocast(g.device):
        block = site.block_for(g.dtype)  # (grad_x has g's dtype)
        g_sq = row_sums(squares_into_scratch(g), block)  # (B, out)
        if grad_x is not None:
            _, row_sq = site.weight_norms(m)
            ratio = check_product(
                site,
                m.shape[1],
                block_checksums(grad_x, block),
                block_checksums(g, block),
                g_sq.sum(1),
                m.t(),
                row_sq,
                None,
                grad_x,
                GRAD_X,
            )
            site.results.append((GRAD_X, ratio))
        if stored is not None:
            x_sq = ctx.x_sq if ctx.x_sq is not None else row_sums(squares_into_scratch(x2), n)
            x_col_sq, g_col_sq = x_sq.sum(0), g_sq.sum(0)
            k, p = x2.shape[1], g.shape[1]
            product = stored if stored_is_checked(site.kind, k, p) else stored.t()
            if x_blocked(k, p):
                ratio = check_weight_grad(site, x2, x_col_sq, g, g_col_sq, product)
            else:
                ratio = check_weight_grad(site, g, g_col_sq, x2, x_col_sq, product)
            site.results.append((GRAD_W, ratio))
