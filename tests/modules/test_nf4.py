"""NF4 for every shape: block sizes chosen per weight, checked against hand-computed divisors and
torchao's own ``to_nf4`` with those sizes (bit-for-bit)."""

import copy

import pytest
import torch
from torch import nn
from torchtune.models.llama3_2._component_builders import lora_llama3_2

from squash.modules import NF4Linear, NF4LoRALinear, SparseLoRALinear, sparse_lora_linear
from squash.nf4 import (
    NF4Tensor,
    clone_nf4,
    nf4_block_sizes,
    nf4_bytes,
    quantize_base_,
    quantize_nf4,
    to_nf4,
)
from squash.training.memory import base_memory

# shape -> (block_size, scaler_block_size), by hand: numel / 64 blocks, then the largest divisor
# of the number of blocks that is at most 256.
HAND = {
    (576, 576): (64, 216),  # 5184 blocks = 2^6 * 3^4; 216 = 2^3 * 3^3 (256, 243 do not divide)
    (192, 576): (64, 216),  # 1728 blocks = 2^6 * 3^3
    (1536, 576): (64, 256),  # 13824 blocks = 2^9 * 3^3: torchao's defaults
    (576, 1536): (64, 256),
    (128, 128): (64, 256),  # 256 blocks
    (64, 100): (64, 100),  # 100 blocks
    (7, 64): (64, 7),  # 7 blocks: a prime number of them
    (3, 96): (32, 9),  # 288 elements: 64 does not divide, 32 does (9 blocks)
}


@pytest.mark.parametrize("shape", list(HAND))
def test_block_sizes_are_the_hand_computed_divisors(shape):
    assert nf4_block_sizes("w", shape) == HAND[shape]


@pytest.mark.parametrize("shape", list(HAND))
def test_quantize_nf4_equals_torchao_with_the_chosen_sizes(shape):
    block, scaler = HAND[shape]
    w = torch.randn(shape)
    q = quantize_nf4(w, "w")
    ref = to_nf4(w, block, scaler)
    assert (q.block_size, q.scaler_block_size) == (block, scaler)
    assert torch.equal(q.get_original_weight(), ref.get_original_weight())
    assert torch.equal(q.quantized_data, ref.quantized_data)
    assert torch.equal(q.quantized_scalers, ref.quantized_scalers)


def test_torchao_defaults_refuse_what_the_chosen_sizes_take():
    with pytest.raises(AssertionError, match="divisible by scaler block size"):
        to_nf4(torch.randn(576, 576))


@pytest.mark.parametrize("shape", [(30, 100), (5, 7), (0, 64), (2, 4, 64)])
def test_shapes_no_block_size_divides_are_named(shape):
    with pytest.raises(ValueError, match=rf"layer\.w.*{tuple(shape)}.*block_size=64"):
        nf4_block_sizes("layer.w", shape)


def test_given_block_sizes_are_used_as_given():
    w = torch.randn(128, 128)
    q = quantize_nf4(w, "w", block_size=32, scaler_block_size=128)
    assert torch.equal(q.get_original_weight(), to_nf4(w, 32, 128).get_original_weight())
    with pytest.raises(ValueError, match="scaler_block_size=256"):
        quantize_nf4(torch.randn(576, 576), "w", block_size=64)


def test_clone_deepcopy_and_load_keep_the_block_sizes():
    """torchao's and torchtune's NF4 clone re-quantize with the default sizes (and fail on
    576x576); squash's clone_nf4 copies the quantized parts, and squash's NF4 modules deep-copy
    their base with it. Loading a plain tensor into an NF4 base re-quantizes it with the
    target's sizes (squash's pre-hook, as torchao's copy_ does)."""
    w = torch.randn(576, 576)
    ref = to_nf4(w, 64, 216).get_original_weight()
    q = quantize_nf4(w, "w")
    m = sparse_lora_linear(576, 576, 4, 8.0, quantize_base=True, weight=w.clone())
    frozen = NF4Linear(576, 576, bias=False, device="meta", block_size=64, scaler_block_size=216)
    frozen.weight = nn.Parameter(q, requires_grad=False)
    in_a_model = copy.deepcopy(nn.ModuleList([frozen]))[0].weight
    copies = (clone_nf4(q), copy.deepcopy(m).weight, in_a_model)
    for c in copies:
        assert isinstance(c, NF4Tensor) and (c.block_size, c.scaler_block_size) == (64, 216)
        assert c is not q and c is not m.weight and c.quantized_data is not q.quantized_data
        assert torch.equal(c.get_original_weight(), ref)
    copied = copy.deepcopy(m)
    assert type(copied) is SparseLoRALinear and not copied.weight.requires_grad
    assert torch.equal(copied.lora_a.indices, m.lora_a.indices)
    m = sparse_lora_linear(576, 576, 4, 8.0, quantize_base=True)
    m.load_state_dict({**m.state_dict(), "weight": w})
    assert (m.weight.block_size, m.weight.scaler_block_size) == (64, 216)
    assert torch.equal(m.weight.get_original_weight(), ref)


def test_sparse_lora_quantizes_576_with_the_chosen_sizes():
    w = torch.randn(192, 576)
    m = sparse_lora_linear(576, 192, 4, 8.0, quantize_base=True, weight=w.clone())
    assert (m.weight.block_size, m.weight.scaler_block_size) == (64, 216)
    assert torch.equal(m.weight.get_original_weight(), to_nf4(w, 64, 216).get_original_weight())
    x = torch.randn(3, 576)
    torch.testing.assert_close(m(x), x @ to_nf4(w, 64, 216).get_original_weight().T)


def test_nf4_bytes_hand_computed():
    # (576, 576) fp32 at (64, 216): 331776 / 2 code bytes + 5184 int8 scalers + 24 fp32 factors
    # + 1 fp32 mean + 16 fp32 code book entries.
    assert nf4_bytes(quantize_nf4(torch.randn(576, 576), "w")) == 165888 + 5184 + 96 + 4 + 64
    # (1536, 576) bf16 at (64, 256): 442368 + 13824 + 54 * 2 + 2 + 32
    q = quantize_nf4(torch.randn(1536, 576, dtype=torch.bfloat16), "w")
    assert nf4_bytes(q) == 442368 + 13824 + 108 + 2 + 32


def _tiny_lora(**kw):
    # embed 192: q/output 192x192 (576 blocks, scaler 192), k/v 64x192 (192 blocks), MLP 384x192
    # (1152 blocks, scaler 192): torchtune's default sizes refuse every one of them.
    return lora_llama3_2(
        vocab_size=64, num_layers=1, num_heads=3, num_kv_heads=1, embed_dim=192, max_seq_len=16,
        intermediate_dim=384, lora_rank=4, lora_alpha=8.0, scale_factor=1, **kw,
    )  # fmt: skip


def test_quantize_base_of_a_torchtune_model_torchtune_refuses():
    with pytest.raises(AssertionError):
        _tiny_lora(lora_attn_modules=["q_proj", "v_proj"], quantize_base=True)
    torch.manual_seed(1)
    model = _tiny_lora(lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_mlp=False)
    dense = copy.deepcopy(model)
    quantize_base_(model)
    attn = model.layers[0].attn
    expected = {
        "attn.q_proj": (NF4LoRALinear, (64, 192)),
        "attn.v_proj": (NF4LoRALinear, (64, 192)),
        "attn.k_proj": (NF4Linear, (64, 192)),
        "attn.output_proj": (NF4Linear, (64, 192)),
        "mlp.w1": (NF4Linear, (64, 192)),
        "mlp.w2": (NF4Linear, (64, 192)),
        "mlp.w3": (NF4Linear, (64, 192)),
    }
    for name, (cls, sizes) in expected.items():
        mod, ref = model.layers[0].get_submodule(name), dense.layers[0].get_submodule(name)
        assert type(mod) is cls, name
        assert (mod.weight.block_size, mod.weight.scaler_block_size) == sizes, name
        want = to_nf4(ref.weight.detach(), *sizes).get_original_weight()
        assert torch.equal(mod.weight.get_original_weight(), want), name
        ref.weight.data.copy_(want)  # the dense reference holds the dequantized bases
    assert attn.q_proj._quantize_base and not isinstance(attn.q_proj.lora_a.weight, NF4Tensor)
    tokens = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), dense(tokens), atol=1e-5, rtol=1e-5)
    # memory: the NF4 bases at their real size, the embeddings and norms dense (hand-summed)
    nf4 = sum(nf4_bytes(model.layers[0].get_submodule(n).weight) for n in expected)
    dense_bytes = 64 * 192 * 4 + 3 * 192 * 4  # tied embedding; sa_norm, mlp_norm, final norm
    rope = sum(b.numel() * b.element_size() for b in model.buffers())
    assert base_memory(model) == nf4 + dense_bytes + rope
