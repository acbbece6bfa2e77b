"""One index contract on every backend: the same bad patterns raise the same ValueError (the
words of squash.sparsity.validate_ffi, the one place that states the rules) from the reference,
the native CPU kernel and (in test_gpu_emulated.py, and on a GPU in test_gpu_kernels.py) the GPU
kernel; no backend returns a result for them. Fan-in 0, in_features 0 and fan-in > in_features
are bad patterns too: every backend refuses them."""

import os

import pytest
import torch

import squash
from squash.ops import reference

from ffi_inputs import bad_patterns, contract_message, make_inputs

NATIVE = os.environ.get("SQUASH_KERNELS", "native") != "reference"
IN, OUT, K = 40, 6, 5


def _ops(backend):
    if backend == "reference":
        return reference.ffi_linear, reference.ffi_linear_grad_input, reference.ffi_linear_grad_values
    assert squash.ops.ensure_loaded("cpu"), "the CPU kernel failed to build"
    assert torch._C._dispatch_has_kernel_for_dispatch_key("squash::ffi_linear", "CPU")
    ops = torch.ops.squash
    return ops.ffi_linear.default, ops.ffi_linear_grad_input.default, ops.ffi_linear_grad_values.default


BACKENDS = ["reference"] + (["native"] if NATIVE else [])
CASES = list(bad_patterns(torch.zeros(OUT, K, dtype=torch.int16), IN))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tokens", [1, 12])  # the direct paths and the tiled ones
def test_bad_patterns_raise_validate_ffis_error(backend, case, tokens):
    x, values, indices, grad_out = make_inputs((tokens,), IN, OUT, K)
    bad, in_features = bad_patterns(indices, IN)[case]
    forward, grad_input, grad_values = _ops(backend)
    x = x[:, :in_features]
    v = values[:, : bad.shape[-1]] if bad.dim() == 2 else values
    want = contract_message(v, bad, in_features)
    with pytest.raises(ValueError, match=want):
        forward(x, v, bad)
    with pytest.raises(ValueError, match=want):
        grad_input(grad_out, v, bad, in_features)
    if bad.dim() == 2:  # grad_values has no values: its shape rule is grad_out's width
        with pytest.raises(ValueError, match=contract_message(None, bad, in_features)):
            grad_values(grad_out, x, bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_values_shape_mismatch(backend):
    x, values, indices, grad_out = make_inputs((12,), IN, OUT, K)
    forward, grad_input, _ = _ops(backend)
    for v, i in ((values[:, :4], indices), (values, indices[:5])):
        want = contract_message(v, i, IN)
        with pytest.raises(ValueError, match=want):
            forward(x, v, i)
        with pytest.raises(ValueError, match=want):
            grad_input(grad_out, v, i, IN)


@pytest.mark.skipif(not NATIVE, reason="SQUASH_KERNELS=reference: the native kernel is not loaded")
def test_int16_cannot_address_more_than_32767_features():
    x, values, indices, grad_out = make_inputs((3,), 40000, OUT, K)
    assert indices.dtype == torch.int32
    small = torch.arange(K, dtype=torch.int16).expand(OUT, K).contiguous()  # sorted, in range
    want = contract_message(values, small, 40000)
    assert want.startswith("int16\\ FFI\\ indices\\ cannot\\ address")
    for backend in BACKENDS:
        forward, grad_input, grad_values = _ops(backend)
        with pytest.raises(ValueError, match=want):
            forward(x, values, small)
        with pytest.raises(ValueError, match=want):
            grad_input(grad_out, values, small, 40000)
        with pytest.raises(ValueError, match=want):
            grad_values(grad_out, x, small)
