"""The FFI format: fan-in arithmetic, pruning, random patterns, dense round trips, validation."""

import pytest
import torch

from squash.sparsity import (
    fan_in_for,
    ffi_to_dense,
    index_dtype,
    prune_to_ffi,
    random_ffi_indices,
    validate_ffi,
)


@pytest.mark.parametrize(
    "in_features, sparsity, expected",
    [(1024, 0.9, 102), (1024, 0.5, 512), (10, 0.99, 1), (7, 0.0, 7), (4096, 0.9, 410), (3, 0.5, 2)],
)
def test_fan_in_for(in_features, sparsity, expected):
    # k = max(1, round((1 - s) * in)); e.g. 0.1 * 1024 = 102.4 -> 102.
    assert fan_in_for(in_features, sparsity) == expected


@pytest.mark.parametrize("sparsity", [-0.1, 1.0, 1.5])
def test_fan_in_for_rejects_bad_sparsity(sparsity):
    with pytest.raises(ValueError, match="sparsity"):
        fan_in_for(16, sparsity)


def test_index_dtype_boundary():
    assert index_dtype(32767) == torch.int16
    assert index_dtype(32768) == torch.int32


def test_prune_to_ffi_keeps_largest_magnitudes_sorted():
    w = torch.tensor([[0.1, -5.0, 0.3, 2.0, -0.2], [1.0, 1.0, -3.0, 0.0, 0.5]])
    values, indices = prune_to_ffi(w, fan_in=2)
    assert indices.dtype == torch.int16
    assert indices.tolist() == [[1, 3], [0, 2]]  # row 1: tie between cols 0 and 1 -> lower col
    assert values.tolist() == [[-5.0, 2.0], [1.0, -3.0]]


def test_prune_to_ffi_matches_bruteforce():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(13, 37, generator=g)
    values, indices = prune_to_ffi(w, sparsity=0.75)
    k = fan_in_for(37, 0.75)
    for row in range(13):
        expected = sorted(sorted(range(37), key=lambda c: -abs(w[row, c].item()))[:k])
        assert indices[row].tolist() == expected
        assert torch.equal(values[row], w[row, expected])
    # The dense form keeps exactly those entries and zeros elsewhere.
    dense = ffi_to_dense(values, indices, 37)
    mask = torch.zeros_like(w, dtype=torch.bool).scatter_(1, indices.long(), True)
    assert torch.equal(dense, torch.where(mask, w, torch.zeros_like(w)))


def test_prune_to_ffi_argument_errors():
    with pytest.raises(ValueError, match="exactly one"):
        prune_to_ffi(torch.randn(2, 4))
    with pytest.raises(ValueError, match="exactly one"):
        prune_to_ffi(torch.randn(2, 4), sparsity=0.5, fan_in=2)
    with pytest.raises(ValueError, match="fan_in"):
        prune_to_ffi(torch.randn(2, 4), fan_in=5)
    with pytest.raises(ValueError, match="2-D"):
        prune_to_ffi(torch.randn(4), fan_in=1)


def test_random_ffi_indices_is_valid_and_seeded():
    a = random_ffi_indices(64, 100, 10, generator=torch.Generator().manual_seed(3))
    b = random_ffi_indices(64, 100, 10, generator=torch.Generator().manual_seed(3))
    c = random_ffi_indices(64, 100, 10, generator=torch.Generator().manual_seed(4))
    assert a.shape == (64, 10) and a.dtype == torch.int16
    assert torch.equal(a, b) and not torch.equal(a, c)
    validate_ffi(None, a, 100)
    # Roughly uniform: every column is used about 64 * 10 / 100 = 6.4 times.
    counts = torch.bincount(a.flatten().long(), minlength=100)
    assert counts.sum() == 640 and counts.max() < 20


def test_random_ffi_indices_int32_for_wide_rows():
    idx = random_ffi_indices(2, 40000, 3, generator=torch.Generator().manual_seed(0))
    assert idx.dtype == torch.int32
    validate_ffi(None, idx, 40000)


def test_ffi_to_dense_hand_computed():
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    indices = torch.tensor([[0, 3], [1, 2]], dtype=torch.int16)
    expected = torch.tensor([[1.0, 0.0, 0.0, 2.0], [0.0, 3.0, 4.0, 0.0]])
    assert torch.equal(ffi_to_dense(values, indices, 4), expected)


def _ok():
    return torch.ones(2, 3), torch.tensor([[0, 2, 4], [1, 2, 3]], dtype=torch.int16)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda v, i: (v, i.to(torch.int64)), "int16 or int32"),
        (lambda v, i: (v, i.float()), "int16 or int32"),
        (lambda v, i: (v, i[0]), "2-D"),
        (lambda v, i: (v[:, :2], i), "does not match"),
        (lambda v, i: (v.to(torch.int32), i), "floating point"),
        (lambda v, i: (v, i.index_put((torch.tensor(0), torch.tensor(2)), torch.tensor(5, dtype=torch.int16))), "out of range"),
        (lambda v, i: (v, i.index_put((torch.tensor(1), torch.tensor(0)), torch.tensor(-1, dtype=torch.int16))), "out of range"),
        (lambda v, i: (v, torch.tensor([[0, 2, 2], [1, 2, 3]], dtype=torch.int16)), "duplicated"),
        (lambda v, i: (v, torch.tensor([[0, 2, 4], [3, 2, 4]], dtype=torch.int16)), "not sorted"),
    ],
)
def test_validate_ffi_names_the_broken_rule(mutate, message):
    values, indices = mutate(*_ok())
    with pytest.raises(ValueError, match=message):
        validate_ffi(values, indices, 5, where="unit test")


def test_validate_ffi_accepts_good_and_reports_where():
    validate_ffi(*_ok(), 5)
    with pytest.raises(ValueError, match=r"row 0 .*\(checkpoint load of layer.0\)"):
        validate_ffi(torch.ones(1, 2), torch.tensor([[3, 1]], dtype=torch.int16), 5,
                     where="checkpoint load of layer.0")
    with pytest.raises(ValueError, match="fan-in"):
        validate_ffi(None, torch.zeros(2, 6, dtype=torch.int16), 5)
    with pytest.raises(ValueError, match="int16 FFI indices cannot address"):
        validate_ffi(None, torch.zeros(1, 1, dtype=torch.int16), 40000)
