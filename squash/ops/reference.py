"""Pure-PyTorch reference for the FFI ops: correct on any device, accumulates in fp32.

These run when no kernel could be compiled, or when ``SQUASH_KERNELS=reference``. They validate the
indices (``ValueError`` naming the broken rule), then go through the dense matrix (scatter, then one
matmul), which costs what the dense product costs.
"""

import torch

from squash.sparsity.ffi import validate_ffi


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _dense(values: torch.Tensor, indices: torch.Tensor, in_features: int, dtype) -> torch.Tensor:
    dense = torch.zeros(values.shape[0], in_features, dtype=dtype, device=values.device)
    return dense.scatter_(1, indices.long(), values.to(dtype))


def ffi_linear(x: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``y[..., o] = sum_j values[o, j] * x[..., indices[o, j]]``; ``x`` is ``(..., in)``."""
    validate_ffi(values, indices, x.shape[-1], where="squash::ffi_linear")
    acc = _acc_dtype(x.dtype)
    w = _dense(values, indices, x.shape[-1], acc)  # (out, in)
    return (x.to(acc) @ w.T).to(x.dtype)  # (..., out)


def ffi_linear_grad_input(
    grad_out: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, in_features: int
) -> torch.Tensor:
    """``grad_x[..., i] = sum_{o, j: indices[o, j] = i} values[o, j] * grad_out[..., o]``."""
    validate_ffi(values, indices, in_features, where="squash::ffi_linear_grad_input")
    acc = _acc_dtype(grad_out.dtype)
    w = _dense(values, indices, in_features, acc)  # (out, in)
    return (grad_out.to(acc) @ w).to(grad_out.dtype)  # (..., in)


def ffi_linear_grad_values(
    grad_out: torch.Tensor, x: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """``grad_values[o, j] = sum_t grad_out[t, o] * x[t, indices[o, j]]`` over all leading dims."""
    validate_ffi(None, indices, x.shape[-1], where="squash::ffi_linear_grad_values")
    acc = _acc_dtype(x.dtype)
    g = grad_out.reshape(-1, grad_out.shape[-1]).to(acc)  # (T, out)
    xt = x.reshape(-1, x.shape[-1]).to(acc)  # (T, in)
    full = g.T @ xt  # (out, in)
    return torch.gather(full, 1, indices.long()).to(grad_out.dtype)  # (out, k)
