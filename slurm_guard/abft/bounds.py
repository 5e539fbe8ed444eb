"""The rounding bound a checked GEMM's checksum residual is compared with.

A check compares two ways of computing the same block checksum of a GEMM's output: summing the
output rows of a block, and multiplying the summed input rows by the other operand. In exact
arithmetic they are equal; in floating point they differ by the rounding errors of the GEMM and of
the checksum arithmetic itself. A fault is only visible above that difference, so the bound decides
both the false-alarm rate and the smallest detectable error.

The bound is the probabilistic rounding-error bound of Higham and Mary ("A new approach to
probabilistic rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019): each rounding is
x(1 + d) with |d| <= u, the d are independent with mean zero, and the residual is a sum of terms
d_t * c_t, a martingale. Azuma-Hoeffding then bounds it by lambda * sqrt(sum c_t^2) except with
probability at most 2 exp(-lambda^2 / 2) (4e-22 at the default lambda = 10). Every |c_t| is bounded
from quantities the check already has: the norms of the operands' rows and columns, the block
sizes and the unit roundoffs, whatever the summation order, blocking or FMA use of the kernel.
The worst-case bound (gamma_k = k u / (1 - k u)) is never approached by real rounding and would be
about sqrt(k) times looser; the model's assumption (independent, mean-zero roundings) is what
V-ABFT-style variance bounds rely on too. `docs/coverage.md` gives the resulting smallest
detectable error per dtype and shape.
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

_U = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}
TF32 = 2.0**-11  # TensorFloat-32 keeps 10 mantissa bits
# Both check paths (kernels/abft_check.c and checked._checksums) form a block sum from float32
# partial sums of at most this many signed terms, added in float64 (float64 GEMMs: all float64)
SUM_GROUP = 4


def unit_roundoff(dtype: torch.dtype) -> float:
    try:
        return _U[dtype]
    except KeyError:
        raise TypeError(f"no unit roundoff for {dtype}: checked GEMMs need a float dtype") from None


@dataclass(frozen=True)
class Roundoff:
    """Unit roundoffs of one checked GEMM and of its checksum arithmetic.

    acc: accumulation inside the GEMM; inp: rounding of the GEMM's inputs (TF32 or bf16 inner
    precision for float32 on CUDA), 0 if none; out: rounding of the stored output; check: the
    checksum sums (float64); partial: their partial sums of SUM_GROUP terms (float32 for float32
    and half-precision GEMMs); check_round: rounding the sums to the checksum GEMM's dtype (0 when
    that is float64); check_inp / check_acc: the checksum GEMM (itself subject to TF32 on CUDA);
    tiny: the smallest normal number of the GEMM's check dtype, for the subnormal-range floor.
    """

    acc: float
    inp: float
    out: float
    check: float
    partial: float
    check_round: float
    check_inp: float
    check_acc: float
    tiny: float


def check_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a GEMM's checksum GEMM and norms: float32 for float32 and half-precision GEMMs,
    float64 for float64 ones. (The block sums themselves are always accumulated in float64.)"""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _fp32_inner(device: torch.device) -> float:
    """The precision a float32 matmul rounds its inputs to on this device (0: none)."""
    if device.type != "cuda":
        return 0.0
    precision = torch.get_float32_matmul_precision()
    if precision == "medium":
        return 2.0**-8
    if precision == "high" or torch.backends.cuda.matmul.allow_tf32:
        return TF32
    return 0.0


def _half_accumulation(dtype: torch.dtype, device: torch.device) -> float:
    """Unit roundoff of a half-precision GEMM's accumulation. CPU kernels (oneDNN, MKL) and
    cuBLAS accumulate in float32; cuBLAS may also round split-K partial sums to the output type
    when "reduced precision reductions" are allowed (PyTorch's default): then the conservative
    choice is the output type's own roundoff, which loosens the bound by about sqrt(q)."""
    if device.type == "cuda":
        matmul = torch.backends.cuda.matmul
        allowed = (
            matmul.allow_bf16_reduced_precision_reduction
            if dtype == torch.bfloat16
            else matmul.allow_fp16_reduced_precision_reduction
        )
        if allowed:
            return unit_roundoff(dtype)
    return unit_roundoff(torch.float32)


_HOST_ROUNDOFF: dict[tuple[torch.dtype, str], Roundoff] = {}


def roundoff(dtype: torch.dtype, device: torch.device) -> Roundoff:
    """The rounding model of a GEMM in `dtype` on `device` and of its float32/64 checksums.
    Kept per dtype off CUDA (where nothing global changes it); on CUDA it depends on the TF32 and
    reduced-precision settings, which a program may change at any time, so it is read per call."""
    if device.type != "cuda":
        key = (dtype, device.type)
        cached = _HOST_ROUNDOFF.get(key)
        if cached is None:
            cached = _HOST_ROUNDOFF[key] = _roundoff(dtype, device)
        return cached
    return _roundoff(dtype, device)


def _roundoff(dtype: torch.dtype, device: torch.device) -> Roundoff:
    u = unit_roundoff(dtype)
    cdt = check_dtype(dtype)
    uc = unit_roundoff(cdt)
    check_inp = _fp32_inner(device) if cdt == torch.float32 else 0.0
    inp = _fp32_inner(device) if dtype == torch.float32 else 0.0
    acc = _half_accumulation(dtype, device) if dtype in (torch.bfloat16, torch.float16) else u
    return Roundoff(
        acc=acc,
        inp=inp,
        out=u,
        check=unit_roundoff(torch.float64),
        partial=uc,
        check_round=0.0 if cdt == torch.float64 else uc,
        check_inp=check_inp,
        check_acc=uc,
        tiny=torch.finfo(cdt).tiny,
    )


@dataclass(frozen=True)
class Factors:
    """The numbers a bound is made of for one GEMM shape (reduction length q, largest block n_max,
    dtype, device, margin), computed once (`factors` caches them): per check, only the norms
    change. k1, k3 and k24 below are the coefficients of the `residual_bound` formula."""

    per_element: float
    check_gemm: float
    uc2: float
    scale: float
    floor2: float
    # the five numbers as a ctypes double[5], for the C compare pass
    native: Any = field(compare=False, repr=False)

    def k1(self, n_b: Any) -> Any:
        return (2 * self.per_element + (3 * n_b + 8) * n_b * self.uc2) * self.scale

    @property
    def numbers(self) -> tuple[float, float, float, float, float]:
        """The five numbers, in the order the C and Triton compare passes read them."""
        return (self.per_element, self.check_gemm, self.uc2, self.scale, self.floor2)

    @property
    def k3(self) -> float:
        return 2 * self.check_gemm * self.scale

    def k24(self, n_b: Any) -> Any:
        pe, cg, uc2 = self.per_element, self.check_gemm, self.uc2
        return ((2 * pe + (2 * n_b + 8) * n_b * uc2) * n_b + (2 * cg + 4 * uc2) * n_b * n_b) * (
            self.scale
        )


@functools.lru_cache(maxsize=4096)
def factors(q: int, n_max: float, r: Roundoff, margin: float, low_out: bool = False) -> Factors:
    """The bound's shape-dependent numbers (see `residual_bound` for their derivation).

    The floor covers roundings in the subnormal range; its square is kept at least the check
    dtype's smallest normal number, so that an all-zero block (zero inputs, no bias: a zero
    residual) compares 0 with a positive number instead of 0 / 0 (NaN, a false alarm).
    """
    out_term = 0.0 if low_out else r.out**2
    gemm = (q + 1) * r.acc**2 + 2.1 * r.inp**2 + out_term
    # the checksum GEMM's own roundings, and its input (the float64 sums) rounded to its dtype
    check_gemm = (2 * q + 1) * (r.check_acc**2 + 2.1 * r.check_inp**2) + r.check_round**2
    # products of two or more roundings: (1 + d_out) prod (1 + d_t) - 1 - sum of first-order
    # terms is at most R = (e^E - 1 - E)(1 + u_out) + u_out (e^E - 1), E the other roundings
    # (a single output rounding has no square of its own)
    events = (2 * q + 2) * r.acc + 2 * r.inp
    second = (math.expm1(events) - events) * (1 + r.out) + r.out * math.expm1(events)
    remainder = second * math.sqrt(n_max / gemm)
    # the partial sums of SUM_GROUP terms in both checksum sums (see residual_bound)
    per_element = gemm + 1.5 * (SUM_GROUP - 1) * SUM_GROUP * r.partial**2
    # 1.01: the norms and this formula are themselves computed in floating point
    scale = (1.01 * (margin + remainder)) ** 2
    floor2 = max((r.tiny * (2 * q + 8) * n_max) ** 2, r.tiny)
    values = (per_element, check_gemm, r.check**2, scale, floor2)
    return Factors(*values, native=(ctypes.c_double * 5)(*values))


def residual_bound(
    q: int,
    block_rows: float | torch.Tensor,
    a_sq: torch.Tensor,
    s_sq: torch.Tensor,
    m_sq: torch.Tensor,
    bias_sq: torch.Tensor | None,
    r: Roundoff,
    margin: float,
    out_sq: torch.Tensor | None = None,
) -> torch.Tensor:
    """The SQUARED bound on |sum_{i in b} out[i, c] - (sum_{i in b} a_i) . m_c - n_b beta_c| per
    (b, c) (squared: the check compares squares and takes one square root per step).

    Args:
        q: the GEMM's reduction length (inner dimension).
        block_rows: rows n_b per checksum block: a number when every block has the same size,
            else (B,) per block.
        a_sq: (B,) sum of squared row norms of A over the block, sum_{i in b} ||a_i||^2.
        s_sq: (B,) ||sum_{i in b} a_i||^2, the checksum row's own squared norm.
        m_sq: (p,) squared column norms of M, ||m_c||^2.
        bias_sq: (p,) beta_c^2, or None without a bias.
        r: unit roundoffs; margin: lambda of the Azuma-Hoeffding tail.
        out_sq: (B, p) sum over the block of the squared outputs, for a low-precision output
            type: its rounding, u_out |y_ic| per element, is then bounded by the output itself
            (about sqrt(q) tighter than through rho).

    Every row enters its block's checksum with a sign +-1 (`checked.signs`): the signs change no
    magnitude below, and the bias enters the prediction with the block's sign sum, at most n_b.
    Per output element the GEMM makes at most 2q + 2 roundings (q products, q additions, the
    bias, the output) plus 2q input roundings, each at most u * rho with rho = ||a_i|| ||m_c|| +
    |beta_c| >= sum_l |a_il m_lc| + |beta_c| (Cauchy-Schwarz). Summing n_b rows of the block in
    float64 adds n_b - 1 roundings (at most u64) of partial sums no larger than sum_i rho_i (both
    checksum sums: output and A). Inside those, both paths form float32 partial sums of
    G = SUM_GROUP terms: G - 1 roundings per group, each at most u32 times the group's sum of
    magnitudes, so with Cauchy-Schwarz inside a group their squares sum to at most (G - 1) G u32^2
    times the block's sum of squared terms: a_sq ||m_c||^2 on the operand side (through the
    checksum GEMM), sum_i rho_i^2 on the output side; 3 (G - 1) G u32^2 in all, folded into
    per_element as 1.5 (G - 1) G u32^2 (the formula doubles it). Rounding A's sums s_b to the
    checksum GEMM's dtype makes q roundings s_l m_lc, whose squares sum to at most
    u^2 ||s_b||^2 ||m_c||^2; the checksum GEMM makes 2q + 1 roundings no larger than
    ||s_b|| ||m_c|| + n_b |beta_c|; the final subtraction (float64) one, no larger than
    2 sum_i rho_i. With sum_i rho_i^2 <= 2 ||m_c||^2 a_sq + 2 n_b beta_c^2 this gives
    sum c_t^2 <= `terms` below. The second-order remainder (products of two roundings, at most
    R sum_i rho_i, R below) is at most R sqrt(n_b / per_element) sqrt(terms):
    folded into the margin, negligible in float32, not for half-precision accumulation over long
    reductions.
    """
    uniform = not isinstance(block_rows, torch.Tensor)
    n_b: Any = block_rows if uniform else block_rows[:, None]  # type: ignore[index]
    n_max = float(block_rows) if uniform else float(block_rows.max())  # type: ignore[union-attr]
    f = factors(q, n_max, r, margin, out_sq is not None)
    k1, k3, k24, floor = f.k1(n_b), f.k3, f.k24(n_b), f.floor2
    if uniform and out_sq is None:  # the common case in two fused kernels
        v = torch.add(a_sq, s_sq, alpha=k3 / k1)
        if bias_sq is None:
            return torch.outer(v, m_sq).mul_(k1).add_(floor)
        return torch.addr(bias_sq.mul(k24).add_(floor), v, m_sq, alpha=k1)
    terms: torch.Tensor = (k1 * a_sq[:, None] + k3 * s_sq[:, None]) * m_sq[None, :]
    if bias_sq is not None:
        terms = terms + k24 * bias_sq[None, :]
    if out_sq is not None:
        terms = terms + 1.01 * r.out**2 * f.scale * out_sq
    return terms + floor
