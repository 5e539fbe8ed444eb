"""The fast fingerprint: the guarantees of the reference one; native kernel == torch spec.

Every property is checked on both implementations: the native kernel (when a C compiler is
available; skipped otherwise) and the pure-torch one that is its specification and fallback.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from slurm_guard.fingerprint import nh as ff
from slurm_guard.fingerprint.tree import as_int

SEED = 1234
Hash = Callable[[torch.Tensor], int]

native_only = pytest.mark.skipif(ff.native() is None, reason="no C compiler: torch path only")


@pytest.fixture(scope="module")
def fp() -> ff.FastFingerprinter:
    return ff.FastFingerprinter(SEED)


def _native(fp: ff.FastFingerprinter) -> Hash:
    return lambda t: as_int(fp.tensor(t))


def _torch(fp: ff.FastFingerprinter) -> Hash:
    return lambda t: as_int(ff.reference_fingerprint(t, fp, fp._keys))


@pytest.fixture(params=["native", "torch"])
def h(request: pytest.FixtureRequest, fp: ff.FastFingerprinter) -> Hash:
    if request.param == "native":
        if ff.native() is None:
            pytest.skip("no C compiler: torch path only")
        return _native(fp)
    return _torch(fp)


def _flip(t: torch.Tensor, byte: int, bit: int) -> torch.Tensor:
    out = t.clone()
    raw = out.view(-1).view(torch.uint8)
    raw[byte] ^= 1 << bit
    return out


# Sizes in bytes that cross every boundary: empty, sub-word, NH pair, block (4 KiB), tree row
# (128 blocks = 512 KiB) and a second tree level (> 1024 words at level 1 needs > 128 MiB; the
# level count itself is exercised by 3 rows).
SIZES = [0, 1, 3, 4, 7, 8, 4095, 4096, 4097, 524_287, 524_288, 524_289, 3 * 524_288 + 5]


@native_only
@pytest.mark.parametrize("nbytes", SIZES)
def test_native_matches_torch_reference_bit_for_bit(fp: ff.FastFingerprinter, nbytes: int) -> None:
    t = torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes)
    )
    assert _native(fp)(t) == _torch(fp)(t)


@native_only
@pytest.mark.parametrize("nbytes", [4097, 3 * 524_288 + 5])
@pytest.mark.parametrize("offset", [1, 2, 3])
def test_native_matches_torch_at_unaligned_addresses(
    fp: ff.FastFingerprinter, nbytes: int, offset: int
) -> None:
    # A contiguous slice starting mid-buffer: the kernel's vector loads and prefetches run from
    # an address that is not 4-byte aligned, and the last block is partial.
    base = torch.randint(
        0, 256, (nbytes + offset,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7)
    )
    t = base[offset:]
    assert t.is_contiguous() and t.data_ptr() % 4 != 0
    assert _native(fp)(t) == _torch(fp)(t)


@native_only
def test_native_matches_torch_on_tensors_streamed_from_memory(fp: ff.FastFingerprinter) -> None:
    # Just over STREAM_MIN_BYTES, the kernel's DRAM form of the loop; odd start, partial block.
    nbytes = ff.STREAM_MIN_BYTES + 4097
    base = torch.randint(
        0, 256, (nbytes + 1,), dtype=torch.uint8, generator=torch.Generator().manual_seed(11)
    )
    t = base[1:]
    assert _native(fp)(t) == _torch(fp)(t)


@native_only
def test_native_reads_parameters_that_require_grad(fp: ff.FastFingerprinter) -> None:
    w = torch.nn.Parameter(torch.randn(64, 33, generator=torch.Generator().manual_seed(3)))
    for view in (w, w.t()):  # contiguous: read in place; transposed: copied first
        assert _native(fp)(view) == _torch(fp)(view.detach())


@native_only
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.bool]
)
def test_native_matches_torch_for_dtypes_shapes_and_views(
    fp: ff.FastFingerprinter, dtype: torch.dtype
) -> None:
    t = (torch.randn(37, 129, generator=torch.Generator().manual_seed(0)) * 50).to(dtype)
    for view in (t, t.t(), t[::2], t[3:5, 7:]):
        assert _native(fp)(view) == _torch(fp)(view)


@native_only
def test_native_parallel_path_matches(fp: ff.FastFingerprinter) -> None:
    t = torch.randn(5_000_000, generator=torch.Generator().manual_seed(1))  # 20 MB: threads
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = _native(fp)(t)
        torch.set_num_threads(1)
        one = _native(fp)(t)
    finally:
        torch.set_num_threads(before)
    assert one == two


def test_equal_inputs_equal_fingerprints(h: Hash) -> None:
    t = torch.randn(10_000)
    assert h(t) == h(t.clone())
    assert as_int(ff.FastFingerprinter(SEED).tensor(t)) == as_int(
        ff.FastFingerprinter(SEED).tensor(t)
    )


@pytest.mark.parametrize("nbytes", [1, 4096, 4097, 9000])
def test_every_single_bit_flip_is_detected(h: Hash, nbytes: int) -> None:
    t = torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7)
    )
    base = h(t)
    for byte in range(nbytes) if nbytes <= 4097 else range(0, nbytes, 37):
        for bit in range(8) if nbytes <= 16 or byte % 97 == 0 else (byte % 8,):
            assert h(_flip(t, byte, bit)) != base, (byte, bit)


def test_every_bit_of_a_float32_element_is_detected(h: Hash) -> None:
    t = torch.randn(3000)
    base = h(t)
    for element in (0, 1, 1023, 1024, 2999):
        for bit in range(32):
            assert h(_flip(t, 4 * element + bit // 8, bit % 8)) != base, (element, bit)


def test_two_identical_flips_do_not_cancel(h: Hash) -> None:
    t = torch.randn(4096)
    twice = _flip(_flip(t, 4 * 5 + 1, 3), 4 * 3000 + 1, 3)
    assert h(t) != h(twice)


def test_swaps_are_detected(h: Hash) -> None:
    t = torch.arange(8192, dtype=torch.float32)
    for i, j in [(0, 1), (10, 3000), (1023, 1024), (0, 8191)]:
        swapped = t.clone()
        swapped[[i, j]] = swapped[[j, i]]
        assert t.sum() == swapped.sum()
        assert h(t) != h(swapped), (i, j)
    # within one NH pair: the two uint32 words of a pair play different roles
    pair = torch.tensor([1.0, 2.0])
    assert h(pair) != h(pair.flip(0))


def test_different_seeds_differ() -> None:
    t = torch.randn(1000)
    values = {as_int(ff.FastFingerprinter(seed).tensor(t)) for seed in range(8)}
    assert len(values) == 8
    assert not torch.equal(ff.nh_keys(1), ff.nh_keys(2))


def test_shape_dtype_and_trailing_zeros_are_bound(h: Hash) -> None:
    t = torch.randn(12)
    assert h(t) != h(t.reshape(3, 4))
    assert h(t) != h(torch.cat([t, torch.zeros(1)]))
    assert h(torch.zeros(4, dtype=torch.int32)) != h(torch.zeros(4))
    assert h(torch.zeros(0)) != h(torch.zeros(1))
    assert h(torch.tensor([0.0])) != h(torch.tensor([-0.0]))


def test_drop_in_output_format(fp: ff.FastFingerprinter) -> None:
    out = fp.tensor(torch.randn(100))
    assert out.dtype == torch.int64 and out.shape == (2,)
    assert all(0 <= int(v) < (1 << 31) - 1 for v in out)
    parts = [fp.tensor(torch.ones(3)), fp.tensor(torch.zeros(3))]
    assert as_int(fp.combine(parts)) != as_int(fp.combine(parts[::-1]))


def test_torch_fallback_when_native_is_disabled() -> None:
    """SLURM_GUARD_NATIVE=0 (or no compiler) selects the torch path: same value."""
    code = (
        "import torch; from slurm_guard import fingerprint_fast as ff; "
        "from slurm_guard.fingerprint.tree import as_int; "
        "print(ff.backend(), as_int(ff.FastFingerprinter(5).tensor(torch.arange(5000.0))))"
    )
    env = {"SLURM_GUARD_NATIVE": "0", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    ).stdout.split()
    assert out[0] == "torch"
    assert int(out[1]) == as_int(ff.FastFingerprinter(5).tensor(torch.arange(5000.0)))
