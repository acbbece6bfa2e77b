"""The corrected 4-bit base against independent computations: torchao's ``to_nf4`` for the
quantization, a brute-force top-k per row for the selection, a dense float64 product of
``dequant(NF4(W - S)) + S`` for the forward and the input gradient."""

import pytest
import torch
import torch.nn.functional as F

import squash  # noqa: F401  (registers torch.ops.squash.*)
from squash.nf4.quantize import nf4_block_sizes, to_nf4
from squash.nf4 import (
    NF4WithOutliers,
    SecondMoment,
    corrected_base,
    outlier_fan_in,
    outlier_linear,
    removal_gains,
    select_outliers,
    split_outliers,
)
from squash.nf4.ops import nf4_linear
from squash.sparsity import validate_ffi

SMOLLM2_SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]


def _weight(shape, seed=0):
    """Gaussian * 0.02 with 1% of the entries four times larger (outliers, as in trained
    weights)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    w *= 1 + 3 * (torch.rand(shape, generator=g) < 0.01)  # a few large entries
    return w


def _moment(in_dim, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(in_dim, generator=g) ** 4 * 10 + 1e-3  # a few hot input features


def _torchao_dequant(w):
    block, scaler = nf4_block_sizes("w", tuple(w.shape))
    return to_nf4(w, block, scaler).get_original_weight()


def _brute_top_k(score: torch.Tensor, k: int) -> list:
    """Per row: the sorted columns of the k largest scores, ties towards lower columns."""
    out = []
    for row in score.tolist():
        cols = sorted(range(len(row)), key=lambda j: (-row[j], j))[:k]
        out.append(sorted(cols))
    return out


def test_fan_in():
    assert outlier_fan_in(576, 0.0) == 0
    assert outlier_fan_in(576, 0.01) == 6  # round(5.76)
    assert outlier_fan_in(576, 0.0025) == 1  # round(1.44)
    assert outlier_fan_in(1536, 0.02) == 31  # round(30.72)
    assert outlier_fan_in(10, 1e-6) == 1  # any positive fraction keeps one


@pytest.mark.parametrize("bad", [1.0, -0.01, 2, "0.1", None, True])
def test_bad_fraction_names_it(bad):
    with pytest.raises(ValueError, match="fraction"):
        outlier_fan_in(576, bad)
    if bad is not None:
        with pytest.raises(ValueError, match="fraction"):
            split_outliers(_weight((64, 64)), bad)


def test_bad_arguments_name_them():
    w = _weight((64, 64))
    with pytest.raises(ValueError, match="weight"):
        split_outliers(torch.randn(64 * 64), 0.01)
    with pytest.raises(ValueError, match="weight"):
        split_outliers(torch.ones(64, 64, dtype=torch.int32), 0.01)
    with pytest.raises(ValueError, match="criterion"):
        split_outliers(w, 0.01, "largest")
    with pytest.raises(ValueError, match="second_moment"):
        split_outliers(w, 0.01, "sensitivity")
    with pytest.raises(ValueError, match="second_moment"):
        split_outliers(w, 0.01, "sensitivity", torch.ones(63))
    with pytest.raises(ValueError, match="rounds"):
        split_outliers(w, 0.01, rounds=0)
    with pytest.raises(ValueError, match="fan_in"):
        select_outliers(w, 0)
    with pytest.raises(ValueError, match="fan_in"):
        select_outliers(w, 64)
    with pytest.raises(ValueError, match="fraction and fan_in"):
        split_outliers(w, 0.01, fan_in=2)


@pytest.mark.parametrize("criterion", ["magnitude", "sensitivity"])
@pytest.mark.parametrize("shape", [(64, 128), (192, 576)])
def test_selection_is_the_brute_force_top_k_of_the_criterion(criterion, shape):
    w = _weight(shape)
    m = _moment(shape[1])
    k = outlier_fan_in(shape[1], 0.02)
    out = select_outliers(w, k, criterion, m if criterion == "sensitivity" else None,
                          values_dtype=None)  # fmt: skip
    error = (w - _torchao_dequant(w)).double()
    score = error.abs() if criterion == "magnitude" else error**2 * m.double()[None]
    assert out.indices.shape == out.values.shape == (shape[0], k)  # equal count per row
    validate_ffi(out.values, out.indices, shape[1])
    assert out.indices.long().tolist() == _brute_top_k(score, k)
    assert torch.equal(out.values, torch.gather(error.float(), 1, out.indices.long()))


@pytest.mark.parametrize("criterion", ["magnitude", "sensitivity"])
@pytest.mark.parametrize("rounds", [1, 2])
def test_rest_is_torchao_nf4_of_the_weight_without_outliers(criterion, rounds):
    w = _weight((192, 576))
    m = _moment(576)
    base, out = split_outliers(w, 0.01, criterion, m, rounds=rounds, values_dtype=None)
    validate_ffi(out.values, out.indices, 576)
    rest = w.clone()
    rest.scatter_(1, out.indices.long(), 0.0)
    want = _torchao_dequant(rest)
    assert torch.equal(base.get_original_weight(), want)
    # the outliers hold what the base misses there (W itself: NF4 codes zero exactly)
    assert torch.equal(torch.gather(want, 1, out.indices.long()), torch.zeros_like(out.values))
    assert torch.equal(out.values, torch.gather(w, 1, out.indices.long()))
    if rounds == 1:  # one round selects on plain NF4's error
        error = (w - _torchao_dequant(w)).double()
        score = error.abs() if criterion == "magnitude" else error**2 * m.double()[None]
        assert out.indices.long().tolist() == _brute_top_k(score, 6)


@pytest.mark.parametrize("shape", [(64, 128)] + SMOLLM2_SHAPES)
@pytest.mark.parametrize("criterion", ["magnitude", "sensitivity"])
def test_forward_and_input_gradient_equal_the_dense_float64_product(shape, criterion):
    w = _weight(shape)
    base, out = split_outliers(w, 0.01, criterion, _moment(shape[1]))
    assert out.values.dtype == torch.bfloat16
    dense = _torchao_dequant(w.scatter(1, out.indices.long(), 0.0)).double()
    dense.scatter_add_(1, out.indices.long(), out.values.double())  # (out, in), float64
    assert torch.allclose(corrected_base(base, out).double(), dense, atol=0, rtol=1e-7)

    x = torch.randn(3, 5, shape[1], requires_grad=True)
    g = torch.randn(3, 5, shape[0])
    layer = NF4WithOutliers(base, out)
    y = layer(x)
    y.backward(g)
    y_ref = x.detach().double() @ dense.T
    grad_ref = g.double() @ dense
    assert y.dtype == torch.float32
    assert torch.allclose(y.double(), y_ref, atol=1e-5, rtol=1e-5)
    assert torch.allclose(x.grad.double(), grad_ref, atol=1e-5, rtol=1e-5)
    # and in float64 end to end: equal to rounding
    x64 = x.detach().double().requires_grad_()
    layer(x64).backward(g.double())
    assert torch.allclose(layer(x64), y_ref, atol=1e-12, rtol=1e-12)
    assert torch.allclose(x64.grad, grad_ref, atol=1e-12, rtol=1e-12)
    # frozen: nothing of the base asks for a gradient
    assert not any(p.requires_grad for p in layer.parameters())
    # the dense weight's F.linear, as a user would compute it
    assert torch.allclose(y, F.linear(x.detach(), layer.dense_weight()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("criterion", ["magnitude", "sensitivity"])
def test_corrected_error_is_below_plain_nf4(criterion):
    w = _weight((576, 576))
    m = _moment(576)
    plain = w - _torchao_dequant(w)
    for fraction in (0.0025, 0.01, 0.02):
        base, out = split_outliers(w, fraction, criterion, m)
        err = w - corrected_base(base, out)
        assert err.norm() < plain.norm()
        if criterion == "sensitivity":  # the calibration-weighted error, what it minimizes
            assert (err**2 * m).sum() < (plain**2 * m).sum()


def _scalers(t):
    """Dequantized block scalers, as torchao's get_original_weight uses them."""
    return (t.quantized_scalers.view(-1, t.scaler_block_size).float()
            / t.quantization_factor.unsqueeze(-1)).flatten() + t.scaler_mean  # fmt: skip


@pytest.mark.parametrize("criterion", ["magnitude", "sensitivity"])
def test_block_scales_get_finer_after_removal(criterion):
    w = _weight((192, 576))
    m = _moment(576)
    block, scaler = nf4_block_sizes("w", tuple(w.shape))
    absmax_plain = w.reshape(-1, block).abs().amax(1)
    s_plain = _scalers(to_nf4(w, block, scaler))
    touched_share = {}
    for scale_aware in (False, True):
        base, out = split_outliers(w, 0.01, criterion, m, scale_aware=scale_aware)
        rest = w.scatter(1, out.indices.long(), 0.0)
        absmax_rest = rest.reshape(-1, block).abs().amax(1)
        assert (absmax_rest <= absmax_plain).all()  # removal never coarsens a block
        touched = absmax_rest < absmax_plain
        touched_share[scale_aware] = float(touched.float().mean())
        if touched.any():
            s_rest = _scalers(base)
            assert s_rest[touched].mean() < 0.95 * s_plain[touched].mean()
    # The error criteria pick entries NF4 rounds badly, never a block's absmax (it is coded as
    # +-1 times its own scale): they leave the scales as they were. Scale-aware selection
    # removes block maxima in many blocks.
    assert touched_share[False] < 0.01
    assert touched_share[True] > 0.3


@pytest.mark.parametrize("criterion", ["magnitude", "sensitivity"])
def test_removal_gains_equal_a_brute_force_requantization(criterion):
    """Each entry's gain: the block's (weighted) squared error now minus after removing the
    entry and re-quantizing the block with absmax scaling (NF4 levels, exact scales)."""
    w = _weight((4, 128))
    m = _moment(128) if criterion == "sensitivity" else torch.ones(128)
    base = to_nf4(w, 64, 8)
    levels = base.nf4.double()
    error = w - base.get_original_weight()
    gains = removal_gains(w, error, 64, base.nf4, m if criterion == "sensitivity" else None)

    def block_error(vals, cw):  # absmax-scaled NF4, nearest level (ties: the lower)
        scale = vals.abs().max()
        normed = vals / scale
        q = levels[(normed[:, None] - levels[None]).abs().argmin(1)] * scale
        return float(((vals - q) ** 2 * cw).sum())

    for o in range(4):
        for b in range(2):
            cols = list(range(64 * b, 64 * b + 64))
            vals, cw = w[o, cols].double(), m[cols].double()
            now = float((error[o, cols].double() ** 2 * cw).sum())
            p = int(vals.abs().argmax())
            for i in (p, (p + 1) % 64, (p + 7) % 64):
                keep = [j for j in range(64) if j != i]
                if i == p:  # the scale changes: the rest re-quantized
                    want = now - block_error(vals[keep], cw[keep])
                else:  # the scale stays: only the entry's own error goes
                    want = float(error[o, cols[i]].double() ** 2 * cw[i])
                assert abs(float(gains[o, cols[i]]) - want) < 1e-9 + 1e-6 * abs(want)


def test_fraction_zero_is_plain_nf4():
    w = _weight((192, 576))
    base, out = split_outliers(w, 0.0, "sensitivity", _moment(576))
    assert out is None
    want = to_nf4(w, *nf4_block_sizes("w", tuple(w.shape)))
    for name in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean"):
        assert torch.equal(getattr(base, name), getattr(want, name))
    x = torch.randn(4, 576)
    layer = NF4WithOutliers(base, out)
    assert torch.equal(layer(x), nf4_linear(x, want))
    assert torch.equal(corrected_base(base, None), want.get_original_weight())


def test_module_validates_outliers():
    w = _weight((64, 128))
    base, out = split_outliers(w, 0.05)
    bad = out.indices.clone()
    bad[0, 0] = bad[0, 1]  # duplicated column
    with pytest.raises(ValueError, match="outliers"):
        NF4WithOutliers(base, type(out)(out.values, bad))
    with pytest.raises(ValueError, match="rows"):
        NF4WithOutliers(base, type(out)(out.values[:3], out.indices[:3]))


def test_second_moment_is_the_mean_square_per_feature():
    x = torch.randn(4, 7, 16)
    sm = SecondMoment(16)
    sm.update(x[:2])
    sm.update(x[2:])
    assert torch.allclose(sm.value(), x.double().reshape(-1, 16).square().mean(0))


def test_compile_traces_the_corrected_forward_fullgraph():
    w = _weight((192, 576))
    base, out = split_outliers(w, 0.01, values_dtype=torch.float32)
    x = torch.randn(2, 3, 576, requires_grad=True)
    f = torch.compile(lambda x: outlier_linear(x, base, out), backend="aot_eager", fullgraph=True)
    y = f(x)
    y.sum().backward()
    x2 = x.detach().clone().requires_grad_()
    y2 = outlier_linear(x2, base, out)
    y2.sum().backward()
    assert torch.allclose(y, y2, atol=1e-6) and torch.allclose(x.grad, x2.grad, atol=1e-6)
