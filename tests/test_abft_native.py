"""The C checksum passes of checked GEMMs (`kernels/abft_check.c`) against the torch path.

The torch implementation in `slurm_guard.abft.checked` is the specification. The two cannot agree
bit for bit on a clean GEMM: there the residual is pure rounding noise, and its value depends on
the order in which each implementation sums a block (torch's reduction kernels vs the C loop). What
must hold instead, and is tested here on ragged and even shapes, with and without bias, for
nn.Linear and Conv1D, in all three passes:

* the statistics (block sums, squared norms) agree to float32 rounding;
* clean GEMMs stay far below the bound in both;
* with an error d far above the bound injected into one element, the residual is d up to rounding
  noise, so the two ratios sqrt(ratio) = |d + noise| / bound agree to the bound's own agreement
  plus noise / d: relative 1e-4 covers both (the noise is below 0.1 bound, d is 1e4 bounds
  and more; the bounds differ by float32 vs float64 arithmetic, ~1e-6);
* a non-finite product and an all-zero block behave the same in both (fail / pass).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path
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

from slurm_guard.abft import PASSES, attach
from slurm_guard.abft.bounds import SUM_GROUP
from slurm_guard.abft.checksums import block_checksums, col_checksums, native_stats, signs
from slurm_guard.kernels import abft_native as nk
from slurm_guard.kernels import native as nat

needs_native = pytest.mark.skipif(nk.native() is None, reason="abft kernel not built")


@pytest.mark.skipif(nat.compiler() is None, reason="no C compiler on PATH")
@pytest.mark.parametrize("flags", [nat.NATIVE_FLAGS, nat.BASE_FLAGS], ids=["native", "portable"])
def test_the_source_compiles_with_warnings_as_errors(tmp_path: Path, flags: list[str]) -> None:
    out = tmp_path / "k.so"
    proc = nat.compile_source(nk.C_SOURCE, nk.kernel_defines(), [*flags, *nat.WARNING_FLAGS], out)
    assert proc.returncode == 0, proc.stderr


@needs_native
def test_the_portable_build_gives_the_vector_builds_bits(tmp_path: Path) -> None:
    """The AVX2 paths form the same float32 groups, float64 lanes and joining tree as the plain C
    a machine without AVX2 (or an ARM node) compiles: same bits, so that path is tested here too."""
    out = tmp_path / "portable.so"
    proc = nat.compile_source(nk.C_SOURCE, nk.kernel_defines(), nat.BASE_FLAGS, out)
    assert proc.returncode == 0, proc.stderr
    portable, vector = nk._Native(ctypes.CDLL(str(out))), nk.native()
    assert vector is not None
    gen = torch.Generator().manual_seed(11)
    for n, d, block in ((70, 33, 32), (128, 256, 64), (45, 100, 8), (7, 5, 64)):
        a = torch.randn(n, d, generator=gen) * 3
        got = [native_stats(k, a, block, rows=True, cols=True) for k in (portable, vector)]
        for name in ("rows", "cols", "norms"):
            assert torch.equal(getattr(got[0], name), getattr(got[1], name)), name
        norms = [nk.weight_norms(k, a) for k in (portable, vector)]
        assert all(torch.equal(x, y) for x, y in zip(*norms, strict=True))
        pred = got[1].rows
        assert pred is not None
        sign = signs(n, torch.float32, a.device)
        m_sq = torch.rand(d, dtype=torch.float64, generator=gen) + 0.5
        f = (ctypes.c_double * 5)(1e-14, 1e-14, 1e-32, 100.0, 1e-38)
        ratios = [
            nk.compare(k, a, block, sign, pred, a[0], got[1].a_sq, got[1].s_sq, m_sq, f)
            for k in (portable, vector)
        ]
        assert ratios[0] == ratios[1] > 0
        col_sign = signs(d, torch.float32, a.device)
        assert got[1].cols is not None
        pred_t = got[1].cols.t().contiguous()  # (column blocks, n)
        row_sq = torch.rand(n, dtype=torch.float64, generator=gen) + 0.5
        ratios = [
            nk.compare_transposed(
                k, a, block, col_sign, pred_t, got[1].ca_sq, got[1].cs_sq, row_sq, f
            )
            for k in (portable, vector)
        ]
        assert ratios[0] == ratios[1] > 0


@needs_native
@pytest.mark.parametrize(
    ("n", "d", "block"), [(64, 32, 32), (70, 33, 32), (5, 7, 32), (45, 100, 8)]
)
def test_stats_agree_with_torch_sums(n: int, d: int, block: int) -> None:
    kernel = nk.native()
    assert kernel is not None
    a = torch.randn(n, d, generator=torch.Generator().manual_seed(n * d)) * 3
    st = native_stats(kernel, a, block, rows=True, cols=True)
    a64 = a.double()
    sq = a64.square()
    signed = a64 * signs(n, torch.float64, a.device)[:, None]
    rows64 = torch.stack([signed[i : i + block].sum(0) for i in range(0, n, block)])
    signed = a64 * signs(d, torch.float64, a.device)[None, :]
    cols64 = torch.stack([signed[:, j : j + block].sum(1) for j in range(0, d, block)], 1)
    nb, nc = rows64.shape[0], cols64.shape[1]
    magnitude_rows = torch.stack([a64[i : i + block].abs().sum(0) for i in range(0, n, block)])
    magnitude_cols = torch.stack(
        [a64[:, j : j + block].abs().sum(1) for j in range(0, d, block)], 1
    )
    # both paths: float32 partial sums of SUM_GROUP terms (G - 1 roundings, each within u32 of
    # the group's magnitudes) added in float64; the C sums are then rounded once to float32
    assert st.rows is not None and st.cols is not None
    u32 = 2.0**-24
    for got, exact, spec, magnitude in (
        (st.rows, rows64, block_checksums(a, block), magnitude_rows),
        (st.cols, cols64, col_checksums(a, block), magnitude_cols),
    ):
        allowed = u32 * exact.abs() + (SUM_GROUP - 1) * u32 * magnitude
        assert bool(((got.double() - exact).abs() <= allowed * 1.001).all())
        assert bool(((spec - exact).abs() <= allowed * 1.001).all())  # same model
    norms = st.norms
    a_sq = torch.stack([sq[i : i + block].sum() for i in range(0, n, block)])
    ca_sq = torch.stack([sq[:, j : j + block].sum() for j in range(0, d, block)])
    for got, want in (
        (norms[:nb], a_sq),
        (norms[nb : 2 * nb], rows64.square().sum(1)),
        (st.col_sq(), sq.sum(0)),
        (norms[2 * nb + d : 2 * nb + d + nc], ca_sq),
        (norms[2 * nb + d + nc :], cols64.square().sum(0)),
    ):
        assert torch.allclose(got, want, rtol=1e-6, atol=0)
    row_sq, col_sq = nk.weight_norms(kernel, a)
    assert torch.allclose(row_sq, sq.sum(1), rtol=1e-6, atol=0)
    assert torch.allclose(col_sq, sq.sum(0), rtol=1e-6, atol=0)


def _ratios(
    model: nn.Module,
    x: torch.Tensor,
    monkeypatch: pytest.MonkeyPatch,
    use_native: bool,
    fault: tuple[int, float] | None = None,
    block: int = 32,
) -> tuple[list[list[float]], list[Any]]:
    """`one_step_ratios` by the C path or the torch path, and the type of each result."""
    with monkeypatch.context() as mp:
        if not use_native:
            mp.setattr(nk, "native", lambda: None)
        worst, results = one_step_ratios(model, x, block, fault)
    return worst, [type(r) for r in results]


@needs_native
@pytest.mark.parametrize(("kind", "n", "k", "p", "bias", "block"), LAYER_SHAPES)
def test_native_and_torch_paths_agree(
    monkeypatch: pytest.MonkeyPatch, kind: str, n: int, k: int, p: int, bias: bool, block: int
) -> None:
    model = two_layers(kind, k, p, bias)
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
    clean_n, kinds_n = _ratios(model, x, monkeypatch, True, block=block)
    clean_t, kinds_t = _ratios(model, x, monkeypatch, False, block=block)
    assert set(kinds_n) == {float} and float not in kinds_t  # each path really ran
    for row in clean_n + clean_t:
        assert all(0 <= r < 0.2 for r in row), (clean_n, clean_t)  # far from a false alarm
    # an error of 100x the largest output magnitude: 1e4 bounds and more
    with torch.no_grad():
        scale = float(model(x).abs().max()) + float(x.abs().max())
    for element in (0, 17, 10_000):
        faulty_n, _ = _ratios(model, x, monkeypatch, True, (element, 100 * scale), block)
        faulty_t, _ = _ratios(model, x, monkeypatch, False, (element, 100 * scale), block)
        for which in range(3):
            rn, rt = faulty_n[0][which], faulty_t[0][which]
            assert rn > 1e4 and rt > 1e4, (which, rn, rt)  # flagged by both
            assert rn == pytest.approx(rt, rel=1e-4), (which, rn, rt)
        assert all(0 <= r < 0.2 for r in faulty_n[1] + faulty_t[1])  # the clean layer passes


@needs_native
@pytest.mark.parametrize("use_native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_all_zero_blocks_pass_and_non_finite_products_fail(
    monkeypatch: pytest.MonkeyPatch, use_native: bool, kind: str
) -> None:
    """A zero block (padding tokens, ignored labels' zero gradients) has a zero residual and,
    without bias, a zero rounding bound: 0 / 0 must not become a false alarm."""
    with monkeypatch.context() as mp:
        if not use_native:
            mp.setattr(nk, "native", lambda: None)
        kinds = zero_blocks_pass_and_non_finite_products_fail(kind)
    assert (float in kinds) == use_native


@needs_native
def test_non_contiguous_input_goes_through_the_native_path() -> None:
    torch.manual_seed(2)
    layer = nn.Linear(24, 40)
    handle = attach(layer)
    x = torch.randn(24, 64).t().requires_grad_()  # (64, 24), column-major
    layer(x).sum().backward()  # type: ignore[no-untyped-call]
    assert [type(r) for _, r in handle.sites[0].results] == [float, float, float]
    assert handle.findings(handle.collect()) == []


def test_slurm_guard_native_0_selects_the_torch_path() -> None:
    code = (
        "import torch; from torch import nn; from slurm_guard.abft import attach\n"
        "l = nn.Linear(8, 8); h = attach(l); l(torch.randn(40, 8)).sum().backward()\n"
        "assert all(isinstance(r, torch.Tensor) for _, r in h.sites[0].results)\n"
        "assert h.findings(h.collect()) == []\n"
    )
    env = {**os.environ, "SLURM_GUARD_NATIVE": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr


@needs_native
@pytest.mark.parametrize("which", range(3))
def test_a_probe_armed_by_the_fault_itself_gets_its_bound(which: int) -> None:
    """benchmarks/campaign.py arms `Site.probe` from inside the fault's injector, after the C
    path was chosen for the pass: that pass must still report its per-element bound."""
    torch.manual_seed(3)
    layer = nn.Linear(24, 40)
    handle = attach(layer)
    site = handle.sites[0]

    def fault(t: torch.Tensor) -> None:
        t.view(-1)[5] += 1e3
        site.probe = {"which": which}

    site.injectors = {which: [fault]}
    layer(torch.randn(64, 24, requires_grad=True)).sum().backward()  # type: ignore[no-untyped-call]
    assert site.probe is not None and "bound2" in site.probe
    assert [f.gemm_pass for f in handle.findings(handle.collect())] == [PASSES[which]]


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "torch"])
def test_operands_near_the_float32_range_never_pass_a_fault_unseen(
    monkeypatch: pytest.MonkeyPatch, use_native: bool
) -> None:
    """Inputs of ~1e19 (finite, so the guard's finite checks pass them) square to beyond
    float32's range: a bound computed from those squares overflows, and dividing by it would
    make every residual 0. The check must then fail closed (or, with norms kept in float64,
    still see the fault), never report a faulty product as clean."""
    model = two_layers("linear", 16, 24, False)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(3)) * 1e19
    worst, _ = _ratios(model, x, monkeypatch, use_native, fault=(5, 1e17))
    assert all(not ratio <= 1.0 for ratio in worst[0]), worst
