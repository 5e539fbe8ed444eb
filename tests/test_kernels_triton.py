"""Every Triton kernel against its specification: under the interpreter on CPU tensors (CI, no
GPU: TRITON_INTERPRET=1 is set here before the kernels are defined), and compiled on a real
CUDA device (`gpu` marker).

Fingerprints must be bit-identical to the C kernel and the torch specification. The bucket
check's summation order is part of its definition, so it too must be bit-identical (which is
stronger than "within the rounding bound", and is checked against that bound as well), and the
same run to run.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from slurm_guard.checks.consistency import conservation_bound
from slurm_guard.fingerprint import nh as ff
from slurm_guard.fingerprint.tree import as_int
from slurm_guard.kernels import bucket as kb
from slurm_guard.kernels import sketch as sk
from slurm_guard.kernels import triton_kernels as tk

if os.environ.get("SLURM_GUARD_REQUIRE_TRITON") == "1":
    import triton  # noqa: F401  (CI installs it: a missing Triton is a failure there, not a skip)
else:
    pytest.importorskip("triton", reason="Triton not installed (pip install slurm-guard[gpu])")

WORDS = sk.seed_words(99)
FP_SIZES = [0, 1, 3, 4095, 4096, 4097, 5 * 4096, 9 * 4096 + 13, 524_289]
CHECK_SIZES = [0, 1, 31, 4095, 4096, 4097, 3 * 4096 + 5, 40_000]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _devices() -> list[object]:
    cpu = pytest.param(
        "cpu",
        marks=pytest.mark.skipif(not tk.interpreting(), reason="CUDA here: compiled instead"),
        id="interpreter",
    )
    cuda = pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
        id="cuda",
    )
    return [cpu, cuda]


@pytest.fixture(scope="module")
def fp() -> ff.FastFingerprinter:
    return ff.FastFingerprinter(4321)


def _bits(t: torch.Tensor) -> list[int]:
    return [int(v) for v in t.cpu().view(torch.int64).tolist()]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("nbytes", FP_SIZES)
def test_triton_fingerprint_is_bit_identical(
    device: str, nbytes: int, fp: ff.FastFingerprinter
) -> None:
    t = torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes)
    )
    expected = as_int(ff.reference_fingerprint(t, fp, fp._keys))
    assert as_int(fp.tensor(t)) == expected  # the C kernel (or the spec without a compiler)
    assert as_int(ff.triton_fingerprint(t.to(device), fp, fp._keys)) == expected


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.bool])
def test_triton_fingerprint_binds_dtype_shape_and_views(
    device: str, dtype: torch.dtype, fp: ff.FastFingerprinter
) -> None:
    t = (torch.randn(37, 129, generator=torch.Generator().manual_seed(0)) * 50).to(dtype)
    for view in (t, t.t(), t[3:5, 7:]):  # odd offsets: the kernel gets a realigned copy
        expected = as_int(ff.reference_fingerprint(view, fp, fp._keys))
        assert as_int(ff.triton_fingerprint(view.to(device), fp, fp._keys)) == expected


@pytest.mark.parametrize("device", _devices())
def test_triton_fingerprint_sees_every_bit(device: str, fp: ff.FastFingerprinter) -> None:
    t = torch.randn(2048, generator=torch.Generator().manual_seed(1)).to(device)
    base = as_int(ff.triton_fingerprint(t, fp, fp._keys))
    raw = t.view(torch.uint8)
    for byte in (0, 1, 4095, 4096, 8191):
        for bit in (0, 7):
            flipped = raw.clone()
            flipped[byte] ^= 1 << bit
            assert as_int(ff.triton_fingerprint(flipped.view(torch.float32), fp, fp._keys)) != base


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", CHECK_SIZES)
def test_triton_bucket_check_is_bit_identical(device: str, dtype: torch.dtype, n: int) -> None:
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 7).to(dtype)
    expected = sk.reference_check(x, WORDS)
    first = tk.triton_check(x.to(device), WORDS)
    again = tk.triton_check(x.to(device), WORDS)
    assert _bits(first) == _bits(again)  # run to run
    assert _bits(first) == _bits(expected)  # and the same as the spec (and so the C kernel)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", CHECK_SIZES)
def test_triton_sketch_only_variant_is_bit_identical(
    device: str, dtype: torch.dtype, n: int
) -> None:
    """l1=False, as the hook runs it on the averaged bucket: the spec's bits ([S, 0.0, flag])."""
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 7).to(dtype)
    out = tk.triton_check(x.to(device), WORDS, l1=False)
    assert _bits(out) == _bits(sk.reference_check(x, WORDS, l1=False))
    assert _bits(out)[0] == _bits(sk.reference_check(x, WORDS))[0]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", CHECK_SIZES)
@pytest.mark.parametrize("divisor", [3, 8])
def test_triton_fused_division_is_bit_identical(
    device: str, dtype: torch.dtype, n: int, divisor: int
) -> None:
    """divide_by, as the hook runs it on the averaged bucket: the bucket holds the IEEE quotient
    and the output is the spec's sketch of it."""
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 7).to(dtype)
    expected = x.clone()
    sk.divide(expected, divisor)
    got = x.to(device)
    out = tk.triton_check(got, WORDS, l1=False, divide_by=divisor)
    assert torch.equal(got.cpu().view(torch.uint8), expected.view(torch.uint8))
    assert _bits(out) == _bits(sk.reference_check(expected, WORDS, l1=False))


@pytest.mark.parametrize("device", _devices())
def test_triton_sketch_only_variant_flags_nonfinite_and_huge_path(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.randn(9000)
    x[4321] = float("inf")
    out = tk.triton_check(x.to(device), WORDS, l1=False).cpu()
    assert out[2].item() == 1.0 and not torch.isfinite(out[0])
    monkeypatch.setattr(tk, "_FINISH_MAX", 2)  # partials finished by torch ops
    y = torch.randn(5 * 4096 + 3, generator=torch.Generator().manual_seed(8))
    got = tk.triton_check(y.to(device), WORDS, l1=False)
    assert _bits(got) == _bits(sk.reference_check(y, WORDS, l1=False))
    assert _bits(tk.triton_check(x.to(device), WORDS, l1=False)) == _bits(out)


@pytest.mark.parametrize("device", _devices())
def test_triton_bucket_check_conserves_within_the_bound(device: str) -> None:
    gen = torch.Generator().manual_seed(2)
    local = [torch.randn(20_000, generator=gen) for _ in range(3)]
    averaged = torch.stack(local).sum(0) / 3
    checks = [tk.triton_check(g.to(device), WORDS).cpu() for g in local]
    expected = sum(float(c[0]) for c in checks) / 3
    actual = float(tk.triton_check(averaged.to(device), WORDS)[0])
    bound = conservation_bound([float(c[1]) for c in checks], 2**-24, 20_000)
    assert abs(actual - expected) <= bound


@pytest.mark.parametrize("device", _devices())
def test_triton_bucket_check_flags_nonfinite(device: str) -> None:
    x = torch.randn(9000)
    x[4321] = float("nan")
    out = tk.triton_check(x.to(device), WORDS).cpu()
    assert out[2].item() == 1.0 and not torch.isfinite(out[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_dispatch_uses_triton_and_matches_cpu() -> None:
    """What the guard runs on CUDA tensors: the same bits as on CPU."""
    fp = ff.FastFingerprinter(7)
    t = torch.randn(3_000_001, generator=torch.Generator().manual_seed(3))
    assert as_int(fp.tensor(t.cuda())) == as_int(fp.tensor(t))
    assert kb.backend(torch.device("cuda")) == "triton"
    assert _bits(kb.bucket_check(t.cuda(), WORDS)) == _bits(kb.bucket_check(t, WORDS))


@pytest.mark.parametrize("device", _devices())
def test_triton_bucket_check_huge_bucket_path_is_bit_identical(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past _FINISH_MAX chunks the partials are finished by torch ops: the same bits."""
    monkeypatch.setattr(tk, "_FINISH_MAX", 2)
    x = torch.randn(5 * 4096 + 3, generator=torch.Generator().manual_seed(8))
    assert _bits(tk.triton_check(x.to(device), WORDS)) == _bits(sk.reference_check(x, WORDS))
