"""The exact fingerprint: order-sensitive, flip-sensitive, seeded, bound to shape and dtype."""

from __future__ import annotations

import pytest
import torch

from slurm_guard.faults.injection import flip_bit
from slurm_guard.fingerprint.tree import Fingerprinter, as_int


@pytest.fixture
def fp() -> Fingerprinter:
    return Fingerprinter(seed=1234)


def value(fp: Fingerprinter, t: torch.Tensor) -> int:
    return as_int(fp.tensor(t))


def test_same_bits_same_fingerprint_across_instances(fp: Fingerprinter) -> None:
    t = torch.randn(5000)
    assert value(fp, t) == value(Fingerprinter(seed=1234), t.clone())


def test_every_single_bit_flip_of_an_element_changes_it(fp: Fingerprinter) -> None:
    t = torch.randn(3000)
    base = value(fp, t)
    for bit in range(32):
        flipped = t.clone()
        flip_bit(flipped, 1234, bit)
        assert value(fp, flipped) != base, bit


def test_order_matters_where_xor_and_sum_do_not(fp: Fingerprinter) -> None:
    t = torch.arange(4096, dtype=torch.float32)
    swapped = t.clone()
    swapped[[10, 3000]] = swapped[[3000, 10]]
    assert t.sum() == swapped.sum()
    assert value(fp, t) != value(fp, swapped)


def test_two_identical_flips_do_not_cancel(fp: Fingerprinter) -> None:
    t = torch.randn(2048)
    twice = t.clone()
    flip_bit(twice, 5, 3)
    flip_bit(twice, 1500, 3)
    assert value(fp, t) != value(fp, twice)


def test_minus_zero_is_not_plus_zero(fp: Fingerprinter) -> None:
    assert value(fp, torch.tensor([0.0, 1.0])) != value(fp, torch.tensor([-0.0, 1.0]))


def test_shape_dtype_and_trailing_zeros_are_bound(fp: Fingerprinter) -> None:
    t = torch.randn(12)
    assert value(fp, t) != value(fp, t.reshape(3, 4))
    assert value(fp, t) != value(fp, torch.cat([t, torch.zeros(1)]))
    assert value(fp, torch.zeros(4, dtype=torch.int32)) != value(fp, torch.zeros(4))


def test_seed_changes_every_fingerprint() -> None:
    t = torch.randn(100)
    assert value(Fingerprinter(1), t) != value(Fingerprinter(2), t)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.uint8])
def test_other_dtypes_and_odd_byte_counts(fp: Fingerprinter, dtype: torch.dtype) -> None:
    t = (torch.rand(1001) * 100).to(dtype)
    other = t.clone()
    other[500] = other[500] + 1
    assert value(fp, t) != value(fp, other)


def test_large_tensor_spans_several_tree_levels(fp: Fingerprinter) -> None:
    t = torch.randn(3_000_000)  # 6e6 16-bit words: three levels
    other = t.clone()
    other[-1] = other[-1] * 2
    assert value(fp, t) != value(fp, other)


def test_noncontiguous_views_hash_their_values(fp: Fingerprinter) -> None:
    t = torch.randn(64, 64)
    assert value(fp, t.t()) == value(fp, t.t().contiguous())


def test_combine_is_order_sensitive(fp: Fingerprinter) -> None:
    a, b = fp.tensor(torch.ones(3)), fp.tensor(torch.zeros(3))
    assert as_int(fp.combine([a, b])) != as_int(fp.combine([b, a]))
    assert as_int(fp.tensors([])) == as_int(fp.tensors([]))
