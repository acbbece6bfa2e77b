"""The ``squash::ffi_linear`` custom op, its two backward ops, fake kernels and autograd.

Schemas are defined here, once. Native kernels (``kernels/``) register themselves for the CPU and
CUDA dispatch keys when loaded; until then (and where loading fails) the CompositeExplicitAutograd
kernel below serves every device: on first use it loads the native kernels for the device and
redispatches to them, or falls back to :mod:`squash.ops.reference`.
"""

import torch

from squash.ops import _loader, reference

_lib = torch.library.Library("squash", "DEF")
_lib.define("ffi_linear(Tensor x, Tensor values, Tensor indices) -> Tensor")
_lib.define(
    "ffi_linear_grad_input(Tensor grad_out, Tensor values, Tensor indices, SymInt in_features)"
    " -> Tensor"
)
_lib.define("ffi_linear_grad_values(Tensor grad_out, Tensor x, Tensor indices) -> Tensor")


def _check(x: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, x_name: str) -> None:
    """Shape and dtype checks shared by the fake and the fallback kernels (cheap, no data)."""
    if values.dim() != 2 or indices.shape != values.shape:
        raise ValueError(
            f"values {tuple(values.shape)} and indices {tuple(indices.shape)} must both be "
            "(out_features, k)"
        )
    if indices.dtype not in (torch.int16, torch.int32):
        raise ValueError(f"indices must be int16 or int32, got {indices.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{x_name} must have at least one dimension")
    if x.dtype != values.dtype:
        raise ValueError(f"{x_name} ({x.dtype}) and values ({values.dtype}) must share a dtype")
    if x.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise ValueError(f"FFI ops take float32/64, bfloat16 or float16, got {x.dtype}")


_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}


def _native(op: str, device_type: str) -> bool:
    """True when a native kernel for ``squash::<op>`` serves ``device_type`` (loading it once)."""
    key = _DISPATCH_KEYS.get(device_type)
    return (
        key is not None
        and _loader.ensure_loaded(device_type)
        and torch._C._dispatch_has_kernel_for_dispatch_key(f"squash::{op}", key)
    )


# ---- forward ------------------------------------------------------------------------------------
@torch.library.impl(_lib, "ffi_linear", "CompositeExplicitAutograd")
def _ffi_linear_fallback(x, values, indices):
    _check(x, values, indices, "x")
    if _native("ffi_linear", x.device.type):
        return torch.ops.squash.ffi_linear.default(x, values, indices)
    return reference.ffi_linear(x, values, indices)


@torch.library.register_fake("squash::ffi_linear")
def _ffi_linear_fake(x, values, indices):
    _check(x, values, indices, "x")
    return x.new_empty((*x.shape[:-1], values.shape[0]))


# ---- input gradient -----------------------------------------------------------------------------
@torch.library.impl(_lib, "ffi_linear_grad_input", "CompositeExplicitAutograd")
def _grad_input_fallback(grad_out, values, indices, in_features):
    _check(grad_out, values, indices, "grad_out")
    if _native("ffi_linear_grad_input", grad_out.device.type):
        return torch.ops.squash.ffi_linear_grad_input.default(grad_out, values, indices, in_features)
    return reference.ffi_linear_grad_input(grad_out, values, indices, in_features)


@torch.library.register_fake("squash::ffi_linear_grad_input")
def _grad_input_fake(grad_out, values, indices, in_features):
    _check(grad_out, values, indices, "grad_out")
    return grad_out.new_empty((*grad_out.shape[:-1], in_features))


# ---- values gradient ----------------------------------------------------------------------------
@torch.library.impl(_lib, "ffi_linear_grad_values", "CompositeExplicitAutograd")
def _grad_values_fallback(grad_out, x, indices):
    if grad_out.dtype != x.dtype:
        raise ValueError(f"grad_out ({grad_out.dtype}) and x ({x.dtype}) must share a dtype")
    if _native("ffi_linear_grad_values", x.device.type):
        return torch.ops.squash.ffi_linear_grad_values.default(grad_out, x, indices)
    return reference.ffi_linear_grad_values(grad_out, x, indices)


@torch.library.register_fake("squash::ffi_linear_grad_values")
def _grad_values_fake(grad_out, x, indices):
    if grad_out.dtype != x.dtype:
        raise ValueError(f"grad_out ({grad_out.dtype}) and x ({x.dtype}) must share a dtype")
    return grad_out.new_empty(indices.shape)


# ---- autograd -----------------------------------------------------------------------------------
def _setup_context(ctx, inputs, output):
    x, values, indices = inputs
    ctx.in_features = x.shape[-1]
    ctx.save_for_backward(
        x if ctx.needs_input_grad[1] else None,
        values if ctx.needs_input_grad[0] else None,
        indices,
    )


def _backward(ctx, grad_out):
    x, values, indices = ctx.saved_tensors
    grad_x = grad_values = None
    if ctx.needs_input_grad[0]:
        grad_x = torch.ops.squash.ffi_linear_grad_input(
            grad_out, values, indices, ctx.in_features
        )
    if ctx.needs_input_grad[1]:
        grad_values = torch.ops.squash.ffi_linear_grad_values(grad_out, x, indices)
    return grad_x, grad_values, None


torch.library.register_autograd("squash::ffi_linear", _backward, setup_context=_setup_context)


def ffi_linear(
    x: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, *, validate: bool = False
) -> torch.Tensor:
    """FFI sparse linear map: ``y[..., o] = sum_j values[o, j] * x[..., indices[o, j]]``.

    Args:
        x (torch.Tensor): ``(..., in_features)``, float32/64, bfloat16 or float16.
        values (torch.Tensor): ``(out_features, k)`` in ``x.dtype``.
        indices (torch.Tensor): ``(out_features, k)`` int16/int32, rows strictly increasing.
        validate (bool): check the full FFI contract of ``indices`` first (one pass over them).
            Modules validate at construction, load and mask update, and skip it here.

    Returns:
        torch.Tensor: ``(..., out_features)`` in ``x.dtype`` (accumulated in fp32).

    Raises:
        ValueError: bad shapes or dtypes; with ``validate``, indices breaking the FFI contract.
    """
    if validate:
        from squash.sparsity import validate_ffi

        validate_ffi(values, indices, x.shape[-1], where="ffi_linear")
    return torch.ops.squash.ffi_linear(x, values, indices)
