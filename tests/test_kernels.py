"""The C kernels: they compile cleanly, and the fused bucket check matches its specification.

The sketch's definition (slurm_guard/kernels/sketch.py) fixes the float64 summation order, so the
C kernel, the torch specification and the Triton kernel must agree bit for bit, whatever the
thread count: the averaged bucket's sketch is compared across ranks by its bits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slurm_guard.fingerprint import nh as ff
from slurm_guard.kernels import bucket as kb
from slurm_guard.kernels import native as nat
from slurm_guard.kernels import sketch as sk

WORDS = sk.seed_words(1234)
SOURCES = {"nh_fingerprint.c": ff.kernel_defines(), "bucket_check.c": sk.kernel_defines()}
needs_cc = pytest.mark.skipif(nat.compiler() is None, reason="no C compiler on PATH")
needs_native = pytest.mark.skipif(sk.native() is None, reason="bucket-check kernel not built")
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# empty, sub-word, one sign word, chunk boundaries, several chunks with a ragged tail
SIZES = [0, 1, 31, 33, 4095, 4096, 4097, 3 * 4096 + 7, 70_001]


def _bits(t: torch.Tensor) -> list[int]:
    return [int(v) for v in t.view(torch.int64).tolist()]


@needs_cc
@pytest.mark.parametrize("name", sorted(SOURCES))
@pytest.mark.parametrize("flags", [nat.NATIVE_FLAGS, nat.BASE_FLAGS], ids=["native", "portable"])
def test_c_sources_compile_with_warnings_as_errors(
    tmp_path: Path, name: str, flags: list[str]
) -> None:
    proc = nat.compile_source(name, SOURCES[name], [*flags, *nat.WARNING_FLAGS], tmp_path / "k.so")
    assert proc.returncode == 0, proc.stderr


@needs_cc
def test_a_source_without_its_constants_does_not_compile(tmp_path: Path) -> None:
    """Constants come from Python with -D: the C file must not carry its own copy."""
    proc = nat.compile_source("bucket_check.c", {}, nat.BASE_FLAGS, tmp_path / "k.so")
    assert proc.returncode != 0 and "CHUNK_LOG2" in proc.stderr


def test_sources_are_package_data() -> None:
    assert "sg_check_chunks" in nat.source("bucket_check.c")
    assert "nh_block" in nat.source("nh_fingerprint.c")


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_native_check_matches_the_specification_bit_for_bit(dtype: torch.dtype, n: int) -> None:
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)
    kernel = sk.native()
    assert kernel is not None
    assert _bits(sk.native_check(kernel, x, WORDS)) == _bits(sk.reference_check(x, WORDS))


@needs_native
def test_native_check_does_not_depend_on_the_thread_count() -> None:
    x = torch.randn(3_000_000 + 123, generator=torch.Generator().manual_seed(5))
    kernel = sk.native()
    assert kernel is not None
    results = {tuple(_bits(sk.native_check(kernel, x, WORDS, threads=t))) for t in (1, 2, 3, 7)}
    assert results == {tuple(_bits(sk.reference_check(x, WORDS)))}


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_sketch_only_variant_keeps_the_sketch_bits(dtype: torch.dtype, n: int) -> None:
    """l1=False (the averaged bucket): the same S bits as the full check, A reported as 0.0,
    the C kernel bit-identical to the spec, on one thread and on several."""
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)
    kernel = sk.native()
    assert kernel is not None
    full = sk.reference_check(x, WORDS)
    spec = sk.reference_check(x, WORDS, l1=False)
    assert _bits(spec) == _bits(torch.stack([full[0], torch.tensor(0.0).double(), full[2]]))
    assert _bits(sk.native_check(kernel, x, WORDS, l1=False)) == _bits(spec)
    assert _bits(kb.bucket_check(x, WORDS, l1=False)) == _bits(spec)


@needs_native
def test_sketch_only_variant_does_not_depend_on_the_thread_count() -> None:
    x = torch.randn(3_000_000 + 123, generator=torch.Generator().manual_seed(5))
    kernel = sk.native()
    assert kernel is not None
    runs = {tuple(_bits(sk.native_check(kernel, x, WORDS, t, l1=False))) for t in (1, 2, 3, 7)}
    assert runs == {tuple(_bits(sk.reference_check(x, WORDS, l1=False)))}


def _quotient_input(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Values across the exponent range, subnormal quotients and a signed zero included."""
    g = torch.Generator().manual_seed(n + 17)
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp(
        torch.randn(n, generator=g, dtype=torch.float64) * 12
    )
    x = x.to(dtype)
    if n > 3:
        x[1] = torch.finfo(dtype).tiny * 3  # a subnormal quotient
        x[2] = -0.0
    return x


@needs_native
@pytest.mark.parametrize("dtype", sk.DIVIDABLE)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("divisor", [2, 3, 6, 8, 1000])
def test_fused_division_gives_the_quotient_and_its_sketch(
    dtype: torch.dtype, n: int, divisor: int
) -> None:
    """divide_by (the averaged bucket): the bucket holds the IEEE quotient, as torch's division
    leaves it, and the result is the spec's sketch of that quotient, on one thread and several."""
    x = _quotient_input(n, dtype)
    expected = x.clone()
    sk.divide(expected, divisor)
    assert torch.equal(expected.view(-1), (x.double() / divisor).to(dtype))  # IEEE: one rounding
    spec = _bits(sk.reference_check(expected, WORDS, l1=False))
    kernel = sk.native()
    assert kernel is not None
    for threads in (1, 3):
        got = x.clone()
        out = sk.native_check(kernel, got, WORDS, threads, l1=False, divide_by=divisor)
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
        assert _bits(out) == spec
    got = x.clone()
    assert _bits(kb.bucket_check(got, WORDS, l1=False, divide_by=divisor)) == spec
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


@needs_native
def test_fused_division_splits_over_threads_without_dividing_twice() -> None:
    x = torch.randn(3_000_000 + 123, generator=torch.Generator().manual_seed(6))
    expected = x / 3
    kernel = sk.native()
    assert kernel is not None
    for threads in (1, 2, 7):
        got = x.clone()
        out = sk.native_check(kernel, got, WORDS, threads, l1=False, divide_by=3)
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
        assert _bits(out) == _bits(sk.reference_check(expected, WORDS, l1=False))


def test_division_refuses_what_it_cannot_do_exactly() -> None:
    with pytest.raises(ValueError, match="outside"):
        sk.divide(torch.ones(4), 0)
    with pytest.raises(ValueError, match="outside"):
        sk.divide(torch.ones(4), sk.MAX_DIVISOR + 1)
    kernel = sk.native()
    if kernel is not None:
        with pytest.raises(ValueError, match="contiguous float32 or float64"):
            sk.native_check(kernel, torch.ones(8, dtype=torch.float16), WORDS, divide_by=2)
        with pytest.raises(ValueError, match="contiguous float32 or float64"):
            sk.native_check(kernel, torch.ones(8, 2)[:, 0], WORDS, divide_by=2)
    # bucket_check falls back to the torch division for what the kernels do not fuse
    half = torch.full((5000,), 3.0, dtype=torch.float16)
    out = kb.bucket_check(half, WORDS, l1=False, divide_by=2)
    assert torch.equal(half, torch.full((5000,), 1.5, dtype=torch.float16))
    assert _bits(out) == _bits(sk.reference_check(half, WORDS, l1=False))


def test_specification_is_the_sketch_and_norm_it_claims() -> None:
    """S = <x, r> with r = +-1 from sign_bits, A = ||x||_1: close to float64 dot products."""
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    r = 1.0 - 2.0 * sk.sign_bits(x.numel(), WORDS, x.device).double()
    s, a, flag = sk.reference_check(x, WORDS).tolist()
    assert s == pytest.approx(float((x * r).sum()), rel=0, abs=1e-9)
    assert a == pytest.approx(float(x.abs().sum()), rel=1e-12)
    assert flag == 0.0
    assert 0.4 < float((r < 0).double().mean()) < 0.6  # balanced signs


def test_signs_depend_on_the_seed_and_the_element() -> None:
    a = sk.sign_bits(4096, sk.seed_words(1), torch.device("cpu"))
    b = sk.sign_bits(4096, sk.seed_words(2), torch.device("cpu"))
    assert 0.4 < float((a != b).double().mean()) < 0.6
    assert 0.4 < float(a.double().mean()) < 0.6


@pytest.mark.parametrize("impl", ["reference", "native"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_nonfinite_element_sets_the_flag_and_the_sketch(impl: str, bad: float) -> None:
    if impl == "native" and sk.native() is None:
        pytest.skip("bucket-check kernel not built")
    for dtype in DTYPES:
        x = torch.randn(10_000, generator=torch.Generator().manual_seed(0)).to(dtype)
        x[7777] = bad
        out = kb.bucket_check(x, WORDS) if impl == "native" else sk.reference_check(x, WORDS)
        assert out[2].item() == 1.0 and not torch.isfinite(out[0]), dtype


@pytest.mark.parametrize("impl", ["reference", "native"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_sketch_only_variant_flags_a_nonfinite_element(impl: str, bad: float) -> None:
    if impl == "native" and sk.native() is None:
        pytest.skip("bucket-check kernel not built")
    check = kb.bucket_check if impl == "native" else sk.reference_check
    for dtype in DTYPES:
        x = torch.randn(10_000, generator=torch.Generator().manual_seed(0)).to(dtype)
        assert check(x, WORDS, l1=False)[2].item() == 0.0
        x[7777] = bad
        out = check(x, WORDS, l1=False)
        assert out[2].item() == 1.0 and not torch.isfinite(out[0]), dtype


def test_large_finite_values_never_overflow_the_float64_sums() -> None:
    x = torch.full((100_000,), torch.finfo(torch.float32).max)
    out = kb.bucket_check(x, WORDS)
    assert torch.isfinite(out[:2]).all() and out[2].item() == 0.0


@needs_native
def test_conservation_holds_within_the_stated_rounding() -> None:
    """mean of the local sketches vs the sketch of the averaged bucket: drift below the bound."""
    from slurm_guard.checks.consistency import conservation_bound

    gen = torch.Generator().manual_seed(11)
    local = [torch.randn(300_000, generator=gen) * 10 ** (k - 1) for k in range(3)]
    averaged = torch.stack(local).sum(0) / len(local)
    checks = [kb.bucket_check(g, WORDS) for g in local]
    expected = sum(float(c[0]) for c in checks) / len(local)
    actual = float(kb.bucket_check(averaged, WORDS)[0])
    bound = conservation_bound([float(c[1]) for c in checks], 2.0**-24, 300_000)
    assert abs(actual - expected) <= bound
    # and the check has teeth: one element off by 1e-3 of the L1 norm is far outside the bound
    averaged[12345] += 1e-3 * float(sum(c[1] for c in checks))
    assert abs(float(kb.bucket_check(averaged, WORDS)[0]) - expected) > 10 * bound


def _mix_py(x: int) -> int:
    x ^= x >> 16
    x = (x * sk.MIX_M1) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * sk.MIX_M2) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_sign_hash_is_the_32_bit_finaliser_it_claims() -> None:
    """The torch spec forms 32-bit products from 16-bit halves: no int64 overflow anywhere."""
    xs = [0, 1, 0xFFFF, 0x10000, 2**31 - 1, 2**31, 2**32 - 1, 123_456_789]
    assert [int(v) for v in sk._mix32(torch.tensor(xs))] == [_mix_py(x) for x in xs]
    n = sk._SIGN_SLAB_WORDS * 32 + 45  # crosses a slab boundary
    bits = sk.sign_bits(n, WORDS, torch.device("cpu"))
    for e in (0, 31, 32, sk._SIGN_SLAB_WORDS * 32 - 1, sk._SIGN_SLAB_WORDS * 32, n - 1):
        word = _mix_py(_mix_py((e >> 5) ^ WORDS[0]) ^ WORDS[1])
        assert bool(bits[e]) == bool((word >> (e & 31)) & 1), e
