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

import math
from dataclasses import dataclass

import torch

_U = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}
TF32 = 2.0**-11  # TensorFloat-32 keeps 10 mantissa bits


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
    checksum sums; check_inp / check_acc: the checksum GEMM (itself subject to TF32 on CUDA).
    """

    acc: float
    inp: float
    out: float
    check: float
    check_inp: float
    check_acc: float


def check_dtype(dtype: torch.dtype) -> torch.dtype:
    """Checksums of half-precision GEMMs are accumulated in float32, float64 ones in float64."""
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


def roundoff(dtype: torch.dtype, device: torch.device) -> Roundoff:
    """The rounding model of a GEMM in `dtype` on `device` and of its float32/64 checksums."""
    u = unit_roundoff(dtype)
    cdt = check_dtype(dtype)
    uc = unit_roundoff(cdt)
    check_inp = _fp32_inner(device) if cdt == torch.float32 else 0.0
    inp = _fp32_inner(device) if dtype == torch.float32 else 0.0
    acc = _half_accumulation(dtype, device) if dtype in (torch.bfloat16, torch.float16) else u
    return Roundoff(acc=acc, inp=inp, out=u, check=uc, check_inp=check_inp, check_acc=uc)


def residual_bound(
    q: int,
    block_rows: torch.Tensor,
    a_sq: torch.Tensor,
    s_sq: torch.Tensor,
    m_sq: torch.Tensor,
    bias_sq: torch.Tensor | None,
    r: Roundoff,
    margin: float,
    out_sq: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bound on |sum_{i in b} out[i, c] - (sum_{i in b} a_i) . m_c - n_b beta_c| per (b, c).

    Args:
        q: the GEMM's reduction length (inner dimension).
        block_rows: (B,) rows n_b in each checksum block.
        a_sq: (B,) sum of squared row norms of A over the block, sum_{i in b} ||a_i||^2.
        s_sq: (B,) ||sum_{i in b} a_i||^2, the checksum row's own squared norm.
        m_sq: (p,) squared column norms of M, ||m_c||^2.
        bias_sq: (p,) beta_c^2, or None without a bias.
        r: unit roundoffs; margin: lambda of the Azuma-Hoeffding tail.
        out_sq: (B, p) sum over the block of the squared outputs, for a low-precision output
            type: its rounding, u_out |y_ic| per element, is then bounded by the output itself
            (about sqrt(q) tighter than through rho).

    Per output element the GEMM makes at most 2q + 2 roundings (q products, q additions, the bias,
    the output) plus 2q input roundings, each at most u * rho with rho = ||a_i|| ||m_c|| + |beta_c|
    >= sum_l |a_il m_lc| + |beta_c| (Cauchy-Schwarz); summing n_b rows of the block adds n_b - 1
    roundings of partial sums no larger than sum_i rho_i (both checksum sums: output and A), and the
    checksum GEMM 2q + 1 roundings no larger than ||s_b|| ||m_c|| + n_b |beta_c|. With
    sum_i rho_i^2 <= 2 ||m_c||^2 a_sq + 2 n_b beta_c^2 this gives sum c_t^2 <= the terms below.
    A second-order remainder (products of two roundings) is added explicitly: negligible in float32,
    not for half-precision accumulation over long reductions.
    """
    n_b = block_rows
    out_term = 0.0 if out_sq is not None else r.out**2
    per_element = (q + 1) * r.acc**2 + 2.1 * r.inp**2 + out_term
    check_gemm = (2 * q + 1) * (r.check_acc**2 + 2.1 * r.check_inp**2)
    k1 = 2 * per_element + 3 * n_b * n_b * r.check**2  # times ||m_c||^2 a_sq
    terms = (k1 * a_sq)[:, None] * m_sq[None, :]
    terms = terms + (2 * check_gemm * s_sq)[:, None] * m_sq[None, :]
    rho_sq = 2 * a_sq[:, None] * m_sq[None, :]
    if bias_sq is not None:
        k2 = (2 * per_element + 2 * n_b * n_b * r.check**2) * n_b  # times beta_c^2
        k4 = (2 * check_gemm + 4 * r.check**2) * n_b * n_b
        terms = terms + (k2 + k4)[:, None] * bias_sq[None, :]
        rho_sq = rho_sq + (2 * n_b)[:, None] * bias_sq[None, :]
    if out_sq is not None:
        terms = terms + 1.01 * r.out**2 * out_sq
    events = (2 * q + 2) * r.acc + 2 * r.inp + r.out
    second_order = math.expm1(events) - events
    remainder = second_order * torch.sqrt(n_b[:, None] * rho_sq)
    tiny = torch.finfo(a_sq.dtype).tiny * (2 * q + 8) * n_b[:, None]
    # 1.01: the norms and this formula are themselves computed in floating point
    return 1.01 * (margin * torch.sqrt(terms) + remainder) + tiny
