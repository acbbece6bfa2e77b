"""squash::ffi_linear and its backward ops against the dense masked product, the reference,
opcheck, gradcheck and torch.compile (CPU here; the GPU cases live in test_gpu_kernels.py)."""

import os

import pytest
import torch

import squash
from squash.ops import reference
from squash.sparsity import ffi_to_dense

from ffi_inputs import assert_close, make_inputs

NATIVE = os.environ.get("SQUASH_KERNELS", "native") != "reference"


def make(lead, in_features, out_features, k, dtype=torch.float32, index_dtype=None, seed=0):
    return make_inputs(lead, in_features, out_features, k, dtype, index_dtype, seed)[:3]


def dense_reference(x, values, indices, grad_out):
    """Forward and both gradients from the dense masked matrix, in float64 autograd."""
    w = ffi_to_dense(values.double(), indices, x.shape[-1]).requires_grad_(True)
    xd = x.double().requires_grad_(True)
    y = xd @ w.T
    y.backward(grad_out.double())
    grad_values = torch.gather(w.grad, 1, indices.long())
    return y, xd.grad, grad_values


SHAPES = [
    # (leading shape, in, out, k)
    ((33,), 64, 16, 7),
    ((5,), 40, 8, 1),  # fan-in 1
    ((9,), 24, 12, 24),  # fan-in = in_features
    ((1,), 128, 32, 13),  # one token
    ((2, 7), 96, 20, 10),  # 3-D input
    ((2, 3, 5), 50, 6, 9),  # 4-D input
    ((300,), 257, 65, 26),  # sizes off any tile
]


@pytest.mark.parametrize("lead, in_features, out_features, k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_dense_masked_product(lead, in_features, out_features, k, dtype):
    x, values, indices = make(lead, in_features, out_features, k, dtype)
    grad_out = torch.randn(*lead, out_features).to(dtype)
    y_ref, gx_ref, gv_ref = dense_reference(x, values, indices, grad_out)

    xr = x.clone().requires_grad_(True)
    vr = values.clone().requires_grad_(True)
    y = torch.ops.squash.ffi_linear(xr, vr, indices)
    y.backward(grad_out)

    assert y.shape == (*lead, out_features)
    for got, want in ((y, y_ref), (xr.grad, gx_ref), (vr.grad, gv_ref)):
        assert_close(got, want, dtype)


def test_int16_and_int32_indices_agree():
    x, values, indices = make((17,), 80, 24, 8)
    assert indices.dtype == torch.int16
    y16 = torch.ops.squash.ffi_linear(x, values, indices)
    y32 = torch.ops.squash.ffi_linear(x, values, indices.to(torch.int32))
    want = x.double() @ ffi_to_dense(values.double(), indices, 80).T
    assert_close(y16, want, torch.float32)
    assert_close(y32, want, torch.float32)
    torch.testing.assert_close(y16, y32, rtol=0, atol=0)  # the index type changes no bit


def test_non_contiguous_inputs():
    x, values, indices = make((16,), 64, 24, 5)
    x_nc = torch.randn(64, 16).T  # (16, 64), stride (1, 16)
    v_nc = torch.randn(5, 24).T
    i_nc = indices.T.contiguous().T
    assert not (x_nc.is_contiguous() or v_nc.is_contiguous() or i_nc.is_contiguous())
    y = torch.ops.squash.ffi_linear(x_nc, v_nc, i_nc)
    want = x_nc.double() @ ffi_to_dense(v_nc.double(), indices, 64).T
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    g_nc = torch.randn(24, 16).T
    gi = torch.ops.squash.ffi_linear_grad_input(g_nc, v_nc, i_nc, 64)
    torch.testing.assert_close(gi.double(), g_nc.double() @ ffi_to_dense(v_nc.double(), indices, 64),
                               rtol=1e-5, atol=1e-5)
    gv = torch.ops.squash.ffi_linear_grad_values(g_nc, x_nc, i_nc)
    want_gv = torch.gather(g_nc.double().T @ x_nc.double(), 1, indices.long())
    torch.testing.assert_close(gv.double(), want_gv, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not NATIVE, reason="SQUASH_KERNELS=reference: the native kernel is not loaded")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_native_matches_reference(dtype):
    assert squash.ops.ensure_loaded("cpu"), "the CPU kernel failed to build"
    assert torch._C._dispatch_has_kernel_for_dispatch_key("squash::ffi_linear", "CPU")
    x, values, indices = make((3, 41), 300, 70, 31, dtype)
    g = torch.randn(3, 41, 70).to(dtype)
    pairs = [
        (torch.ops.squash.ffi_linear(x, values, indices), reference.ffi_linear(x, values, indices)),
        (torch.ops.squash.ffi_linear_grad_input(g, values, indices, 300),
         reference.ffi_linear_grad_input(g, values, indices, 300)),
        (torch.ops.squash.ffi_linear_grad_values(g, x, indices),
         reference.ffi_linear_grad_values(g, x, indices)),
    ]
    for got, want in pairs:
        # Both round an fp32 (fp64) sum once: two roundings apart at most.
        assert_close(got, want, dtype, roundings=2)


@pytest.mark.parametrize("lead, in_features, out_features, k", [((4,), 12, 5, 3), ((2, 3), 9, 4, 9)])
def test_opcheck(lead, in_features, out_features, k):
    for dtype in (torch.float32, torch.bfloat16):
        x, values, indices = make(lead, in_features, out_features, k, dtype)
        x.requires_grad_(True)
        values.requires_grad_(True)
        torch.library.opcheck(torch.ops.squash.ffi_linear.default, (x, values, indices))
        g = torch.randn(*lead, out_features).to(dtype)
        torch.library.opcheck(
            torch.ops.squash.ffi_linear_grad_input.default, (g, values.detach(), indices, in_features)
        )
        torch.library.opcheck(
            torch.ops.squash.ffi_linear_grad_values.default, (g, x.detach(), indices)
        )


@pytest.mark.parametrize("lead, k", [((5,), 3), ((2, 3), 1), ((4,), 10)])
def test_gradcheck_float64(lead, k):
    x, values, indices = make(lead, 10, 6, k, torch.float64)
    x.requires_grad_(True)
    values.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda a, b: torch.ops.squash.ffi_linear(a, b, indices), (x, values)
    )


def test_no_gradient_to_indices_and_partial_grads():
    x, values, indices = make((6,), 16, 8, 4)
    x.requires_grad_(True)  # values frozen: only the input gradient is computed
    before = indices.clone()
    torch.ops.squash.ffi_linear(x, values, indices).sum().backward()
    want = torch.ones(6, 8, dtype=torch.float64) @ ffi_to_dense(values.double(), indices, 16)
    assert_close(x.grad, want, torch.float32)
    assert values.grad is None
    assert torch.equal(indices, before)


def _compiled_step(backend):
    x, values, indices = make((2, 9), 32, 12, 5)
    values.requires_grad_(True)

    def f(x, v, i):
        return torch.ops.squash.ffi_linear(torch.relu(x), v, i).square().sum()

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    loss = compiled(x, values, indices)
    loss.backward()
    v2 = values.detach().clone().requires_grad_(True)
    want = (torch.relu(x) @ ffi_to_dense(v2, indices, 32).T).square().sum()
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(values.grad, v2.grad, rtol=1e-4, atol=1e-4)


def test_compile_fullgraph_aot_eager():
    torch._dynamo.reset()
    _compiled_step("aot_eager")


@pytest.mark.slow
def test_compile_fullgraph_inductor():
    torch._dynamo.reset()
    _compiled_step("inductor")


# ---- NaN and inf follow the gather formula on every backend ---------------------------------
def _gather_formula(x, values, indices):
    """``y[t, o] = sum_j values[o, j] * x[t, indices[o, j]]`` term by term, in float64."""
    terms = x.double()[:, indices.long()] * values.double()  # (T, out, k)
    return terms.sum(-1)


@pytest.mark.parametrize("backend", ["reference"] + (["native"] if NATIVE else []))
@pytest.mark.parametrize("tokens", [1, 20])
def test_nan_and_inf_follow_the_gather_formula(backend, tokens):
    forward = reference.ffi_linear if backend == "reference" else torch.ops.squash.ffi_linear
    x, values, indices = make((tokens,), 48, 16, 4)
    used = torch.zeros(48, dtype=torch.bool)
    used[indices.long().flatten()] = True
    unused = int((~used).nonzero()[0])
    x[0, unused] = float("nan")  # read by no row: reaches no output
    x[-1, int(indices[5, 1])] = float("inf")  # read by row 5 (and any other row that holds it)
    y = forward(x, values, indices)
    want = _gather_formula(x, values, indices)
    assert torch.equal(torch.isnan(y), torch.isnan(want)) and not torch.isnan(y[0]).all()
    assert torch.equal(torch.isinf(y), torch.isinf(want)) and bool(torch.isinf(y[-1, 5]))
    assert torch.equal(torch.sign(y[torch.isinf(y)]), torch.sign(want[torch.isinf(want)]).float())
    finite = torch.isfinite(want)
    assert_close(y[finite], want[finite], torch.float32)


@pytest.mark.parametrize("backend", ["reference"] + (["native"] if NATIVE else []))
def test_nan_in_grad_out_reaches_only_the_pattern(backend):
    """grad_input[t, i] reads grad_out[t, o] only through the pairs (o, j) with indices[o, j] = i."""
    fn = (reference.ffi_linear_grad_input if backend == "reference"
          else torch.ops.squash.ffi_linear_grad_input)  # fmt: skip
    _, values, indices = make((20,), 48, 16, 4)
    g = torch.randn(20, 16)
    g[3, 7] = float("nan")
    gx = fn(g, values, indices, 48)
    want = torch.zeros(20, 48, dtype=torch.bool)
    want[3, indices[7].long()] = True
    assert torch.equal(torch.isnan(gx), want)


# ---- double backward ------------------------------------------------------------------------
@pytest.mark.parametrize("lead, k", [((5,), 3), ((2, 3), 10)])
def test_double_backward_matches_dense(lead, k):
    x, values, indices = make(lead, 10, 6, k, torch.float64)
    x.requires_grad_(True)
    values.requires_grad_(True)
    f = lambda a, b: torch.ops.squash.ffi_linear(a, b, indices)  # noqa: E731
    assert torch.autograd.gradgradcheck(f, (x, values))

    def second_order(fn, a, b):
        y = fn(a, b)
        ga, gb = torch.autograd.grad(y.square().sum(), (a, b), create_graph=True)
        return torch.autograd.grad(ga.sin().sum() + gb.cos().sum(), (a, b))

    got = second_order(f, x, values)
    want = second_order(lambda a, b: a @ ffi_to_dense(b, indices, 10).T, x, values)
    for g, w in zip(got, want):
        assert_close(g, w, torch.float64)


# ---- width ------------------------------------------------------------------------------------
def test_wrong_input_width_is_refused_given_in_features():
    x, values, indices = make((3,), 16, 8, 4)
    y = squash.ops.ffi_linear(x, values, indices, in_features=16)
    assert_close(y, x.double() @ ffi_to_dense(values.double(), indices, 16).T, torch.float32)
    wide = torch.randn(3, 20)  # the indices (all < 16) do not tell
    with pytest.raises(ValueError, match=r"x \(3, 20\) must end in in_features = 16"):
        squash.ops.ffi_linear(wide, values, indices, in_features=16)
