"""GPU tests of the FFI ops through the loader; skipped without a CUDA or ROCm GPU."""

import os

import pytest
import torch

import squash  # noqa: F401  (registers torch.ops.squash.*)
from squash.ops import _loader, reference
from squash.sparsity import ffi_to_dense, random_ffi_indices

from ffi_inputs import bad_patterns, contract_message, make_inputs
from gpu_common import (
    HAS_GPU,
    _assert_close_to,
)

# ================================================================================================
# 3. GPU tests (the real ops through the loader)
# ================================================================================================
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA or ROCm GPU")
NATIVE = os.environ.get("SQUASH_KERNELS", "native") != "reference"


def _make(lead, in_features, out_features, k, dtype, index_dtype=None, seed=0, device="cuda"):
    return make_inputs(lead, in_features, out_features, k, dtype, index_dtype, seed, device)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(not NATIVE, reason="SQUASH_KERNELS=reference")
def test_gpu_native_kernels_load():
    """The GPU kernels built and serve the CUDA key (otherwise every other GPU test would only
    check the reference against itself)."""
    x, values, indices, _ = _make((4,), 32, 8, 3, torch.float32)
    torch.ops.squash.ffi_linear(x, values, indices)
    assert _loader.status()["cuda"]["backend"] == "native", _loader._state.get("cuda")
    for op in ("ffi_linear", "ffi_linear_grad_input", "ffi_linear_grad_values"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"squash::{op}", "CUDA")


GPU_SHAPES = [
    # (leading shape, in, out, k)
    ((33,), 64, 16, 7),
    ((5,), 40, 8, 1),  # fan-in 1, few tokens
    ((9,), 24, 12, 24),  # fan-in = in_features
    ((1,), 128, 32, 13),  # one token
    ((2, 7), 96, 20, 10),  # 3-D input
    ((300,), 257, 65, 26),  # sizes off every tile
    ((3, 200), 512, 256, 51),  # 16-byte vector paths
    ((1100,), 1024, 8, 103),  # few rows: split kernels
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("lead, in_features, out_features, k", GPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("index_dtype", [torch.int16, torch.int32])
def test_gpu_matches_dense_and_reference(lead, in_features, out_features, k, dtype, index_dtype):
    x, values, indices, grad_out = _make(lead, in_features, out_features, k, dtype, index_dtype)
    xr = x.clone().requires_grad_(True)
    vr = values.clone().requires_grad_(True)
    y = torch.ops.squash.ffi_linear(xr, vr, indices)
    y.backward(grad_out)
    assert y.shape == (*lead, out_features) and y.dtype == dtype and y.is_cuda

    # Dense masked product in float64 on the CPU.
    w = ffi_to_dense(values.double().cpu(), indices.cpu(), in_features).requires_grad_(True)
    xd = x.double().cpu().requires_grad_(True)
    yd = xd @ w.T
    yd.backward(grad_out.double().cpu())
    _assert_close_to(y.cpu(), yd, dtype)
    _assert_close_to(xr.grad.cpu(), xd.grad, dtype)
    _assert_close_to(vr.grad.cpu(), torch.gather(w.grad, 1, indices.cpu().long()), dtype)
    # And the pure-PyTorch reference on the same device.
    _assert_close_to(y, reference.ffi_linear(x, values, indices), dtype, roundings=2)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_opcheck(dtype):
    x, values, indices, grad_out = _make((2, 40), 96, 24, 9, dtype)
    torch.library.opcheck(torch.ops.squash.ffi_linear.default, (x, values, indices))
    torch.library.opcheck(
        torch.ops.squash.ffi_linear.default, (x.requires_grad_(), values.requires_grad_(), indices)
    )
    torch.library.opcheck(
        torch.ops.squash.ffi_linear_grad_input.default, (grad_out, values.detach(), indices, 96)
    )
    torch.library.opcheck(
        torch.ops.squash.ffi_linear_grad_values.default, (grad_out, x.detach(), indices)
    )


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("lead, k", [((6,), 5), ((40,), 8)])  # small-T and tiled forward
def test_gpu_gradcheck_float64(lead, k):
    x, values, indices, _ = _make(lead, 20, 7, k, torch.float64)

    def fn(a, b):
        return torch.ops.squash.ffi_linear(a, b, indices)

    assert torch.autograd.gradcheck(fn, (x.requires_grad_(), values.requires_grad_()))


@pytest.mark.gpu
@needs_gpu
def test_gpu_torch_compile_fullgraph():
    x, values, indices, grad_out = _make((2, 150), 128, 48, 13, torch.bfloat16)

    def step(a, b):
        y = torch.ops.squash.ffi_linear(a, b, indices)
        return (y.float() * grad_out.float()).sum()

    compiled = torch.compile(step, fullgraph=True)
    results = []
    for fn in (step, compiled):
        a, b = x.clone().requires_grad_(True), values.clone().requires_grad_(True)
        loss = fn(a, b)
        loss.backward()
        results.append((loss, a.grad, b.grad))
    (loss_c, gx_c, gv_c), (loss_e, gx_e, gv_e) = results[1], results[0]
    torch.testing.assert_close(loss_c, loss_e)  # inductor may order the sum differently
    torch.testing.assert_close(gx_c, gx_e, rtol=0, atol=0)  # the same kernels on the same inputs
    torch.testing.assert_close(gv_c, gv_e, rtol=0, atol=0)


@pytest.mark.gpu
@needs_gpu
def test_gpu_non_contiguous_and_side_stream():
    x, values, indices, _ = _make((40,), 64, 24, 5, torch.float32)
    x_nc = x.T.contiguous().T  # (40, 64) with strides (1, 40)
    v_nc = values.T.contiguous().T
    i_nc = indices.T.contiguous().T
    assert not (x_nc.is_contiguous() or v_nc.is_contiguous() or i_nc.is_contiguous())
    want = reference.ffi_linear(x, values, indices)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = torch.ops.squash.ffi_linear(x_nc, v_nc, i_nc)
    stream.synchronize()
    _assert_close_to(got, want, torch.float32, roundings=2)


@pytest.mark.gpu
@needs_gpu
def test_gpu_empty_inputs():
    x, values, indices, _ = _make((0,), 32, 8, 3, torch.float32)
    assert torch.ops.squash.ffi_linear(x, values, indices).shape == (0, 8)
    g = torch.zeros(0, 8, device="cuda")
    assert torch.ops.squash.ffi_linear_grad_input(g, values, indices, 32).shape == (0, 32)
    gv = torch.ops.squash.ffi_linear_grad_values(g, x, indices)
    assert gv.shape == (8, 3) and not gv.any()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(not NATIVE, reason="SQUASH_KERNELS=reference")
def test_gpu_bad_indices_raise_value_error():
    x, values, indices, grad_out = _make((300,), 64, 16, 5, torch.float32)
    ops = [
        lambda i: torch.ops.squash.ffi_linear(x, values, i),
        lambda i: torch.ops.squash.ffi_linear_grad_input(grad_out, values, i, 64),
        lambda i: torch.ops.squash.ffi_linear_grad_values(grad_out, x, i),
    ]
    for op in ops:
        bad = indices.clone()
        bad[3, 2] = 64
        with pytest.raises(ValueError, match=r"out of range \[0, 64\): indices\[3, 2\] = 64"):
            op(bad)
        bad = indices.clone()
        bad[4, 1] = bad[4, 0]
        with pytest.raises(ValueError, match="strictly increasing"):
            op(bad)
    # A checked tensor changed in place is checked again (its version counter moved).
    idx = indices.clone()
    torch.ops.squash.ffi_linear(x, values, idx)
    idx[0, 0] = -1
    with pytest.raises(ValueError, match="out of range"):
        torch.ops.squash.ffi_linear(x, values, idx)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(not NATIVE, reason="SQUASH_KERNELS=reference")
@pytest.mark.parametrize("tokens", [0, 3, 300])  # empty, the small-token kernel, the tiled ones
def test_gpu_bad_patterns_raise_validate_ffis_error(tokens):
    """The same bad patterns as test_index_contract.py, validate_ffi's words, on every path."""
    x, values, indices, grad_out = _make((tokens,), 40, 6, 5, torch.float32)
    for case, (bad, in_features) in bad_patterns(indices, 40).items():
        xs = x[:, :in_features]
        v = values[:, : bad.shape[-1]] if bad.dim() == 2 else values
        want = contract_message(v.cpu(), bad.cpu(), in_features)
        with pytest.raises(ValueError, match=want):
            torch.ops.squash.ffi_linear(xs, v, bad)
        with pytest.raises(ValueError, match=want):
            torch.ops.squash.ffi_linear_grad_input(grad_out, v, bad, in_features)
        if bad.dim() == 2:
            with pytest.raises(ValueError, match=contract_message(None, bad.cpu(), in_features)):
                torch.ops.squash.ffi_linear_grad_values(grad_out, xs, bad)
