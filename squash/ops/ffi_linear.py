"""The ``squash::ffi_linear`` custom op, its two backward ops, fake kernels and autograd.

Schemas are defined here, once. Native kernels (``kernels/``) register themselves for the CPU and
CUDA dispatch keys when loaded; until then (and where loading fails) the CompositeExplicitAutograd
kernel below serves every device: on first use it loads the native kernels for the device and
redispatches to them, or falls back to :mod:`squash.ops.reference`.
"""

from typing import Optional

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
    # Worded as squash.sparsity.validate_ffi and the kernels word them.
    if indices.dim() != 2:
        raise ValueError(
            f"FFI indices must be a 2-D tensor (out_features, k), got {tuple(indices.shape)}"
        )
    if indices.dtype not in (torch.int16, torch.int32):
        raise ValueError(f"FFI indices must be int16 or int32, got {indices.dtype}")
    if values.dim() != 2 or indices.shape != values.shape:
        raise ValueError(
            f"FFI values shape {tuple(values.shape)} does not match indices shape "
            f"{tuple(indices.shape)}"
        )
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
# Each op is bilinear in its first two (float) inputs, and the gradient with respect to either one
# is an FFI op again, so one registration serves all three and double backward (e.g. a gradient
# penalty, Hessian-vector products) is exact. With W the dense (out, in) weight, U the incoming
# gradient:
#   ffi_linear(x, v)  = x @ W^T    -> d/dx: U @ W = grad_input(U, v);    d/dv: grad_values(U, x)
#   grad_input(g, v)  = g @ W      -> d/dg: U @ W^T = ffi_linear(U, v);  d/dv: grad_values(g, U)
#   grad_values(g, x) = (g^T x)[W] -> d/dg: ffi_linear(x, U);            d/dx: grad_input(g, U)
def _register_bilinear_autograd(op: str, grad_first, grad_second, in_features) -> None:
    """Register ``op``'s autograd: ``grad_first(U, second, indices, in_features)`` and
    ``grad_second(U, first, indices, in_features)`` give the gradients of its first two inputs
    (each computed only when needed, each saving only the other input); ``in_features(inputs)``
    reads the dense weight's width from the op's inputs. The remaining inputs get no gradient."""

    def setup_context(ctx, inputs, output):
        first, second, indices = inputs[:3]
        ctx.in_features = in_features(inputs)
        ctx.save_for_backward(
            first if ctx.needs_input_grad[1] else None,
            second if ctx.needs_input_grad[0] else None,
            indices,
        )

    def backward(ctx, up):
        first, second, indices = ctx.saved_tensors
        d_first = d_second = None
        if ctx.needs_input_grad[0]:
            d_first = grad_first(up, second, indices, ctx.in_features)
        if ctx.needs_input_grad[1]:
            d_second = grad_second(up, first, indices, ctx.in_features)
        return (d_first, d_second) + (None,) * (len(ctx.needs_input_grad) - 2)

    torch.library.register_autograd(op, backward, setup_context=setup_context)


_ops = torch.ops.squash
_register_bilinear_autograd(  # (x, values, indices)
    "squash::ffi_linear",
    grad_first=lambda up, values, idx, n: _ops.ffi_linear_grad_input(up, values, idx, n),
    grad_second=lambda up, x, idx, n: _ops.ffi_linear_grad_values(up, x, idx),
    in_features=lambda inputs: inputs[0].shape[-1],
)
_register_bilinear_autograd(  # (grad_out, values, indices, in_features)
    "squash::ffi_linear_grad_input",
    grad_first=lambda up, values, idx, n: _ops.ffi_linear(up, values, idx),
    grad_second=lambda up, grad_out, idx, n: _ops.ffi_linear_grad_values(grad_out, up, idx),
    in_features=lambda inputs: inputs[3],
)
_register_bilinear_autograd(  # (grad_out, x, indices)
    "squash::ffi_linear_grad_values",
    grad_first=lambda up, x, idx, n: _ops.ffi_linear(x, up, idx),
    grad_second=lambda up, grad_out, idx, n: _ops.ffi_linear_grad_input(grad_out, up, idx, n),
    in_features=lambda inputs: inputs[1].shape[-1],
)


def ffi_linear(
    x: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    *,
    in_features: Optional[int] = None,
    validate: bool = False,
) -> torch.Tensor:
    """FFI sparse linear map: ``y[..., o] = sum_j values[o, j] * x[..., indices[o, j]]``.

    Args:
        x (torch.Tensor): ``(..., in_features)``, float32/64, bfloat16 or float16.
        values (torch.Tensor): ``(out_features, k)`` in ``x.dtype``.
        indices (torch.Tensor): ``(out_features, k)`` int16/int32, rows strictly increasing.
        in_features (Optional[int]): the width ``x`` must have (the logical matrix's columns).
            The op alone cannot tell a wrong width whose columns the indices happen not to
            reach; modules pass theirs.
        validate (bool): check the full FFI contract of ``indices`` in Python first. The kernels
            check it too (one pass over the indices, the same messages); this names the call.

    Returns:
        torch.Tensor: ``(..., out_features)`` in ``x.dtype`` (accumulated in fp32).

    Raises:
        ValueError: bad shapes or dtypes, ``x`` not ``in_features`` wide, or indices breaking the
            FFI contract.
    """
    if in_features is not None and x.shape[-1] != in_features:
        raise ValueError(f"ffi_linear: x {tuple(x.shape)} must end in in_features = {in_features}")
    if validate:
        from squash.sparsity import validate_ffi

        validate_ffi(values, indices, x.shape[-1], where="ffi_linear")
    return torch.ops.squash.ffi_linear(x, values, indices)
