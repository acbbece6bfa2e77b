"""SparseLoRALinear against dense computations from its own tensors, torchtune's LoRALinear and
plain QLoRA (NF4 of the original weight)."""

import pytest
import torch
from torch import nn
from squash.nf4 import NF4Tensor, to_nf4
from torchtune.modules.peft import LoRALinear

from squash.modules import FFILinear, SparseLoRALinear, sparse_lora_linear

NF4_INNER = ("quantized_scalers", "quantization_factor", "scaler_mean", "quantized_data", "nf4")


def dense_factor(factor):
    """A factor's dense weight in float64, scattered with a Python loop for FFI factors."""
    if not isinstance(factor, FFILinear):
        return factor.weight.detach().double()
    w = torch.zeros(factor.out_features, factor.in_features, dtype=torch.float64)
    for o in range(factor.out_features):
        for j in range(factor.fan_in):
            w[o, int(factor.indices[o, j])] = float(factor.values[o, j])
    return w


def base_weight(m):
    w = m.weight
    return (w.get_original_weight() if isinstance(w, NF4Tensor) else w.detach()).double()


def expected_output(m, x, base_only=False):
    """``x W^T + b + scaling * (x A^T) B^T`` in float64 from the module's tensors."""
    out = x.double() @ base_weight(m).T
    if m.bias is not None:
        out = out + m.bias.detach().double()
    if base_only:
        return out
    return out + m.scaling * (x.double() @ dense_factor(m.lora_a).T) @ dense_factor(m.lora_b).T


def randomize_b(m, generator):
    """Give lora_b non-zero values so that the adapter path shows in the output."""
    with torch.no_grad():
        t = m.lora_b.values if isinstance(m.lora_b, FFILinear) else m.lora_b.weight
        t.copy_(torch.randn(t.shape, generator=generator) * 0.3)


@pytest.mark.parametrize("sparse_factor", ["a", "b", "both"])
@pytest.mark.parametrize("quantize_base", [False, True])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 4e-2)])
def test_forward_matches_dense_computation(sparse_factor, quantize_base, dtype, tol):
    g = torch.Generator().manual_seed(0)
    m = sparse_lora_linear(
        128, 128, rank=8, alpha=16, sparsity=0.9, sparse_factor=sparse_factor,
        use_bias=not quantize_base, quantize_base=quantize_base, dtype=dtype, generator=g,
    )  # fmt: skip
    randomize_b(m, g)
    x = torch.randn(2, 5, 128, generator=g).to(dtype)
    y = m(x)
    assert y.dtype == dtype and y.shape == (2, 5, 128)
    torch.testing.assert_close(y.double(), expected_output(m, x), atol=tol, rtol=tol)
    m.disabled = True
    torch.testing.assert_close(
        m(x).double(), expected_output(m, x, base_only=True), atol=tol, rtol=tol
    )


def test_dropout_acts_on_adapter_input_only():
    g = torch.Generator().manual_seed(1)
    m = sparse_lora_linear(64, 32, rank=4, alpha=8, dropout=0.5, use_bias=True, generator=g)
    randomize_b(m, g)
    x = torch.randn(6, 64, generator=g)
    m.eval()
    torch.testing.assert_close(m(x).double(), expected_output(m, x), atol=1e-5, rtol=1e-5)
    m.train()
    assert not torch.allclose(m(x).double(), expected_output(m, x), atol=1e-3)
    m.disabled = True
    torch.testing.assert_close(
        m(x).double(), expected_output(m, x, base_only=True), atol=1e-5, rtol=1e-5
    )


def test_dense_limit_equals_torchtune_lora_linear():
    """At sparsity 0 the FFI factors are dense; with the same tensors LoRALinear agrees."""
    g = torch.Generator().manual_seed(2)
    m = sparse_lora_linear(48, 40, 6, 12.0, sparsity=0.0, sparse_factor="both", use_bias=True,
                         generator=g)  # fmt: skip
    randomize_b(m, g)
    ref = LoRALinear(48, 40, 6, 12.0, use_bias=True)
    with torch.no_grad():
        ref.weight.copy_(m.weight)
        ref.bias.copy_(m.bias)
        ref.lora_a.weight.copy_(m.lora_a.to_dense())
        ref.lora_b.weight.copy_(m.lora_b.to_dense())
    x = torch.randn(7, 48, generator=g)
    torch.testing.assert_close(m(x), ref(x), atol=1e-5, rtol=1e-5)


def test_base_state_dict_keys_match_lora_linear():
    ref = LoRALinear(128, 128, 4, 8.0, use_bias=True)
    m = sparse_lora_linear(128, 128, 4, 8.0, use_bias=True)
    ours, theirs = set(m.state_dict()), set(ref.state_dict())
    assert ours & theirs == {"weight", "bias", "lora_b.weight"}
    assert ours - theirs == {"lora_a.values", "lora_a.indices"}
    # A dense base checkpoint loads unchanged, and into an NF4 base it is quantized as QLoRA does.
    base = {"weight": ref.weight.detach(), "bias": ref.bias.detach()}
    missing, unexpected = m.load_state_dict(base, strict=False)
    assert not unexpected and set(missing) == {"lora_a.values", "lora_a.indices", "lora_b.weight"}
    assert torch.equal(m.weight, ref.weight) and torch.equal(m.bias, ref.bias)
    q = sparse_lora_linear(128, 128, 4, 8.0, quantize_base=True)
    q.load_state_dict({"weight": ref.weight.detach()}, strict=False)
    assert torch.equal(
        q.weight.get_original_weight(), to_nf4(ref.weight.detach()).get_original_weight()
    )


def test_lora_init_output_equals_base_and_kaiming_a():
    for sparse_factor in ("a", "b", "both"):
        m = sparse_lora_linear(256, 64, rank=16, alpha=32, sparse_factor=sparse_factor)
        x = torch.randn(4, 256)
        assert torch.equal(m(x), nn.functional.linear(x, m.weight))  # B is zero
        b = m.lora_b.values if isinstance(m.lora_b, FFILinear) else m.lora_b.weight
        assert not b.any()
        fan_in = m.lora_a.fan_in if isinstance(m.lora_a, FFILinear) else 256
        a = m.lora_a.values if isinstance(m.lora_a, FFILinear) else m.lora_a.weight
        assert 0.9 / fan_in**0.5 < float(a.abs().max()) <= 1 / fan_in**0.5


def test_gradients_reach_only_adapter_and_nf4_base_is_untouched():
    g = torch.Generator().manual_seed(3)
    m = sparse_lora_linear(128, 128, rank=4, alpha=8, sparse_factor="a", quantize_base=True,
                         dtype=torch.float32, generator=g)  # fmt: skip
    randomize_b(m, g)
    before = {k: getattr(m.weight, k).clone() for k in NF4_INNER}
    x = torch.randn(10, 128, generator=g, requires_grad=True)
    grad_out = torch.randn(10, 128, generator=g)
    m(x).backward(grad_out)
    assert not m.weight.requires_grad and m.weight.grad is None
    assert not m.lora_a.indices.requires_grad and m.lora_a.indices.grad is None
    assert {n for n, p in m.named_parameters() if p.grad is not None} == {
        "lora_a.values", "lora_b.weight"
    }  # fmt: skip
    # The same gradients from dense autograd on the dense masked factor.
    a = dense_factor(m.lora_a).requires_grad_(True)
    b = dense_factor(m.lora_b).requires_grad_(True)
    xd = x.detach().double().requires_grad_(True)
    out = xd @ base_weight(m).T + m.scaling * (xd @ a.T) @ b.T
    out.backward(grad_out.double())
    tol = dict(atol=1e-4, rtol=1e-4)  # float32 sums over 10 x 128 terms vs float64
    torch.testing.assert_close(
        m.lora_a.values.grad.double(), a.grad.gather(1, m.lora_a.indices.long()), **tol
    )
    torch.testing.assert_close(m.lora_b.weight.grad.double(), b.grad, **tol)
    torch.testing.assert_close(x.grad.double(), xd.grad, **tol)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    a_before = m.lora_a.values.detach().clone()
    opt.step()
    assert not torch.equal(m.lora_a.values, a_before)
    for k in NF4_INNER:
        assert torch.equal(getattr(m.weight, k), before[k]), k


def test_adapter_params_and_buffers():
    m = sparse_lora_linear(64, 64, 4, 8, sparse_factor="a")
    assert m.adapter_params() == ["lora_a.values", "lora_b.weight"]
    assert m.adapter_buffers() == ["lora_a.indices"]
    m = sparse_lora_linear(64, 64, 4, 8, sparse_factor="both")
    assert m.adapter_params() == ["lora_a.values", "lora_b.values"]
    assert m.adapter_buffers() == ["lora_a.indices", "lora_b.indices"]


@pytest.mark.parametrize("quantize_base", [False, True])
def test_merged_weight(quantize_base):
    g = torch.Generator().manual_seed(4)
    m = sparse_lora_linear(128, 128, 8, 4.0, sparse_factor="both", quantize_base=quantize_base,
                         generator=g)  # fmt: skip
    randomize_b(m, g)
    expected = base_weight(m) + m.scaling * dense_factor(m.lora_b) @ dense_factor(m.lora_a)
    a, b = m.dense_factors()
    assert a.shape == (8, 128) and b.shape == (128, 8)
    assert torch.equal(a.double(), dense_factor(m.lora_a)) and torch.equal(
        b.double(), dense_factor(m.lora_b)
    )
    merged = m.merged_weight()
    assert merged.dtype == torch.float32
    torch.testing.assert_close(merged.double(), expected, atol=1e-6, rtol=1e-6)


def test_meta_init_then_to_empty_and_initialize_parameters():
    with torch.device("meta"):
        m = sparse_lora_linear(64, 32, 4, 8, sparse_factor="both")
    m.to_empty(device="cpu")
    m.initialize_parameters()
    assert m.weight.is_meta  # the base waits for the checkpoint, as with LoRALinear
    for f in (m.lora_a, m.lora_b):
        idx = f.indices.long()
        assert not f.values.is_meta and bool((idx[:, 1:] > idx[:, :-1]).all())
        assert int(idx.max()) < f.in_features
    assert not m.lora_b.values.any() and m.lora_a.values.abs().max() > 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sparse_factor="c"), "sparse_factor"),
        (dict(sparsity=1.0), "sparsity"),
        (dict(sparsity=-0.1), "sparsity"),
        (dict(rank=0), "rank"),
        (dict(init="pissa"), "init"),
        (dict(block_size=32), "quantize_base"),
        (dict(sparse_factor="A"), "sparse_factor"),
        (dict(sparsity=None), "sparsity"),
        (dict(sparsity=float("nan")), "sparsity"),
        (dict(rank=2.0), "rank"),
        (dict(in_dim=0), "in_dim"),
        (dict(out_dim=-3), "out_dim"),
        (dict(alpha=float("inf")), "alpha"),
        (dict(dropout=1.0), "dropout"),
        (dict(use_bias="yes"), "use_bias"),
        (dict(weight=torch.zeros(32, 16)), "weight has shape"),
        (dict(weight=torch.zeros(32, 32), use_bias=True), "bias"),
        (dict(bias=torch.zeros(32)), "without weight"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    args = dict(in_dim=32, out_dim=32, rank=4, alpha=8.0) | kwargs
    with pytest.raises(ValueError, match=match):
        sparse_lora_linear(**args)


def low_rank_weight(out_dim, in_dim, seed=0):
    """A weight with a decaying spectrum, as pretrained weights have: rank 16 plus noise."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_dim, 16, generator=g) @ torch.randn(16, in_dim, generator=g) / 4 + (
        0.05 * torch.randn(out_dim, in_dim, generator=g)
    )


def eckart_young(w, rank):
    """The smallest ``||W - M||_F`` over every ``M`` of rank <= ``rank`` (Eckart-Young-Mirsky):
    the norm of the singular values beyond ``rank``, from ``torch.linalg.svdvals``."""
    s = torch.linalg.svdvals(w.double())
    return float(s[rank:].norm())


def prune_rows(m, k):
    """Keep the ``k`` largest ``|m|`` of each row (an independent FFI pruning by topk)."""
    keep = m.abs().topk(k, dim=1).indices
    return torch.zeros_like(m).scatter_(1, keep, m.gather(1, keep))


def svd_factors(w, rank, scaling):
    """``B = U_r sqrt(S_r) / sqrt(s)``, ``A = sqrt(S_r) V_r^T / sqrt(s)`` in float64."""
    u, s, vh = torch.linalg.svd(w.double(), full_matrices=False)
    root = (s[:rank] / scaling).sqrt()
    return u[:, :rank] * root, root[:, None] * vh[:rank]


@pytest.mark.parametrize("sparse_factor", ["a", "b", "both"])
def test_svd_init_dense_base_against_eckart_young(sparse_factor):
    """Dense base. By construction the base is ``W - s * B @ A``, so ``merged == W`` up to float32
    rounding (an identity). The adapter's part is bounded independently: no rank-r product gets
    closer to ``W`` than Eckart-Young's bound, and the pruned SVD factors recomputed here (with a
    least-squares refit of the dense factor, which can only lower the residual) bound it above."""
    w = low_rank_weight(128, 256)
    m = sparse_lora_linear(256, 128, 8, 16.0, sparse_factor=sparse_factor)
    m.initialize_from_pretrained(w)
    torch.testing.assert_close(m.merged_weight(), w, atol=2e-5, rtol=1e-5)  # identity

    a, b = (f.double() for f in m.dense_factors())
    product = m.scaling * b @ a
    residual = float((w.double() - product).norm())
    assert torch.linalg.matrix_rank(product) <= 8
    torch.testing.assert_close(m.weight.double(), w.double() - product, atol=1e-5, rtol=1e-5)
    assert residual >= eckart_young(w, 8) - 1e-4  # lower bound (a theorem)

    # Upper bound: the top-8 SVD factors pruned to the module's fan-in, without a refit.
    b0, a0 = svd_factors(w, 8, m.scaling)
    if sparse_factor in ("a", "both"):
        a0 = prune_rows(a0, m.lora_a.fan_in)
    if sparse_factor in ("b", "both"):
        b0 = prune_rows(b0, m.lora_b.fan_in)
    pruned = m.scaling * b0 @ a0
    # The module factors in float32, the reference in float64: singular vectors agree to a few
    # float32 ulps of ||W|| over the spectral gap, ~1e-4 here.
    if sparse_factor == "both":  # no refit: the module's product is exactly the pruned one
        torch.testing.assert_close(product, pruned, atol=1e-4, rtol=1e-4)
    else:  # the dense factor is the least-squares optimum for the pruned one
        assert residual <= float((w.double() - pruned).norm()) + 1e-5
        sparse = a if sparse_factor == "a" else b
        # Least squares, by the projection onto the pruned factor's row (or column) space.
        if sparse_factor == "a":
            best = w.double() @ torch.linalg.pinv(sparse) @ sparse
        else:
            best = sparse @ torch.linalg.pinv(sparse) @ w.double()
        torch.testing.assert_close(product, best, atol=1e-4, rtol=1e-4)


def test_svd_init_at_sparsity_zero_reaches_eckart_young():
    """With FFI factors that keep every entry, the adapter is the best rank-r approximation."""
    w = low_rank_weight(64, 96)
    m = sparse_lora_linear(96, 64, 8, 16.0, sparsity=0.0, sparse_factor="both")
    m.initialize_from_pretrained(w)
    residual = float((m.weight.double()).norm())  # the base is the residual
    assert abs(residual - eckart_young(w, 8)) <= 1e-4 * float(w.norm())


@pytest.mark.parametrize("sparse_factor", ["a", "b", "both"])
def test_svd_init_nf4_base_against_plain_qlora(sparse_factor):
    """NF4 base. By construction the base is ``NF4(W - s * B @ A)`` (an identity, checked against
    torchao's ``to_nf4`` of the residual recomputed from the module's factors). Against plain
    QLoRA (``NF4(W)``, an independent reference) the merged weight and the output are closer to
    ``W``: the residual has a smaller range to quantize."""
    w = low_rank_weight(128, 256)
    m = sparse_lora_linear(256, 128, 8, 16.0, sparse_factor=sparse_factor, quantize_base=True)
    m.initialize_from_pretrained(w)
    assert isinstance(m.weight, NF4Tensor)
    a, b = m.dense_factors()
    residual = w - m.scaling * (b @ a)
    assert torch.equal(m.weight.get_original_weight(), to_nf4(residual).get_original_weight())

    qlora = to_nf4(w).get_original_weight()
    assert float((m.merged_weight() - w).norm()) < float((qlora - w).norm())
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(1))
    assert float((m(x) - x @ w.T).norm()) < float((x @ qlora.T - x @ w.T).norm())


def test_svd_init_in_constructor_keeps_module_output():
    torch.manual_seed(5)
    dense = sparse_lora_linear(64, 64, 4, 8.0)
    torch.manual_seed(5)
    svd = sparse_lora_linear(64, 64, 4, 8.0, init="svd")  # same random base, then factored
    x = torch.randn(3, 64)
    torch.testing.assert_close(svd(x), dense(x), atol=1e-5, rtol=1e-5)
    assert svd.lora_b.weight.abs().max() > 0


def test_nf4_size_not_divisible_by_torchao_blocks_is_named():
    """torchao's to_nf4 asserts (or, under python -O, fails in a reshape); squash names the
    module, the shape and the block sizes first."""
    with pytest.raises(ValueError, match=r"in_dim=100, out_dim=30.*\(30, 100\).*block_size=64.*"
                                         r"scaler_block_size=256"):  # fmt: skip
        sparse_lora_linear(100, 30, 4, 8.0, quantize_base=True)
    with pytest.raises(ValueError, match=r"block_size=32.*scaler_block_size=256.*8192"):
        sparse_lora_linear(64, 100, 4, 8.0, quantize_base=True, block_size=32)
    assert isinstance(sparse_lora_linear(64, 128, 4, 8.0, quantize_base=True, block_size=32,
                                       scaler_block_size=256).weight, NF4Tensor)  # fmt: skip


def test_given_base_is_used_as_is():
    """An existing base (dense, or NF4) becomes the module's base, the same parameter."""
    weight = nn.Parameter(torch.randn(32, 48), requires_grad=False)
    bias = nn.Parameter(torch.randn(32), requires_grad=False)
    m = sparse_lora_linear(48, 32, 4, 8.0, use_bias=True, weight=weight, bias=bias)
    assert m.weight is weight and m.bias is bias
    x = torch.randn(3, 48)
    torch.testing.assert_close(m(x).double(), expected_output(m, x), atol=1e-5, rtol=1e-5)
    assert not hasattr(m, "merged")
    nf4 = nn.Parameter(to_nf4(torch.randn(128, 128)), requires_grad=False)
    q = sparse_lora_linear(128, 128, 4, 8.0, quantize_base=True, weight=nf4)
    assert q.weight is nf4
    with pytest.raises(ValueError, match="quantize_base is False"):
        sparse_lora_linear(128, 128, 4, 8.0, weight=nf4)
    dense = sparse_lora_linear(128, 128, 4, 8.0, quantize_base=True, weight=torch.randn(128, 128))
    assert isinstance(dense.weight, NF4Tensor)  # a dense base given to a QLoRA module: quantized


def test_svd_init_rejects_wrong_shape():
    m = sparse_lora_linear(32, 16, 4, 8.0)
    with pytest.raises(ValueError, match="shape"):
        m.initialize_from_pretrained(torch.randn(32, 16))


@pytest.mark.slow
def test_compiles_fullgraph_with_nf4_base_and_ffi_factors():
    g = torch.Generator().manual_seed(6)
    m = sparse_lora_linear(128, 128, 8, 16.0, sparse_factor="both", quantize_base=True, generator=g)
    randomize_b(m, g)
    x = torch.randn(4, 128, generator=g)
    eager = m(x)
    eager.sum().backward()
    grad = m.lora_a.values.grad.clone()
    m.lora_a.values.grad = None
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    y = compiled(x)
    y.sum().backward()
    torch.testing.assert_close(y, eager)
    torch.testing.assert_close(m.lora_a.values.grad, grad)
    torch.testing.assert_close(y.double(), expected_output(m, x), atol=1e-5, rtol=1e-5)


def test_nf4_import_falls_back_to_the_newer_torchao_location(monkeypatch):
    """torchao >= 0.16 keeps NF4 under torchao.quantization; squash finds it there."""
    import importlib
    import sys
    import types

    import squash.nf4._torchao as nf4
    import torchao.dtypes.nf4tensor as old

    new = types.ModuleType("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    new.NF4Tensor, new.linear_nf4, new.to_nf4 = old.NF4Tensor, old.linear_nf4, old.to_nf4
    new.SubclassTensorArgs, new.get_block_absmax = old.SubclassTensorArgs, old.get_block_absmax
    monkeypatch.setitem(sys.modules, "torchao.dtypes.nf4tensor", None)  # import raises
    monkeypatch.setitem(sys.modules, new.__name__, new)
    try:
        reloaded = importlib.reload(nf4)
        names = ("NF4Tensor", "SubclassTensorArgs", "get_block_absmax", "linear_nf4", "to_nf4")
        assert all(getattr(reloaded, n) is getattr(old, n) for n in names)
    finally:
        monkeypatch.undo()
        importlib.reload(nf4)


def test_the_module_is_given_its_base_and_factors_and_refuses_what_does_not_fit():
    """``SparseLoRALinear`` holds the very tensors and factors it is given; it reads rank,
    widths and which factor is sparse from them, and names what does not fit."""
    from torch import nn

    w = nn.Parameter(torch.randn(24, 32), requires_grad=False)
    a, b = FFILinear(32, 4, 8), nn.Linear(4, 24, bias=False)
    m = SparseLoRALinear(w, None, a, b, alpha=8.0)
    assert m.weight is w and m.lora_a is a and m.lora_b is b
    assert (m.in_dim, m.out_dim, m.rank, m.sparse_factor, m.scaling) == (32, 24, 4, "a", 2.0)
    assert SparseLoRALinear(w, None, nn.Linear(32, 4, bias=False), FFILinear(4, 24, 2),
                            4.0).sparse_factor == "b"  # fmt: skip
    assert SparseLoRALinear(w, None, a, FFILinear(4, 24, 2), 4.0).sparse_factor == "both"
    bad = [
        ((w, None, FFILinear(30, 4, 8), b, 8.0), "do not fit a base"),
        ((w, None, a, nn.Linear(4, 20, bias=False), 8.0), "do not fit a base"),
        ((w, None, nn.Linear(32, 4, bias=False), b, 8.0), "both factors are dense"),
        ((w, None, a, nn.Linear(4, 24), 8.0), "lora_b must be an FFILinear or a bias-free"),
        ((w, nn.Parameter(torch.zeros(5)), a, b, 8.0), r"bias has shape \(5,\)"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            SparseLoRALinear(*args)
    with pytest.raises(ValueError, match="base_outliers needs an NF4 base"):
        SparseLoRALinear(w, None, a, b, 8.0, base_outliers={"fraction": 0.01})
