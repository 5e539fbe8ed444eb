"""The Triton checksum passes of checked GEMMs (`kernels/abft_triton.py`, what CUDA runs)
against the C passes: under the interpreter on CPU tensors (CI has no GPU: TRITON_INTERPRET=1 is
set here before the kernels are defined), and compiled on a CUDA device (`gpu` marker).

What must hold:
* an operand's checksum rows (the checksum GEMM's input) and a product's row-block sums are
  bit-identical to the C passes' (the same summation order), so a row-blocked check gives the
  C path's ratio up to the norms' rounding; the column-block sums and the norms agree to
  float32 rounding (their order differs, which the bound allows);
* in checked layers (nn.Linear and Conv1D, ragged and even shapes, with and without bias) the
  Triton path is the one that runs, leaves one 0-dim device tensor per check (no host read),
  keeps clean GEMMs far below the bound, and flags an injected error in every pass with the C
  path's ratio;
* a non-finite product fails, an all-zero block passes.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
from abft_workers import (
    LAYER_SHAPES,
    one_step_ratios,
    two_layers,
    zero_blocks_pass_and_non_finite_products_fail,
)
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from slurm_guard.abft.bounds import factors, roundoff
from slurm_guard.abft.checksums import signs
from slurm_guard.kernels import abft_native as nk
from slurm_guard.kernels import abft_triton as at
from slurm_guard.kernels import triton_kernels as tk

if os.environ.get("SLURM_GUARD_REQUIRE_TRITON") == "1":
    import triton  # noqa: F401  (CI installs it: a missing Triton is a failure there, not a skip)
else:
    pytest.importorskip("triton", reason="Triton not installed (pip install slurm-guard[gpu])")

needs_native = pytest.mark.skipif(nk.native() is None, reason="abft C kernel not built")
interpreter = pytest.mark.skipif(not tk.interpreting(), reason="CUDA here: compiled instead")
CPU = torch.device("cpu")


@pytest.fixture
def triton_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(at, "force_on_cpu", True)


def _factors(q: int, n_max: int) -> Any:
    return factors(q, float(n_max), roundoff(torch.float32, CPU), 10.0)


@interpreter
@needs_native
@pytest.mark.parametrize(
    ("n", "d", "block"), [(64, 48, 64), (70, 33, 16), (5, 7, 4), (300, 130, 64), (129, 260, 32)]
)
def test_operand_passes_match_the_c_passes(triton_on_cpu: None, n: int, d: int, block: int) -> None:
    kernel = nk.native()
    assert kernel is not None
    a = torch.randn(n, d, generator=torch.Generator().manual_seed(n)) * 3 + 0.5
    rs, cs = signs(n, torch.float32, CPU), signs(d, torch.float32, CPU)
    c, t = nk.stats(kernel, a, block, rs, cs), at.stats(a, block, rs, cs)
    nb, nc = -(-n // block), -(-d // block)
    assert c.rows is not None and t.rows is not None and t.a_sq is not None
    assert torch.equal(c.rows, t.rows)  # the checksum GEMM's input: the same bits
    assert c.cols is not None and t.cols is not None and t.ca_sq is not None
    assert torch.allclose(c.cols, t.cols, rtol=1e-6, atol=1e-5)
    for got, want in (
        (t.a_sq, c.norms[:nb]),
        (t.s_sq, c.norms[nb : 2 * nb]),
        (t.col_sq(), c.col_sq()),
        (t.ca_sq, c.norms[2 * nb + d : 2 * nb + d + nc]),
        (t.cs_sq, c.norms[2 * nb + d + nc :]),
    ):
        assert got is not None and torch.allclose(got, want, rtol=1e-6, atol=0)
    row_sq, col_sq = at.weight_norms(a)
    assert torch.allclose(row_sq, nk.weight_norms(kernel, a)[0], rtol=1e-6, atol=0)
    assert torch.allclose(col_sq, nk.weight_norms(kernel, a)[1], rtol=1e-6, atol=0)


@interpreter
@needs_native
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    ("n", "k", "p", "block"), [(64, 48, 40, 64), (70, 33, 47, 16), (5, 7, 3, 4)]
)
def test_product_pass_gives_the_c_ratio(
    triton_on_cpu: None, n: int, k: int, p: int, block: int, bias: bool
) -> None:
    """Same row-block sums, same prediction: the ratio differs only by the norms' rounding."""
    kernel = nk.native()
    assert kernel is not None
    gen = torch.Generator().manual_seed(k)
    x, w = torch.randn(n, k, generator=gen), torch.randn(p, k, generator=gen) * 0.1
    b = torch.randn(p, generator=gen) if bias else None
    y = nn.functional.linear(x, w, b)
    rs = signs(n, torch.float32, CPU)
    c, t = nk.stats(kernel, x, block, rs, None), at.stats(x, block, rs, None)
    assert c.rows is not None and t.a_sq is not None and t.s_sq is not None
    pred = torch.mm(c.rows, w.t())
    m_sq = nk.weight_norms(kernel, w)[0]
    f = _factors(k, min(n, block))
    ft = at.factors_on(f.numbers, CPU)
    for error in (0.0, 1e-2, 10.0):
        faulty = y.clone()
        faulty[n // 2, p // 3] += error
        want = nk.compare(kernel, faulty, block, rs, pred, b, c.a_sq, c.s_sq, m_sq, f.native)
        got = at.compare(faulty, block, rs, pred, b, t.a_sq, t.s_sq, m_sq, ft)
        assert got.dim() == 0 and got.dtype == torch.float64
        assert float(got) == pytest.approx(want, rel=1e-9), error
        assert (float(got) > 1) == (error >= 1e-2)  # clean passes, both errors are seen
    for bad in (math.nan, math.inf):
        faulty = y.clone()
        faulty[0, 0] = bad
        assert math.isinf(float(at.compare(faulty, block, rs, pred, b, t.a_sq, t.s_sq, m_sq, ft)))
    # a bound that overflowed (operands near the range) verifies nothing: it fails, as in C
    huge = torch.full_like(m_sq, math.inf)
    assert math.isinf(nk.compare(kernel, y, block, rs, pred, b, c.a_sq, c.s_sq, huge, f.native))
    assert math.isinf(float(at.compare(y, block, rs, pred, b, t.a_sq, t.s_sq, huge, ft)))


@interpreter
@needs_native
@pytest.mark.parametrize(("n", "r", "c", "block"), [(64, 48, 40, 16), (70, 33, 130, 64)])
def test_transposed_product_pass_agrees_with_the_c_pass(
    triton_on_cpu: None, n: int, r: int, c: int, block: int
) -> None:
    """A weight gradient held transposed: its checked rows are the stored columns."""
    kernel = nk.native()
    assert kernel is not None
    gen = torch.Generator().manual_seed(r)
    p_op, q_op = torch.randn(n, c, generator=gen), torch.randn(n, r, generator=gen)
    stored = (p_op.t() @ q_op).t().contiguous()  # (r, c): the checked (c, r) product, transposed
    cs = signs(c, torch.float32, CPU)
    pc, pt = nk.stats(kernel, p_op, block, None, cs), at.stats(p_op, block, None, cs)
    assert pc.cols is not None and pt.ca_sq is not None and pt.cs_sq is not None
    pred = torch.mm(pc.cols.t(), q_op)
    m_sq = q_op.square().sum(0, dtype=torch.float64)
    f = _factors(n, min(c, block))
    ft = at.factors_on(f.numbers, CPU)
    clean = at.compare_transposed(stored, block, cs, pred, pt.ca_sq, pt.cs_sq, m_sq, ft)
    assert 0 <= float(clean) < 0.01  # rounding noise only (its value depends on the grouping)
    faulty = stored.clone()
    faulty[r // 2, c // 2] += 1.0
    want = nk.compare_transposed(
        kernel, faulty, block, cs, pred, pc.ca_sq, pc.cs_sq, m_sq, f.native
    )
    got = at.compare_transposed(faulty, block, cs, pred, pt.ca_sq, pt.cs_sq, m_sq, ft)
    assert want > 1e3 and float(got) == pytest.approx(want, rel=1e-4)


def _agree(
    kind: str, n: int, k: int, p: int, bias: bool, block: int, device: str, other: str
) -> None:
    """The Triton path in checked layers against the C path (CPU) or the torch path (CUDA)."""
    model = two_layers(kind, k, p, bias).to(device)
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(n)).to(device)
    clean, results = one_step_ratios(model, x, block)
    assert results and all(isinstance(r, torch.Tensor) and r.dim() == 0 for r in results)
    assert all(r.device.type == device for r in results)
    with pytest.MonkeyPatch.context() as mp:  # the reference path
        mp.setattr(at, "available", lambda device: False)
        if other == "torch":
            mp.setattr(nk, "native", lambda: None)
        reference, ref_results = one_step_ratios(model, x, block)
        assert not any(isinstance(r, torch.Tensor) and r.dim() == 0 for r in ref_results)
    for row in clean + reference:
        assert all(0 <= r < 0.2 for r in row), (clean, reference)  # far from a false alarm
    with torch.no_grad():
        scale = float(model(x).abs().max()) + float(x.abs().max())
    for element in (0, 17, 10_000):
        fault = (element, 100 * scale)
        faulty, _ = one_step_ratios(model, x, block, fault)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(at, "available", lambda device: False)
            if other == "torch":
                mp.setattr(nk, "native", lambda: None)
            expected, _ = one_step_ratios(model, x, block, fault)
        for which in range(3):
            got, want = faulty[0][which], expected[0][which]
            assert got > 1e4 and want > 1e4, (which, got, want)  # flagged by both
            assert got == pytest.approx(want, rel=1e-4), (which, got, want)
        assert all(0 <= r < 0.2 for r in faulty[1])  # the clean layer passes


@interpreter
@needs_native
@pytest.mark.parametrize(("kind", "n", "k", "p", "bias", "block"), LAYER_SHAPES)
def test_checked_layers_take_the_triton_path_and_agree_with_the_c_path(
    triton_on_cpu: None, kind: str, n: int, k: int, p: int, bias: bool, block: int
) -> None:
    _agree(kind, n, k, p, bias, block, "cpu", "native")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("kind", "n", "k", "p", "bias", "block"), LAYER_SHAPES)
def test_on_cuda_checked_layers_take_the_triton_path_and_agree_with_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, kind: str, n: int, k: int, p: int, bias: bool, block: int
) -> None:
    # full float32 checksum GEMMs: the two paths' checksum rows differ in their last bits, and
    # TF32 would round those differences up to the ratios' 1e-4 agreement
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    _agree(kind, n, k, p, bias, block, "cuda", "torch")


@interpreter
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # numpy, on the NaN inputs
@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_all_zero_blocks_pass_and_non_finite_products_fail(triton_on_cpu: None, kind: str) -> None:
    kinds = zero_blocks_pass_and_non_finite_products_fail(kind)
    assert kinds and set(kinds) == {torch.Tensor}  # the Triton path ran
