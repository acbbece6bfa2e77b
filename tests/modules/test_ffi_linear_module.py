"""FFILinear against dense computations built independently from its values and indices."""

import math

import pytest
import torch

from squash.modules import FFILinear
from squash.training.masks import record_dense_grad


def dense_from_loop(values, indices, in_features):
    """The logical dense weight, written with a plain Python loop."""
    values, (out, k) = values.detach(), values.shape
    w = torch.zeros(out, in_features, dtype=torch.float64)
    for o in range(out):
        for j in range(k):
            w[o, int(indices[o, j])] = float(values[o, j])
    return w


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_forward_matches_dense_product(dtype, tol):
    g = torch.Generator().manual_seed(1)
    m = FFILinear(24, 10, 5, dtype=dtype, generator=g)
    x = torch.randn(3, 7, 24, generator=g).to(dtype)
    y = m(x)
    assert y.shape == (3, 7, 10) and y.dtype == dtype
    expected = x.double() @ dense_from_loop(m.values, m.indices, 24).T
    torch.testing.assert_close(y.double(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(m.to_dense().double(), dense_from_loop(m.values, m.indices, 24))


def test_input_is_cast_to_values_dtype():
    m = FFILinear(16, 4, 3, dtype=torch.bfloat16)
    x = torch.randn(5, 16)
    y = m(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, m(x.to(torch.bfloat16)))


def test_default_init_pattern_and_kaiming_bound():
    g = torch.Generator().manual_seed(0)
    m = FFILinear(300, 200, 30, generator=g)
    idx = m.indices.long()
    assert m.indices.dtype == torch.int16
    assert bool((idx[:, 1:] > idx[:, :-1]).all()) and int(idx.min()) >= 0 and int(idx.max()) < 300
    bound = 1 / math.sqrt(30)  # nn.Linear's U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with fan_in = k
    assert float(m.values.detach().abs().max()) <= bound
    # U(-b, b) has std b / sqrt(3); 6000 draws give it to about 1%.
    assert abs(float(m.values.detach().std()) - bound / math.sqrt(3)) < 0.03 * bound
    # The pattern is spread over all columns (each column is hit ~ 200 * 30 / 300 = 20 times).
    assert torch.bincount(idx.flatten(), minlength=300).min() > 0


def test_generator_makes_init_reproducible():
    a = FFILinear(50, 8, 6, generator=torch.Generator().manual_seed(3))
    b = FFILinear(50, 8, 6, generator=torch.Generator().manual_seed(3))
    c = FFILinear(50, 8, 6, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)
    assert not torch.equal(a.indices, c.indices)


def test_from_dense_keeps_largest_magnitudes():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(6, 20, generator=g)
    m = FFILinear.from_dense(w, sparsity=0.75)  # k = 5
    assert m.fan_in == 5 and m.values.dtype == w.dtype
    for row in range(6):
        expected = sorted(sorted(range(20), key=lambda c: -abs(w[row, c].item()))[:5])
        assert m.indices[row].tolist() == expected
        assert torch.equal(m.values.detach()[row], w[row, expected])


def test_gradients_match_dense_masked_weight():
    g = torch.Generator().manual_seed(5)
    m = FFILinear(12, 6, 4, dtype=torch.float64, generator=g)
    x = torch.randn(9, 12, dtype=torch.float64, generator=g, requires_grad=True)
    grad_out = torch.randn(9, 6, dtype=torch.float64, generator=g)
    m(x).backward(grad_out)
    w = dense_from_loop(m.values, m.indices, 12).requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    (x2 @ w.T).backward(grad_out)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(m.values.grad, torch.gather(w.grad, 1, m.indices.long()))
    assert not m.indices.requires_grad and m.indices.grad is None
    assert [n for n, _ in m.named_parameters()] == ["values"]


def test_state_dict_round_trip():
    src = FFILinear(40, 8, 5, generator=torch.Generator().manual_seed(7))
    sd = src.state_dict()
    assert set(sd) == {"values", "indices"} and sd["indices"].dtype == torch.int16
    dst = FFILinear(40, 8, 5, generator=torch.Generator().manual_seed(8))
    assert not torch.equal(dst.indices, src.indices)
    dst.load_state_dict(sd)
    assert torch.equal(dst.indices, src.indices) and torch.equal(dst.values, src.values)
    x = torch.randn(3, 40)
    assert torch.equal(dst(x), src(x))


@pytest.mark.parametrize(
    "corrupt, rule",
    [
        (lambda i: i.flip(1), "not sorted"),
        (lambda i: torch.cat([i[:, :1], i[:, :-1]], 1), "duplicated"),
        (lambda i: i.index_fill(1, torch.tensor([4]), 40), "out of range"),
        (lambda i: i.long(), "int16 or int32"),
        (lambda i: i[:, :4], "does not match this module"),
    ],
)
def test_corrupted_checkpoint_raises_value_error(corrupt, rule):
    src = FFILinear(40, 8, 5)
    sd = src.state_dict()
    sd["indices"] = corrupt(sd["indices"])
    if rule == "does not match this module":
        sd["values"] = sd["values"][:, :4]
    dst = FFILinear(40, 8, 5)
    with pytest.raises(ValueError, match=rule) as err:
        dst.load_state_dict(sd)
    assert "checkpoint load of indices" in str(err.value)


def test_construction_validates_given_indices():
    good = torch.tensor([[0, 2], [1, 3]], dtype=torch.int16)
    m = FFILinear(4, 2, 2, indices=good)
    assert torch.equal(m.indices, good)
    with pytest.raises(ValueError, match="not sorted.*construction"):
        FFILinear(4, 2, 2, indices=torch.tensor([[2, 0], [1, 3]], dtype=torch.int16))
    with pytest.raises(ValueError, match="does not match"):
        FFILinear(4, 2, 1, indices=good)
    with pytest.raises(ValueError, match="fan_in"):
        FFILinear(4, 2, 5)


def test_extra_repr():
    assert repr(FFILinear(100, 7, 10)) == (
        "FFILinear(in_features=100, out_features=7, fan_in=10, sparsity=0.900)"
    )


@pytest.mark.parametrize("width", [20, 12, 15])
def test_wrong_input_width_is_refused(width):
    """An input narrower or wider than in_features is refused, whether or not an index happens
    to fall outside it (every index of this module is < 16, but 12 may or may not reach them)."""
    m = FFILinear(16, 8, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=rf"input \(3, {width}\) must end in in_features = 16"):
        m(torch.randn(3, width))
    record_dense_grad(m)  # the dense-gradient path (a mask update's recording) checks alike
    with pytest.raises(ValueError, match="must end in in_features = 16"):
        m(torch.randn(3, width))
    record_dense_grad(m, False)
    x = torch.randn(3, 16)
    torch.testing.assert_close(m(x).double(), x.double() @ m.to_dense().double().T,
                               rtol=1e-5, atol=1e-5)  # fmt: skip
