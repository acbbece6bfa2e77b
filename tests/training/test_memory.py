"""Memory accounting against hand-computed byte counts and the bytes of real tensors: the
parameters, gradients, AdamW state, index buffers and dense-gradient probes of built models
after a real optimizer step."""

import pytest
import torch
from torch import nn
from torchtune.models.llama3_2 import lora_llama3_2
from torchtune.modules.peft import LoRALinear

from squash.modules import FFILinear, sparse_lora_linear, swap_lora_linear
from squash.training import (
    adapted_shapes,
    adapter_memory,
    lora_adapter_memory,
    max_rank_within,
    record_dense_grads,
)


def tiny_model(dtype):
    return nn.Sequential(
        # A: 4 x k with k = round(0.1 * 64) = 6 -> 24 values; B dense 32 x 4 = 128.
        sparse_lora_linear(64, 32, rank=4, alpha=8.0, sparsity=0.9, sparse_factor="a", dtype=dtype),
        # A: 8 x round(0.25 * 32) = 8 x 8 = 64; B: 64 x round(0.25 * 8) = 64 x 2 = 128.
        sparse_lora_linear(
            32, 64, rank=8, alpha=16.0, sparsity=0.75, sparse_factor="both", dtype=dtype
        ),  # fmt: skip
        # Dense torchtune LoRA: 4 x 64 + 64 x 4 = 512.
        LoRALinear(64, 64, rank=4, alpha=8.0),
    ).to(dtype)


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def real_bytes(model, amsgrad=False, forward=None):
    """Train the adapters for one AdamW step (the base frozen as torchtune's recipes freeze it,
    by name) and count the bytes of the tensors that exist afterwards. ``forward(model)`` runs
    the model (default: a random batch through a stack of linears)."""
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in f".{name}")
    trainable = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():  # non-zero B so that every factor gets a gradient
        for name, p in model.named_parameters():
            if "lora_b" in name:
                p.normal_()
    opt = torch.optim.AdamW(trainable, amsgrad=amsgrad)
    if forward is None:
        width = next(m for m in model.modules() if hasattr(m, "in_dim")).in_dim

        def forward(model):
            return model(torch.randn(3, width, dtype=trainable[0].dtype))

    forward(model).float().sum().backward()
    opt.step()
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    indices = [b for n, b in model.named_buffers() if n.endswith(".indices")]
    counts = dict(
        trainable_params=sum(p.numel() for p in trainable),
        param_bytes=nbytes(trainable),
        grad_bytes=nbytes([p.grad for p in trainable]),
        optimizer_bytes=nbytes(state),
        index_bytes=nbytes(indices),
    )
    # The transient probe of a mask update: each FFI factor's dense probe and its gradient.
    record_dense_grads(model)
    forward(model).float().sum().backward()
    probes = [getattr(m, "_mask_dense_probe") for m in model.modules() if isinstance(m, FFILinear)]
    counts["mask_update_bytes"] = nbytes(probes) + nbytes([p.grad for p in probes])
    record_dense_grads(model, False)
    return counts


def as_dict(mem):
    return {k: getattr(mem, k) for k in ("trainable_params", "param_bytes", "grad_bytes",
                                         "optimizer_bytes", "index_bytes", "mask_update_bytes")}


@pytest.mark.parametrize("dtype, size", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_hand_computed_counts(dtype, size):
    mem = adapter_memory(tiny_model(dtype))
    elems = 24 + 128 + 64 + 128 + 512  # = 856
    assert mem.trainable_params == elems
    assert mem.param_bytes == mem.grad_bytes == elems * size
    assert mem.optimizer_bytes == 2 * elems * size + 4 * 6  # 2 moments + fp32 step per tensor
    assert mem.index_bytes == (24 + 64 + 128) * 2  # int16
    assert mem.total_bytes == 4 * elems * size + 24 + 432
    # The dense-gradient probe and its gradient: 2 * out * in per FFI factor.
    assert mem.mask_update_bytes == 2 * (4 * 64 + 8 * 32 + 64 * 8) * size
    fp32_moments = adapter_memory(tiny_model(dtype), moment_dtype=torch.float32, amsgrad=True)
    assert fp32_moments.optimizer_bytes == 3 * elems * 4 + 4 * 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_counts_equal_bytes_of_real_tensors(dtype, amsgrad):
    model = tiny_model(dtype)
    predicted = as_dict(adapter_memory(model, amsgrad=amsgrad))
    assert predicted == real_bytes(model, amsgrad=amsgrad)


# The adapted linears of the Llama model below, listed by hand: q (64 -> 64), k (64 -> 32),
# v (64 -> 32), output (64 -> 64), w1 and w3 (64 -> 160), w2 (160 -> 64), in each of 2 layers.
LLAMA_SHAPES = [(64, 64), (64, 32), (64, 32), (64, 64), (64, 160), (160, 64), (64, 160)] * 2


def tiny_llama():
    torch.manual_seed(0)
    return lora_llama3_2(
        ["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True, vocab_size=64,
        num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, max_seq_len=32,
        intermediate_dim=160, lora_rank=12, lora_alpha=24.0,
    )  # fmt: skip


def run_llama(model):
    return model(torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0)))


def test_analytic_counts_equal_real_tensors_of_a_lora_model():
    model = tiny_llama()
    assert sorted(adapted_shapes(model)) == sorted(LLAMA_SHAPES)
    real = real_bytes(model, forward=run_llama)
    assert as_dict(lora_adapter_memory(LLAMA_SHAPES, 12, dtype=torch.float32)) == real


@pytest.mark.parametrize("sparse_factor", ["a", "b", "both"])
def test_analytic_counts_equal_real_tensors_of_a_squash_model(sparse_factor):
    model = swap_lora_linear(tiny_llama(), sparsity=0.85, sparse_factor=sparse_factor)
    real = real_bytes(model, forward=run_llama)
    predicted = lora_adapter_memory(
        LLAMA_SHAPES, 12, sparsity=0.85, sparse_factor=sparse_factor, dtype=torch.float32
    )
    assert as_dict(predicted) == real


def test_max_rank_within_matches_linear_scan():
    shapes = [(64, 64), (64, 160), (160, 64)]
    budget = lora_adapter_memory(shapes, 8).total_bytes
    assert max_rank_within(budget, shapes) == 8
    for sparse_factor in ("a", "b", "both"):
        kw = dict(sparsity=0.9, sparse_factor=sparse_factor)
        scan = max(
            r for r in range(1, 200) if lora_adapter_memory(shapes, r, **kw).total_bytes <= budget
        )
        assert scan < 199 and max_rank_within(budget, shapes, **kw) == scan
        assert scan > 8
    assert max_rank_within(10, shapes) == 0
    assert max_rank_within(budget, shapes, sparsity=0.9, max_rank=5) == 5


def test_max_rank_within_is_not_capped_by_the_layer_width():
    """Both factors 90% sparse: a dense rank-16 budget on 32x32 layers buys a rank above 32, the
    largest min(in, out) (by a linear scan of the cost)."""
    shapes = [(32, 32)] * 4
    budget = lora_adapter_memory(shapes, 16).total_bytes
    kw = dict(sparsity=0.9, sparse_factor="both")
    scan = max(
        r for r in range(1, 400) if lora_adapter_memory(shapes, r, **kw).total_bytes <= budget
    )
    assert 32 < scan < 399
    assert max_rank_within(budget, shapes, **kw) == scan


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(sparse_factor="A"), "sparse_factor"),
        (dict(sparse_factor=None), "sparse_factor"),
        (dict(sparsity=1.0), "sparsity"),
        (dict(sparsity=-0.1), "sparsity"),
        (dict(sparsity=float("nan")), "sparsity"),
        (dict(rank=0), "rank"),
        (dict(rank=2.5), "rank"),
        (dict(shapes=[]), "shapes"),
        (dict(shapes=[(0, 8)]), "in_dim"),
        (dict(shapes=[(8,)]), "shapes"),
        (dict(dtype=torch.int8), "dtype"),
        (dict(moment_dtype=torch.int32), "moment_dtype"),
    ],
)
def test_bad_arguments_are_named(kwargs, name):
    args = dict(shapes=[(8, 8)], rank=2, sparsity=0.5, sparse_factor="a") | kwargs
    with pytest.raises(ValueError, match=name):
        lora_adapter_memory(**args)
    if "rank" not in kwargs:
        args.pop("rank")
        with pytest.raises(ValueError, match=name):
            max_rank_within(1000, **args)


def test_bad_budget_and_cap_are_named():
    with pytest.raises(ValueError, match="budget_bytes"):
        max_rank_within(-1, [(8, 8)])
    with pytest.raises(ValueError, match="max_rank"):
        max_rank_within(100, [(8, 8)], max_rank=0)
    with pytest.raises(ValueError, match="amsgrad"):
        adapter_memory(nn.Linear(2, 2), amsgrad="yes")
