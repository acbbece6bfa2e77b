"""squash::ffi_linear and its backward ops against the dense masked product, the reference,
opcheck, gradcheck and torch.compile (CPU here; the GPU cases live in test_gpu_kernels.py)."""

import os

import pytest
import torch

import squash
from squash.ops import reference
from squash.sparsity import ffi_to_dense, random_ffi_indices

NATIVE = os.environ.get("SQUASH_KERNELS", "native") != "reference"
TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def make(lead, in_features, out_features, k, dtype=torch.float32, index_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, in_features, generator=g).to(dtype)
    values = torch.randn(out_features, k, generator=g).to(dtype)
    indices = random_ffi_indices(out_features, in_features, k, generator=g)
    if index_dtype is not None:
        indices = indices.to(index_dtype)
    return x, values, indices


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

    assert y.dtype == dtype and y.shape == (*lead, out_features)
    tol = TOL[dtype]
    # Low-precision results are the fp32-accumulated value rounded once: compare relative to scale.
    for got, want in ((y, y_ref), (xr.grad, gx_ref), (vr.grad, gv_ref)):
        scale = want.abs().max().item() + 1.0
        assert (got.double() - want).abs().max().item() <= tol * scale


@pytest.mark.parametrize("index_dtype", [torch.int16, torch.int32])
def test_int16_and_int32_indices_agree(index_dtype):
    x, values, indices = make((17,), 80, 24, 8)
    want = torch.ops.squash.ffi_linear(x, values, indices.to(torch.int16))
    got = torch.ops.squash.ffi_linear(x, values, indices.to(index_dtype))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


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
        assert got.dtype == want.dtype and got.shape == want.shape
        # Same fp32 accumulation, different summation order: a rounding step apart at most.
        tol = {torch.float64: 1e-12, torch.float32: 1e-4, torch.bfloat16: 1e-2}[dtype]
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_status_reports_backend():
    torch.ops.squash.ffi_linear(*make((2,), 8, 4, 2))
    assert squash.ops.status()["cpu"] == ("native" if NATIVE else "reference")


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
    torch.ops.squash.ffi_linear(x, values, indices).sum().backward()
    want = torch.ones(6, 8, dtype=torch.float64) @ ffi_to_dense(values.double(), indices, 16)
    torch.testing.assert_close(x.grad.double(), want, rtol=1e-5, atol=1e-5)
    assert values.grad is None and not indices.is_floating_point()


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


def test_bad_indices_raise_value_error_before_kernel():
    x, values, indices = make((4,), 16, 3, 4)
    bad = indices.clone()
    bad[1, 3] = 16  # out of range
    with pytest.raises(ValueError, match="out of range"):
        torch.ops.squash.ffi_linear(x, values, bad)
    with pytest.raises(ValueError, match="out of range"):
        torch.ops.squash.ffi_linear_grad_input(torch.randn(4, 3), values, bad, 16)
    with pytest.raises(ValueError, match="out of range"):
        torch.ops.squash.ffi_linear_grad_values(torch.randn(4, 3), x, bad)
    neg = indices.clone()
    neg[0, 0] = -1
    with pytest.raises(ValueError, match="out of range"):
        torch.ops.squash.ffi_linear(x, values, neg)
    with pytest.raises(ValueError, match="int16 or int32"):
        torch.ops.squash.ffi_linear(x, values, indices.long())
    with pytest.raises(ValueError):
        torch.ops.squash.ffi_linear(x, values[:, :2], indices)
    with pytest.raises(ValueError, match="dtype"):
        torch.ops.squash.ffi_linear(x.double(), values, indices)
    unsorted = indices.flip(1)
    with pytest.raises(ValueError, match="not sorted"):
        squash.ops.ffi_linear(x, values, unsorted, validate=True)
