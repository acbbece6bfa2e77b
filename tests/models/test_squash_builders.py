"""squash_* builders against torchtune's own LoRA builders (on the meta device for real sizes)."""

import pytest
import torch
from squash.modules._nf4 import NF4Tensor
from torchtune.models.llama3_2 import lora_llama3_2, lora_llama3_2_1b, lora_llama3_2_3b
from torchtune.models.qwen2_5 import lora_qwen2_5_0_5b, lora_qwen2_5_1_5b_instruct
from torchtune.modules.peft import LoRALinear

from squash.models import (
    squash_llama3_2_1b,
    squash_llama3_2_3b,
    squash_model,
    squash_qwen2_5_0_5b,
    squash_qwen2_5_1_5b,
)
from squash.modules import FFILinear, SparseLoRALinear
from squash.sparsity import fan_in_for

LORA = dict(lora_attn_modules=["q_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
            lora_rank=16, lora_alpha=32.0, lora_dropout=0.05)  # fmt: skip


def adapters(model, cls):
    return {
        n: (m.in_dim, m.out_dim, m.rank, m.alpha) for n, m in model.named_modules()
        if isinstance(m, cls)
    }  # fmt: skip


@pytest.mark.parametrize(
    "squash_builder, torchtune_builder, n_layers",
    [
        (squash_llama3_2_1b, lora_llama3_2_1b, 16),
        (squash_llama3_2_3b, lora_llama3_2_3b, 28),
        (squash_qwen2_5_0_5b, lora_qwen2_5_0_5b, 24),
        (squash_qwen2_5_1_5b, lora_qwen2_5_1_5b_instruct, 28),
    ],
)
def test_named_builders_mirror_torchtune(squash_builder, torchtune_builder, n_layers):
    # The meta device builds the real sizes without allocating them.
    with torch.device("meta"):
        ours = squash_builder(**LORA, quantize_base=False, sparsity=0.8, sparse_factor="b")
        theirs = torchtune_builder(**LORA, quantize_base=False)
    expected = adapters(theirs, LoRALinear)
    assert len(expected) == 6 * n_layers
    assert adapters(ours, SparseLoRALinear) == expected
    assert not any(isinstance(m, LoRALinear) for m in ours.modules())
    for m in ours.modules():
        if isinstance(m, SparseLoRALinear):
            assert isinstance(m.lora_b, FFILinear) and not isinstance(m.lora_a, FFILinear)
            assert m.lora_b.fan_in == fan_in_for(16, 0.8) == 3 and m.dropout.p == 0.05
    # Everything but the adapter factors has the same parameter names and shapes.
    base = {n: p.shape for n, p in theirs.named_parameters() if ".lora_" not in n}
    assert {n: p.shape for n, p in ours.named_parameters() if ".lora_" not in n} == base


def test_tied_output_cannot_take_lora():
    with torch.device("meta"), pytest.raises(ValueError, match="apply_lora_to_output"):
        squash_llama3_2_1b(**(LORA | dict(apply_lora_to_output=True)), quantize_base=False)


def test_squash_model_generic_builder_keeps_nf4_base():
    torch.manual_seed(0)
    model = squash_model(
        lora_llama3_2, sparsity=0.5, sparse_factor="both",
        lora_attn_modules=["q_proj", "v_proj"], vocab_size=64, num_layers=1, num_heads=4,
        num_kv_heads=4, embed_dim=128, max_seq_len=32, intermediate_dim=256, lora_rank=8,
        lora_alpha=16.0, quantize_base=True,
    )  # fmt: skip
    q = model.layers[0].attn.q_proj
    assert isinstance(q, SparseLoRALinear) and isinstance(q.weight, NF4Tensor)
    assert q.lora_a.fan_in == 64 and q.lora_b.fan_in == 4  # half of 128 and of rank 8
    tok = torch.randint(0, 64, (1, 8))
    torch.manual_seed(0)
    reference = lora_llama3_2(
        ["q_proj", "v_proj"], vocab_size=64, num_layers=1, num_heads=4, num_kv_heads=4,
        embed_dim=128, max_seq_len=32, intermediate_dim=256, lora_rank=8, lora_alpha=16.0,
        quantize_base=True,
    )  # fmt: skip
    assert torch.equal(model(tok), reference(tok))  # same seed, same base; B = 0 in both
