"""The native CPU kernels (``kernels/ffi_cpu.cpp``) on every code path they pick by shape.

The kernels choose a layout from the token count T and the widths: one or two tokens go straight
through the token rows (the input gradient scatters up to eight), more tokens are copied into
feature-major tiles of W = 8, 16 or 32 tokens (W shrinks for wide rows and for few tokens), and
the tiles are split over threads either whole (many tiles) or by output rows (few tiles). From
128 tokens, long rows (many indices per 128 features) use W = 64 tiles read one L1-sized block
of features (of grad_out rows, for the input gradient) at a time. The values gradient's other
tiles grow to 64 or 128 tokens (AVX-512: eight vectors; fp64 64) where the tile fits half the
L2 and each thread still gets two tiles. The tile copies transpose
16x16 blocks on AVX-512 (8x8 elsewhere) and finish the rows and tokens left over one by one.
The shapes below are picked to
land on each of these, on partial tiles and on widths that are not a multiple of 8, and every
result is compared with the float64 dense masked product and with ``squash.ops.reference``.
Errors must come from the native kernel itself (its messages start with the op name), before it
reads memory through bad indices.
"""

import os

import pytest
import torch

import squash
from squash.ops import reference
from squash.sparsity import random_ffi_indices

from ffi_inputs import assert_close, dense_ops, make_inputs, run_ops

pytestmark = pytest.mark.skipif(
    os.environ.get("SQUASH_KERNELS", "native") == "reference",
    reason="SQUASH_KERNELS=reference: the native CPU kernel is not loaded",
)

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]

# (leading shape, in_features, out_features, k): the path each one takes with 1 or 2 threads.
SHAPES = [
    ((1,), 64, 16, 7),  # one token: direct gather / scatter
    ((2,), 50, 9, 50),  # two tokens, k = in_features
    ((5,), 37, 1, 1),  # out = 1, k = 1; W = 8 tile with 3 padded tokens; scatter gradient
    ((13,), 100, 24, 10),  # W = 16, one partial tile: split by rows
    ((3, 47), 257, 70, 26),  # 141 tokens: four full W = 32 tiles and a partial one
    ((300,), 96, 65, 96),  # k = in_features, out not a multiple of 8, many tiles
    ((9,), 3000, 12, 300),  # wide rows: W = 16
    ((37,), 40000, 5, 3),  # in_features > 32767 (int32 indices): W = 8
    ((260,), 64, 150, 32),  # long rows: feature blocks (one), grad_out row blocks (two)
    ((150,), 300, 140, 120),  # long rows, 3 feature blocks; 3 tiles of 64: split by rows (2 thr.)
    ((20,), 1000, 63, 500),  # CSC pattern counted and filled in parallel chunks (2 threads)
    ((45,), 150, 37, 20),  # AVX-512 16x16 tile copies: 2 feature passes, 6 + 5 + 13 leftovers
    ((600,), 200, 40, 20),  # AVX-512 values gradient: W = 128 tiles, the last of 88 tokens
    ((200,), 200, 40, 20),  # values gradient W = 64 with 2 threads (128 with one), partial tile
]


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(scope="module", autouse=True)
def native_cpu_kernel():
    assert squash.ops.ensure_loaded("cpu"), "the CPU kernel failed to build"
    for op in ("ffi_linear", "ffi_linear_grad_input", "ffi_linear_grad_values"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"squash::{op}", "CPU")


def make(lead, in_features, out_features, k, dtype, seed=0):
    return make_inputs(lead, in_features, out_features, k, dtype, seed=seed)


@pytest.mark.parametrize("lead, in_features, out_features, k", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_dense_and_reference(lead, in_features, out_features, k, dtype, threads):
    x, values, indices, grad_out = make(lead, in_features, out_features, k, dtype)
    if in_features > 32767:
        assert indices.dtype == torch.int32
    got = run_ops(x, values, indices, grad_out)
    for g, want in zip(got, dense_ops(x, values, indices, grad_out)):
        assert_close(g, want, dtype)
    refs = (
        reference.ffi_linear(x, values, indices),
        reference.ffi_linear_grad_input(grad_out, values, indices, in_features),
        reference.ffi_linear_grad_values(grad_out, x, indices),
    )
    for g, r in zip(got, refs):
        # Both accumulate in fp32 (fp64) and round once: two roundings apart at most.
        assert_close(g, r, dtype, roundings=2)


@pytest.mark.parametrize("lead, in_features, out_features, k", [s for s in SHAPES if s[1] < 32768])
def test_int16_and_int32_indices_give_identical_results(lead, in_features, out_features, k):
    x, values, indices, grad_out = make(lead, in_features, out_features, k, torch.float32)
    a = run_ops(x, values, indices.to(torch.int16), grad_out)
    b = run_ops(x, values, indices.to(torch.int32), grad_out)
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "lead, in_features, out_features, k",
    [((1,), 40, 16, 30), ((70,), 43, 21, 30), ((130,), 40, 140, 30)],  # direct, tiles, blocks
)
def test_low_precision_outputs_round_like_torch(dtype, lead, in_features, out_features, k):
    # Integers up to 40 are exact in bf16 and fp16 and every fp32 sum of their products is exact,
    # so the only rounding is fp32 -> dtype: it must give torch's bits (round to nearest even).
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-40, 41, (*lead, in_features), generator=g).to(dtype)
    values = torch.randint(-40, 41, (out_features, k), generator=g).to(dtype)
    grad_out = torch.randint(-40, 41, (*lead, out_features), generator=g).to(dtype)
    indices = random_ffi_indices(out_features, in_features, k, generator=g)
    got_all = run_ops(x, values, indices, grad_out)
    for got, want in zip(got_all, dense_ops(x, values, indices, grad_out)):
        if dtype == torch.bfloat16:
            assert (want.to(dtype).double() != want).any()  # rounding does happen
        torch.testing.assert_close(got, want.to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 20, 200])
def test_nan_and_inf_reach_only_the_outputs_that_read_them(dtype, tokens):
    x, values, indices, _ = make((tokens,), 48, 24, 6, dtype)

    def reads(feature):  # (out,): the output rows whose pattern holds `feature`
        return (indices.long() == feature).any(dim=1)

    t_nan, f_nan = tokens // 2, int(indices[3, 2])
    x[t_nan, f_nan] = float("nan")
    want_nan = torch.zeros(tokens, 24, dtype=torch.bool)
    want_nan[t_nan] = reads(f_nan)
    want_inf = torch.zeros(tokens, 24, dtype=torch.bool)
    if tokens > 1:
        f_inf = int(indices[5, 0])
        x[-1, f_inf] = float("inf")
        want_inf[-1] = reads(f_inf)
    y = torch.ops.squash.ffi_linear(x, values, indices)
    assert torch.equal(torch.isnan(y), want_nan)
    assert torch.equal(torch.isinf(y), want_inf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_and_broadcast_inputs(dtype, threads):
    in_f, out_f, k, T = 70, 19, 9, 150
    _, values, indices, _ = make((T,), in_f, out_f, k, dtype)
    wide = torch.randn(T, in_f + 13).to(dtype)
    cases = {
        "transposed": torch.randn(in_f, T).to(dtype).T,  # stride (1, T)
        "row slice": wide[:, 5 : 5 + in_f],  # stride (in_f + 13, 1)
        "every other token": torch.randn(2 * T, in_f).to(dtype)[::2],
        "broadcast row": torch.randn(1, in_f).to(dtype).expand(T, in_f),  # stride (0, 1)
        "3-D permuted": torch.randn(in_f, 3, 50).to(dtype).permute(1, 2, 0),
    }
    grad_out = torch.randn(out_f, T).to(dtype).T
    v_nc = values.T.contiguous().T
    i_nc = indices.T.contiguous().T
    assert not (grad_out.is_contiguous() or v_nc.is_contiguous() or i_nc.is_contiguous())
    for name, x in cases.items():
        g = grad_out if x.dim() == 2 else grad_out.reshape(3, 50, out_f)
        got = run_ops(x, v_nc, i_nc, g)
        for r, want in zip(got, dense_ops(x, values, indices, g)):
            assert r.is_contiguous(), name
            assert_close(r, want, dtype)


def test_empty_token_dimension():
    x, values, indices, grad_out = make((0,), 24, 8, 3, torch.float32)
    y, gx, gv = run_ops(x, values, indices, grad_out)
    assert y.shape == (0, 8) and gx.shape == (0, 24)
    torch.testing.assert_close(gv, torch.zeros(8, 3), rtol=0, atol=0)


# ---- bad inputs: ValueError from the native kernel, before any memory is read through them -----
def _inputs(index_dtype=torch.int16):
    x, values, indices, grad_out = make((12,), 40, 6, 5, torch.float32)
    return x, values, indices.to(index_dtype), grad_out


@pytest.mark.parametrize("index_dtype", [torch.int16, torch.int32])
@pytest.mark.parametrize("bad_value", [40, 1000, -1, -30000])
def test_out_of_range_indices_raise(index_dtype, bad_value):
    x, values, indices, grad_out = _inputs(index_dtype)
    bad = indices.clone()
    bad[4, 2] = bad_value
    for tokens in (1, 12):  # the direct paths and the tiled ones check alike
        xs, gs = x[:tokens], grad_out[:tokens]
        with pytest.raises(ValueError, match=r"squash::ffi_linear: FFI index out of range \[0, 40\): indices\[4, 2\]"):
            torch.ops.squash.ffi_linear(xs, values, bad)
        with pytest.raises(ValueError, match=r"squash::ffi_linear_grad_input: FFI index out of range"):
            torch.ops.squash.ffi_linear_grad_input(gs, values, bad, 40)
        with pytest.raises(ValueError, match=r"squash::ffi_linear_grad_values: FFI index out of range"):
            torch.ops.squash.ffi_linear_grad_values(gs, xs, bad)


def test_indices_beyond_a_smaller_in_features_raise():
    x, values, indices, grad_out = _inputs()
    limit = int(indices.max())  # the largest index is then out of range
    with pytest.raises(ValueError, match="squash::ffi_linear: FFI index out of range"):
        torch.ops.squash.ffi_linear(x[:, :limit], values, indices)
    with pytest.raises(ValueError, match="squash::ffi_linear_grad_input: FFI index out of range"):
        torch.ops.squash.ffi_linear_grad_input(grad_out, values, indices, limit)
    with pytest.raises(ValueError, match="squash::ffi_linear_grad_values: FFI index out of range"):
        torch.ops.squash.ffi_linear_grad_values(grad_out, x[:, :limit], indices)


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.uint8, torch.float32])
def test_wrong_index_dtype_raises(index_dtype):
    x, values, indices, grad_out = _inputs()
    bad = indices.to(index_dtype)
    with pytest.raises(ValueError, match="squash::ffi_linear: FFI indices must be int16 or int32"):
        torch.ops.squash.ffi_linear(x, values, bad)
    with pytest.raises(ValueError, match="squash::ffi_linear_grad_input: FFI indices must be int16"):
        torch.ops.squash.ffi_linear_grad_input(grad_out, values, bad, 40)
    with pytest.raises(ValueError, match="squash::ffi_linear_grad_values: FFI indices must be int16"):
        torch.ops.squash.ffi_linear_grad_values(grad_out, x, bad)


def test_shape_and_dtype_mismatches_raise():
    x, values, indices, grad_out = _inputs()
    op = "squash::ffi_linear"
    cases = [
        (lambda: torch.ops.squash.ffi_linear(x, values[:, :4], indices),
         rf"{op}: FFI values shape \(6, 4\) does not match indices shape \(6, 5\)"),
        (lambda: torch.ops.squash.ffi_linear(x, values, indices[:5]),
         rf"{op}: FFI values shape \(6, 5\) does not match indices shape \(5, 5\)"),
        (lambda: torch.ops.squash.ffi_linear(x, values[0], indices), f"{op}: values must be"),
        (lambda: torch.ops.squash.ffi_linear(x[0, 0], values, indices), f"{op}: x must have"),
        (lambda: torch.ops.squash.ffi_linear(x.double(), values, indices), "must share a dtype"),
        (lambda: torch.ops.squash.ffi_linear(x.int(), values.int(), indices), "float32/64"),
        (lambda: torch.ops.squash.ffi_linear_grad_input(grad_out[:, :5], values, indices, 40),
         f"{op}_grad_input: grad_out"),
        (lambda: torch.ops.squash.ffi_linear_grad_input(grad_out, values.half(), indices, 40),
         "must share a dtype"),
        (lambda: torch.ops.squash.ffi_linear_grad_input(grad_out, values, indices, -1),
         "in_features must be >= 0"),
        (lambda: torch.ops.squash.ffi_linear_grad_values(grad_out[:11], x, indices),
         f"{op}_grad_values: grad_out"),
        (lambda: torch.ops.squash.ffi_linear_grad_values(grad_out[:, :5], x, indices),
         f"{op}_grad_values: FFI grad_out .* does not match indices shape"),
        (lambda: torch.ops.squash.ffi_linear_grad_values(grad_out, x.reshape(3, 4, 40), indices),
         "same number of dimensions"),
        (lambda: torch.ops.squash.ffi_linear_grad_values(grad_out.bfloat16(), x, indices),
         "must share a dtype"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
