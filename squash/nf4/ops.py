"""NF4 custom ops: ``squash::nf4_dequantize`` and ``squash::nf4_linear``, fake kernels, autograd.

The base weight stays torchao's ``NF4Tensor``; these ops take its inner tensors
(``quantized_data``, ``quantized_scalers``, ``quantization_factor``, ``scaler_mean``, ``nf4``)
and dequantize them with squash's kernels (``kernels/nf4_cpu.cpp``, ``kernels/nf4_cuda.cu``),
equal bit for bit to ``NF4Tensor.get_original_weight()``. Where no kernel serves a device the
pure-PyTorch :func:`reference_dequantize` (torchao's arithmetic, op for op) does.

``nf4_linear(x, weight)`` is what squash's adapted linears call for their frozen base: the output
``x @ W^T`` and the gradient to ``x`` (``grad @ W``, the weight re-dequantized in the backward
pass, as torchao's ``linear_nf4`` does, so no dense weight is kept between them). Environment
(read once per process): ``SQUASH_NF4=torchao`` routes it to torchao's ``linear_nf4`` instead of
the default ``native``.
"""

import torch
import torch.nn.functional as F

from squash.nf4._torchao import NF4Tensor, linear_nf4
from squash.ops import _loader
from squash.ops.ffi_linear import _native

_lib = torch.library.Library("squash", "FRAGMENT")
_lib.define(
    "nf4_dequantize(Tensor quantized_data, Tensor quantized_scalers, Tensor quantization_factor,"
    " Tensor scaler_mean, Tensor nf4, int block_size, int scaler_block_size) -> Tensor"
)
_lib.define(
    "nf4_linear(Tensor x, Tensor quantized_data, Tensor quantized_scalers,"
    " Tensor quantization_factor, Tensor scaler_mean, Tensor nf4, int block_size,"
    " int scaler_block_size, SymInt[] shape) -> Tensor"
)

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def backend() -> str:
    """``"native"`` (default) or ``"torchao"``, from ``SQUASH_NF4`` (read once per process)."""
    value = _loader._read_env("SQUASH_NF4", "native")
    if value not in ("native", "torchao"):
        raise ValueError(f"SQUASH_NF4 must be 'native' or 'torchao', got {value!r}")
    return value


def _check(data, qs, qf, mean, nf4, block_size, scaler_block_size) -> None:
    """Shape and dtype checks without reading data (shared by the fake and fallback kernels)."""
    op = "squash::nf4_dequantize"
    if data.dtype != torch.uint8 or qs.dtype != torch.int8:
        raise ValueError(
            f"{op}: quantized_data must be uint8 and quantized_scalers int8, got {data.dtype} "
            f"and {qs.dtype}"
        )
    if nf4.dtype not in _FLOATS:
        raise ValueError(f"{op}: nf4 must be float32, bfloat16 or float16, got {nf4.dtype}")
    if qf.dtype != nf4.dtype or mean.dtype != nf4.dtype:
        raise ValueError(
            f"{op}: quantization_factor ({qf.dtype}) and scaler_mean ({mean.dtype}) must have "
            f"nf4's dtype {nf4.dtype}"
        )
    if nf4.numel() != 16 or mean.numel() != 1:
        raise ValueError(f"{op}: nf4 must have 16 elements and scaler_mean one")
    if block_size < 2 or block_size % 2 or scaler_block_size < 1:
        raise ValueError(
            f"{op}: block_size must be even and positive and scaler_block_size positive, got "
            f"{block_size} and {scaler_block_size}"
        )
    n = 2 * data.numel()
    n_blocks = n // block_size
    if n % block_size or qs.numel() != n_blocks:
        raise ValueError(
            f"{op}: quantized_scalers has {qs.numel()} elements, {n} elements in blocks of "
            f"{block_size} need one a block"
        )
    if n_blocks % scaler_block_size or qf.numel() != n_blocks // scaler_block_size:
        raise ValueError(
            f"{op}: quantization_factor has {qf.numel()} elements, {n_blocks} blocks in scaler "
            f"blocks of {scaler_block_size} need {n_blocks // scaler_block_size}"
        )


def reference_dequantize(data, qs, qf, mean, nf4, block_size: int, scaler_block_size: int):
    """torchao's ``get_original_weight`` arithmetic on the inner tensors, flat ``(numel,)``."""
    scalers = (qs.view(-1, scaler_block_size) / qf.unsqueeze(-1)).flatten().to(nf4.dtype) + mean
    repeated = scalers.unsqueeze(-1).expand(scalers.size(0), block_size // 2).flatten()
    first = nf4[(data >> 4).to(torch.long)] * repeated
    second = nf4[(data & 0b1111).to(torch.long)] * repeated
    return torch.stack([first, second], dim=-1).flatten()


# ---- dequantize ---------------------------------------------------------------------------------
@torch.library.impl(_lib, "nf4_dequantize", "CompositeExplicitAutograd")
def _dequantize_fallback(data, qs, qf, mean, nf4, block_size, scaler_block_size):
    _check(data, qs, qf, mean, nf4, block_size, scaler_block_size)
    if _native("nf4_dequantize", data.device.type):
        return torch.ops.squash.nf4_dequantize.default(
            data, qs, qf, mean, nf4, block_size, scaler_block_size
        )
    return reference_dequantize(data.flatten(), qs.flatten(), qf.flatten(), mean, nf4.flatten(),
                                block_size, scaler_block_size)  # fmt: skip


@torch.library.register_fake("squash::nf4_dequantize")
def _dequantize_fake(data, qs, qf, mean, nf4, block_size, scaler_block_size):
    _check(data, qs, qf, mean, nf4, block_size, scaler_block_size)
    return data.new_empty((2 * data.numel(),), dtype=nf4.dtype)


# ---- linear -------------------------------------------------------------------------------------
def _weight(inner, shape, dtype) -> torch.Tensor:
    """The dequantized ``(out, in)`` weight in ``dtype`` (torchao: ``weight.to(dtype)``)."""
    return torch.ops.squash.nf4_dequantize(*inner).view(shape).to(dtype)


@torch.library.impl(_lib, "nf4_linear", "CompositeExplicitAutograd")
def _linear_impl(x, data, qs, qf, mean, nf4, block_size, scaler_block_size, shape):
    return F.linear(x, _weight((data, qs, qf, mean, nf4, block_size, scaler_block_size), shape,
                               x.dtype))  # fmt: skip


@torch.library.register_fake("squash::nf4_linear")
def _linear_fake(x, data, qs, qf, mean, nf4, block_size, scaler_block_size, shape):
    _check(data, qs, qf, mean, nf4, block_size, scaler_block_size)
    if len(shape) != 2 or x.shape[-1] != shape[1]:
        raise ValueError(f"squash::nf4_linear: x {tuple(x.shape)} does not fit a weight {shape}")
    return x.new_empty((*x.shape[:-1], shape[0]))


def _linear_setup_context(ctx, inputs, output):
    x, *inner, shape = inputs
    ctx.shape = shape
    ctx.inner_ints = inner[5:]
    ctx.save_for_backward(*inner[:5])


def _linear_backward(ctx, grad_out):
    inner = (*ctx.saved_tensors, *ctx.inner_ints)
    grad_x = None
    if ctx.needs_input_grad[0]:
        # As torchao's LinearNF4.backward: grad_output @ weight.to(grad_output.dtype).
        grad_x = grad_out @ _weight(inner, ctx.shape, grad_out.dtype)
    return grad_x, None, None, None, None, None, None, None, None


torch.library.register_autograd(
    "squash::nf4_linear", _linear_backward, setup_context=_linear_setup_context
)


# ---- user-facing --------------------------------------------------------------------------------
def _inner(weight: NF4Tensor) -> tuple:
    return (weight.quantized_data, weight.quantized_scalers, weight.quantization_factor,
            weight.scaler_mean, weight.nf4, weight.block_size, weight.scaler_block_size)  # fmt: skip


def _native_fits(weight) -> bool:
    """Whether the native ops take this weight (contiguous 2-D NF4 in fp32/bf16/fp16)."""
    return (
        isinstance(weight, NF4Tensor)
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.nf4.dtype in _FLOATS
        and weight.quantization_factor.dtype == weight.nf4.dtype
        and weight.scaler_mean.dtype == weight.nf4.dtype
    )


def nf4_dequantize(weight: NF4Tensor) -> torch.Tensor:
    """``weight.get_original_weight()`` through squash's kernel, equal bit for bit.

    Args:
        weight (NF4Tensor): a contiguous torchao NF4 weight in float32, bfloat16 or float16.

    Returns:
        torch.Tensor: the dense weight, ``weight.shape``, in ``weight.dtype``.

    Raises:
        ValueError: a weight the kernel does not take (transposed, another dtype).
    """
    if not _native_fits(weight):
        raise ValueError(
            f"nf4_dequantize takes a contiguous NF4Tensor in one of {_FLOATS}, got "
            f"{type(weight).__name__} {tuple(weight.shape)} {weight.dtype}"
        )
    return torch.ops.squash.nf4_dequantize(*_inner(weight)).view(weight.shape)


def nf4_linear(x: torch.Tensor, weight: NF4Tensor) -> torch.Tensor:
    """``x @ weight^T`` for a frozen NF4 weight: gradient to ``x`` only, as torchao's
    ``linear_nf4``, whose results it equals bit for bit (its dequantization is exact).

    Uses squash's dequantize kernel unless ``SQUASH_NF4=torchao``, or the weight is not one the
    kernel takes (then torchao's ``linear_nf4`` serves).

    Args:
        x (torch.Tensor): ``(..., in_features)``.
        weight (NF4Tensor): ``(out_features, in_features)``.

    Returns:
        torch.Tensor: ``(..., out_features)`` in ``x.dtype``.
    """
    if backend() == "torchao" or not _native_fits(weight):
        return linear_nf4(input=x, weight=weight)
    return torch.ops.squash.nf4_linear(x, *_inner(weight), list(weight.shape))

