"""Shared by the op tests: random FFI inputs, the float64 dense masked product, and per-element
tolerances suited to each dtype.

Tolerances. Every backend accumulates in fp32 (fp64 for fp64) and rounds the result to the
dtype once, so against the exact (float64) value an element may be off by one rounding of the
dtype relative to itself (``rtol``: the unit roundoff, 2^-8 for bf16, 2^-11 for fp16) plus the
fp32 accumulation error of a sum of a few hundred unit-sized terms (``atol``); two results that
were each rounded once (a kernel against the reference) may be two such roundings apart.
torch.testing.assert_close applies them element by element: ``|got - want| <= atol + rtol *
|want|``.
"""

import torch

from squash.sparsity import ffi_to_dense, random_ffi_indices

RTOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2**-8, torch.float16: 2**-11}
ATOL = {torch.float64: 1e-12, torch.float32: 1e-4, torch.bfloat16: 1e-4, torch.float16: 1e-4}


def make_inputs(lead, in_features, out_features, k, dtype=torch.float32, index_dtype=None,
                seed=0, device="cpu"):
    """Random ``x (*lead, in)``, ``values (out, k)``, ``indices (out, k)``, ``grad_out (*lead,
    out)`` from one seeded CPU generator (then moved to ``device``)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, in_features, generator=g).to(dtype)
    values = torch.randn(out_features, k, generator=g).to(dtype)
    grad_out = torch.randn(*lead, out_features, generator=g).to(dtype)
    indices = random_ffi_indices(out_features, in_features, k, generator=g)
    if index_dtype is not None:
        indices = indices.to(index_dtype)
    return x.to(device), values.to(device), indices.to(device), grad_out.to(device)


def dense_ops(x, values, indices, grad_out):
    """Forward, input gradient and values gradient from the dense masked matrix, in float64."""
    w = ffi_to_dense(values.double(), indices, x.shape[-1])  # (out, in)
    xd, gd = x.double(), grad_out.double()
    full = gd.reshape(-1, gd.shape[-1]).T @ xd.reshape(-1, xd.shape[-1])  # (out, in)
    return xd @ w.T, gd @ w, torch.gather(full, 1, indices.long())


def run_ops(x, values, indices, grad_out):
    """The three ops through the dispatcher (whatever serves the device)."""
    in_features = x.shape[-1]
    return (
        torch.ops.squash.ffi_linear(x, values, indices),
        torch.ops.squash.ffi_linear_grad_input(grad_out, values, indices, in_features),
        torch.ops.squash.ffi_linear_grad_values(grad_out, x, indices),
    )


def assert_close(got, want, dtype, roundings=1):
    """``got`` has ``dtype`` and ``want``'s shape and lies within ``roundings`` roundings of
    ``dtype`` (plus fp32 accumulation) of ``want``, element by element: 1 against the exact
    (float64) value, 2 against another result rounded to ``dtype``."""
    assert got.dtype == dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    torch.testing.assert_close(
        got.double().cpu(), want.double().cpu(), rtol=roundings * RTOL[dtype],
        atol=roundings * ATOL[dtype],
    )


def bad_patterns(indices, in_features):
    """Index patterns that break one FFI rule each, made from a valid ``indices`` (at least 4 rows
    and 2 columns): ``{name: (bad indices, in_features)}``. validate_ffi says which rule broke;
    every backend must raise a ValueError with its words."""
    cases = {}
    bad = indices.clone()
    bad[1, -1] = in_features
    cases["out of range"] = (bad, in_features)
    bad = indices.clone()
    bad[0, 0] = -1
    cases["negative"] = (bad, in_features)
    bad = indices.clone()
    bad[2, 1] = bad[2, 0]
    cases["duplicate"] = (bad, in_features)
    bad = indices.clone()
    bad[3, 0], bad[3, 1] = indices[3, 1], indices[3, 0]
    cases["unsorted"] = (bad, in_features)
    cases["wrong dtype"] = (indices.long(), in_features)
    cases["1-D"] = (indices[0], in_features)
    cases["fan-in 0"] = (indices[:, :0], in_features)
    cases["in_features 0"] = (indices, 0)
    k = indices.shape[1]
    cases["fan-in > in_features"] = (
        torch.arange(k, dtype=indices.dtype).expand(indices.shape[0], k).contiguous(), k - 1
    )
    return cases


def contract_message(values, indices, in_features):
    """The message validate_ffi gives for this pattern, as a regex (a dtype named in it is
    spelled differently by C++, so the match stops before it)."""
    import re

    from squash.sparsity import validate_ffi

    try:
        validate_ffi(values, indices, in_features)
    except ValueError as err:
        text = str(err)
        return re.escape(text.split(", got torch.")[0])
    raise AssertionError("validate_ffi accepted a bad pattern")
