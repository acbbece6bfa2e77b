"""Memory accounting against hand-computed byte counts and the optimizer's real state."""

import pytest
import torch
from torch import nn
from torchtune.models.llama3_2 import lora_llama3_2
from torchtune.modules.peft import LoRALinear, get_adapter_params, set_trainable_params

from squash.modules import SparseLoRALinear, swap_lora_linear
from squash.training import (
    adapted_shapes,
    adapter_memory,
    lora_adapter_memory,
    max_rank_within,
)


def tiny_model(dtype):
    return nn.Sequential(
        # A: 4 x k with k = round(0.1 * 64) = 6 -> 24 values; B dense 32 x 4 = 128.
        SparseLoRALinear(64, 32, rank=4, alpha=8.0, sparsity=0.9, sparse_factor="a", dtype=dtype),
        # A: 8 x round(0.25 * 32) = 8 x 8 = 64; B: 64 x round(0.25 * 8) = 64 x 2 = 128.
        SparseLoRALinear(
            32, 64, rank=8, alpha=16.0, sparsity=0.75, sparse_factor="both", dtype=dtype
        ),  # fmt: skip
        # Dense torchtune LoRA: 4 x 64 + 64 x 4 = 512.
        LoRALinear(64, 64, rank=4, alpha=8.0),
    ).to(dtype)


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


def test_counts_match_real_gradients_and_adamw_state():
    model = tiny_model(torch.float32)
    mem = adapter_memory(model)
    set_trainable_params(model, get_adapter_params(model))
    for m in model:  # make B non-zero so that every factor gets a gradient
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_b" in n:
                    p.normal_()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model(torch.randn(3, 64)).sum().backward()
    opt.step()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert sum(g.numel() * g.element_size() for g in grads) == mem.grad_bytes
    state = [t for s in opt.state.values() for t in s.values()]
    assert sum(t.numel() * t.element_size() for t in state) == mem.optimizer_bytes
    indices = [b for n, b in model.named_buffers() if n.endswith("indices")]
    assert sum(b.numel() * b.element_size() for b in indices) == mem.index_bytes


@pytest.mark.parametrize("sparse_factor", ["a", "b", "both"])
def test_analytic_counts_match_a_built_model(sparse_factor):
    torch.manual_seed(0)
    model = lora_llama3_2(
        ["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True, vocab_size=64,
        num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, max_seq_len=32,
        intermediate_dim=160, lora_rank=12, lora_alpha=24.0,
    )  # fmt: skip
    shapes = adapted_shapes(model)
    assert sorted(set(shapes)) == [(64, 32), (64, 64), (64, 160), (160, 64)]
    assert adapter_memory(model) == lora_adapter_memory(shapes, 12, dtype=torch.float32)
    swap_lora_linear(model, sparsity=0.85, sparse_factor=sparse_factor)
    assert adapted_shapes(model) == shapes
    assert adapter_memory(model) == lora_adapter_memory(
        shapes, 12, sparsity=0.85, sparse_factor=sparse_factor, dtype=torch.float32
    )


def test_max_rank_within_matches_linear_scan():
    shapes = [(64, 64), (64, 160), (160, 64)]
    budget = lora_adapter_memory(shapes, 8).total_bytes
    assert max_rank_within(budget, shapes) == 8
    for sparse_factor in ("a", "b", "both"):
        kw = dict(sparsity=0.9, sparse_factor=sparse_factor)
        scan = max(
            r for r in range(1, 65) if lora_adapter_memory(shapes, r, **kw).total_bytes <= budget
        )
        assert max_rank_within(budget, shapes, **kw) == scan
        assert scan > 8
    assert max_rank_within(10, shapes) == 0
