"""squash's NF4 dequantize kernel and nf4_linear against torchao: get_original_weight() bit for
bit on every shape and block size squash uses, linear_nf4's output and input gradient bit for bit,
opcheck, compile, and clear errors."""

import pytest
import torch

import squash  # noqa: F401  (registers torch.ops.squash.*)
from squash.nf4 import nf4_dequantize, nf4_linear
from squash.nf4.ops import _inner, reference_dequantize
from squash.ops import _loader

from torchao.dtypes.nf4tensor import linear_nf4, to_nf4

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}

# (shape, block_size, scaler_block_size): torchao's defaults on OPT's and Llama's widths, the
# per-weight choices where 64 x 256 does not divide (SmolLM2's 576 x 576 and 192 x 576 take
# scaler blocks of 64 and 32), and odd small blocks for the vector loops' scalar tails.
CASES = [
    ((1024, 1024), 64, 256),
    ((256, 64), 64, 256),  # one scaler block
    ((576, 576), 64, 64),
    ((192, 576), 64, 32),
    ((1536, 576), 64, 256),
    ((576, 576), 32, 2),
    ((64, 64), 2, 1),
    ((6, 4), 6, 4),  # 3 bytes a block: no whole vector, no 4-byte groups
    ((10, 36), 10, 12),
    ((2, 1000), 250, 8),  # 125 bytes a block: vector loops then tails
]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype])
    )


def _weight(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    w[0, : shape[1] // 2] = 0.0  # a zero stretch, and a wide one, as real weights have
    w[-1, -1] = 0.5
    return w.to(dtype)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("shape, block, scaler_block", CASES)
def test_dequantize_equals_torchao_bit_for_bit(shape, block, scaler_block, dtype):
    w = to_nf4(_weight(shape, dtype), block, scaler_block)
    want = w.get_original_weight()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        assert _same_bits(nf4_dequantize(w), want)
    # The pure-PyTorch fallback (no kernel for a device, SQUASH_KERNELS=reference) too.
    data, qs, qf, mean, nf4, b, sb = _inner(w)
    ref = reference_dequantize(data.flatten(), qs, qf, mean, nf4, b, sb).view(shape)
    assert _same_bits(ref, want)


def test_native_kernel_serves_the_cpu():
    if _loader.mode() == "reference":
        pytest.skip("SQUASH_KERNELS=reference")
    nf4_dequantize(to_nf4(_weight((256, 64), torch.float32)))
    assert torch._C._dispatch_has_kernel_for_dispatch_key("squash::nf4_dequantize", "CPU")


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("x_dtype", [None, torch.float32], ids=["x_same", "x_fp32"])
def test_nf4_linear_equals_linear_nf4_with_input_gradient(dtype, x_dtype):
    w = to_nf4(_weight((576, 576), dtype), 64, 64)
    x0 = torch.randn(3, 5, 576).to(x_dtype or dtype)
    g = torch.randn(3, 5, 576).to(x0.dtype)
    outs = []
    for f in (nf4_linear, lambda x, w: linear_nf4(input=x, weight=w)):
        x = x0.clone().requires_grad_()
        y = f(x, w)
        y.backward(g)
        outs.append((y.detach(), x.grad))
    (y, gx), (y_ao, gx_ao) = outs
    assert _same_bits(y, y_ao) and _same_bits(gx, gx_ao)
    # and against a dense product with torchao's dequantized weight, in float64
    dense = w.get_original_weight().double()
    torch.testing.assert_close(y.double(), x0.double() @ dense.T, rtol=0.02, atol=0.02)


def test_nf4_linear_keeps_no_dense_weight_and_gives_no_weight_gradient():
    w = torch.nn.Parameter(to_nf4(_weight((128, 128), torch.float32)), requires_grad=False)
    x = torch.randn(4, 128, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = nf4_linear(x, w)
    assert all(t.numel() < 128 * 128 for t in saved)  # packed codes and scalers, no (128, 128)
    y.sum().backward()
    assert w.grad is None and x.grad is not None


def test_opcheck():
    w = to_nf4(_weight((128, 128), torch.float32))
    inner = _inner(w)
    torch.library.opcheck(torch.ops.squash.nf4_dequantize.default, inner)
    x = torch.randn(2, 7, 128, requires_grad=True)
    torch.library.opcheck(torch.ops.squash.nf4_linear.default, (x, *inner, [128, 128]))


def test_compile_traces_nf4_linear():
    w = to_nf4(_weight((128, 256), torch.float32))
    x = torch.randn(9, 256, requires_grad=True)
    f = torch.compile(
        lambda x, *inner: torch.ops.squash.nf4_linear(x, *inner, [128, 256]),
        backend="aot_eager", fullgraph=True,
    )  # fmt: skip
    y = f(x, *_inner(w))
    y.sum().backward()
    x2 = x.detach().clone().requires_grad_()
    y2 = linear_nf4(input=x2, weight=w)
    y2.sum().backward()
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad)


def test_bad_inputs_raise_value_error():
    data, qs, qf, mean, nf4, b, sb = _inner(to_nf4(_weight((128, 128), torch.float32)))
    op = torch.ops.squash.nf4_dequantize
    with pytest.raises(ValueError, match="quantized_scalers has"):
        op(data, qs[:-1], qf, mean, nf4, b, sb)
    with pytest.raises(ValueError, match="quantization_factor has"):
        op(data, qs, torch.cat([qf, qf]), mean, nf4, b, sb)
    with pytest.raises(ValueError, match="must have nf4's dtype"):
        op(data, qs, qf.double(), mean, nf4, b, sb)
    with pytest.raises(ValueError, match="block_size must be even"):
        op(data, qs, qf, mean, nf4, 3, sb)
    with pytest.raises(ValueError, match="contiguous NF4Tensor"):
        nf4_dequantize(torch.randn(4, 4))


def test_torchao_switch_routes_to_linear_nf4(monkeypatch):
    monkeypatch.setattr(_loader, "_env", {})
    monkeypatch.setenv("SQUASH_NF4", "torchao")
    calls = []
    import squash.nf4.ops as mod

    monkeypatch.setattr(mod, "linear_nf4", lambda **kw: calls.append(kw) or kw["input"])
    w = to_nf4(_weight((128, 128), torch.float32))
    x = torch.randn(2, 128)
    assert nf4_linear(x, w) is x and calls
    monkeypatch.setattr(_loader, "_env", {})
    monkeypatch.setenv("SQUASH_NF4", "fast")
    with pytest.raises(ValueError, match="SQUASH_NF4 must be"):
        nf4_linear(x, w)


def test_sparse_lora_base_runs_the_native_op():
    """SparseLoRALinear's NF4 base goes through squash::nf4_linear (forward and input gradient),
    and its output and input gradient equal those with torchao's linear_nf4 for the base."""
    from squash.modules import SparseLoRALinear, sparse_lora_linear

    layer = sparse_lora_linear(256, 128, rank=8, alpha=16, quantize_base=True)
    torch.nn.init.normal_(layer.lora_b.weight if hasattr(layer.lora_b, "weight") else
                          layer.lora_b.values)  # fmt: skip
    x = torch.randn(3, 256, requires_grad=True)
    with torch.profiler.profile() as prof:
        y = layer(x)
        y.sum().backward()
    names = {e.name for e in prof.events()}
    assert "squash::nf4_linear" in names and "squash::nf4_dequantize" in names
    x2 = x.detach().clone().requires_grad_()
    lora = layer.lora_b(layer.lora_a(x2))
    y2 = linear_nf4(input=x2, weight=layer.weight) + layer.scaling * lora
    y2.sum().backward()
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad)
