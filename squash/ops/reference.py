"""Pure-PyTorch reference for the FFI ops: correct on any device, accumulates in fp32.

These run when no kernel could be compiled, or when ``SQUASH_KERNELS=reference``. They validate the
indices (``ValueError`` naming the broken rule, :func:`squash.sparsity.validate_ffi`), then compute
the gather formulas themselves, term by term, as the kernels do: an output reads only the inputs its
pattern names, so a NaN or inf in an input column that no row uses reaches no output, and one in a
used column reaches exactly the outputs that read it (a dense product would spread it through the
zeros, ``0 * inf = NaN``). The gathered terms are formed a block of rows at a time, so memory stays
bounded; the cost is that of a dense product or more: this is the slow path.
"""

import torch

from squash.sparsity.ffi import validate_ffi

# Gathered terms held at once: (tokens, rows of a block, k) elements.
_BLOCK_ELEMENTS = 1 << 22


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_blocks(tokens: int, rows: int, k: int):
    step = max(1, _BLOCK_ELEMENTS // max(1, tokens * k))
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


def _check_grad_out(grad_out: torch.Tensor, out_features: int, op: str) -> None:
    if grad_out.dim() < 1 or grad_out.shape[-1] != out_features:
        raise ValueError(
            f"{op}: grad_out {tuple(grad_out.shape)} must end in out_features = {out_features}"
        )


def ffi_linear(x: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``y[..., o] = sum_j values[o, j] * x[..., indices[o, j]]``; ``x`` is ``(..., in)``."""
    validate_ffi(values, indices, x.shape[-1], where="squash::ffi_linear")
    acc = _acc_dtype(x.dtype)
    xt = x.reshape(-1, x.shape[-1]).to(acc)  # (T, in)
    v, idx = values.to(acc), indices.long()
    out, k = idx.shape
    y = xt.new_empty(xt.shape[0], out)  # (T, out)
    for r0, r1 in _row_blocks(xt.shape[0], out, k):
        y[:, r0:r1] = (xt[:, idx[r0:r1]] * v[r0:r1]).sum(-1)  # (T, r, k) -> (T, r)
    return y.to(x.dtype).reshape(*x.shape[:-1], out)


def ffi_linear_grad_input(
    grad_out: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, in_features: int
) -> torch.Tensor:
    """``grad_x[..., i] = sum_{o, j: indices[o, j] = i} values[o, j] * grad_out[..., o]``."""
    validate_ffi(values, indices, in_features, where="squash::ffi_linear_grad_input")
    _check_grad_out(grad_out, indices.shape[0], "squash::ffi_linear_grad_input")
    acc = _acc_dtype(grad_out.dtype)
    g = grad_out.reshape(-1, grad_out.shape[-1]).to(acc)  # (T, out)
    v, idx = values.to(acc), indices.long()
    out, k = idx.shape
    gx = g.new_zeros(g.shape[0], in_features)  # (T, in)
    for r0, r1 in _row_blocks(g.shape[0], out, k):
        terms = g[:, r0:r1, None] * v[r0:r1]  # (T, r, k)
        gx.index_add_(1, idx[r0:r1].reshape(-1), terms.reshape(g.shape[0], -1))
    return gx.to(grad_out.dtype).reshape(*grad_out.shape[:-1], in_features)


def ffi_linear_grad_values(
    grad_out: torch.Tensor, x: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """``grad_values[o, j] = sum_t grad_out[t, o] * x[t, indices[o, j]]`` over all leading dims."""
    validate_ffi(None, indices, x.shape[-1], where="squash::ffi_linear_grad_values")
    _check_grad_out(grad_out, indices.shape[0], "squash::ffi_linear_grad_values")
    if grad_out.shape[:-1] != x.shape[:-1]:
        raise ValueError(
            f"squash::ffi_linear_grad_values: grad_out {tuple(grad_out.shape)} and x "
            f"{tuple(x.shape)} must share their leading dimensions"
        )
    acc = _acc_dtype(x.dtype)
    g = grad_out.reshape(-1, grad_out.shape[-1]).to(acc)  # (T, out)
    xt = x.reshape(-1, x.shape[-1]).to(acc)  # (T, in)
    idx = indices.long()
    out, k = idx.shape
    gv = g.new_empty(out, k)
    for r0, r1 in _row_blocks(g.shape[0], out, k):
        gv[r0:r1] = (xt[:, idx[r0:r1]] * g[:, r0:r1, None]).sum(0)  # (T, r, k) -> (r, k)
    return gv.to(grad_out.dtype)
