"""squash_* builders against torchtune's own LoRA builders (on the meta device for real sizes)."""

import pytest
import torch
from squash.nf4 import NF4Tensor
from torchtune.models.llama3_2 import lora_llama3_2, lora_llama3_2_1b, lora_llama3_2_3b
from torchtune.models.qwen2_5 import lora_qwen2_5_0_5b, lora_qwen2_5_1_5b_instruct
from torchtune.modules.peft import LoRALinear, disable_adapter

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


TINY_LLAMA = dict(lora_attn_modules=["q_proj", "v_proj"], vocab_size=64, num_layers=1,
                  num_heads=4, num_kv_heads=4, embed_dim=128, max_seq_len=32,
                  intermediate_dim=256, lora_rank=8, lora_alpha=16.0)  # fmt: skip


def test_squash_model_with_nonzero_factors_equals_torchtune_lora_with_dense_factors():
    """NF4 base, non-zero FFI factors. Reference: torchtune's QLoRA model built from the same seed
    (the same NF4 base) whose LoRALinear factors are the squash factors scattered to dense with
    a Python loop."""
    torch.manual_seed(0)
    model = squash_model(lora_llama3_2, sparsity=0.5, sparse_factor="both", quantize_base=True,
                         **TINY_LLAMA)  # fmt: skip
    q = model.layers[0].attn.q_proj
    assert isinstance(q, SparseLoRALinear) and isinstance(q.weight, NF4Tensor)
    assert q.lora_a.fan_in == 64 and q.lora_b.fan_in == 4  # half of 128 and of rank 8
    torch.manual_seed(0)
    reference = lora_llama3_2(quantize_base=True, **TINY_LLAMA)
    g = torch.Generator().manual_seed(1)
    refs = dict(reference.named_modules())
    for name, m in model.named_modules():
        if not isinstance(m, SparseLoRALinear):
            continue
        with torch.no_grad():
            for factor in (m.lora_a, m.lora_b):
                factor.values.copy_(torch.randn(factor.values.shape, generator=g) * 0.1)
            for factor, ref in ((m.lora_a, refs[name].lora_a), (m.lora_b, refs[name].lora_b)):
                dense = torch.zeros_like(ref.weight)
                for o, (cols, vals) in enumerate(zip(factor.indices.tolist(),
                                                     factor.values.tolist())):  # fmt: skip
                    for c, v in zip(cols, vals, strict=True):
                        dense[o, c] = v
                ref.weight.copy_(dense)
    tok = torch.randint(0, 64, (2, 8), generator=g)
    with torch.no_grad():
        ours = model(tok)
        with disable_adapter(model):
            assert (ours - model(tok)).abs().max() > 1e-3  # the adapters show
        torch.testing.assert_close(ours, reference(tok), atol=1e-5, rtol=1e-5)


def test_squash_model_passes_init_and_generator():
    torch.manual_seed(0)
    lora = lora_llama3_2(quantize_base=False, **TINY_LLAMA)
    weights = {n: m.weight.detach().clone() for n, m in lora.named_modules()
               if isinstance(m, LoRALinear)}  # fmt: skip

    def build(seed, init="lora"):
        torch.manual_seed(0)
        return squash_model(lora_llama3_2, sparsity=0.75, sparse_factor="both", init=init,
                            generator=torch.Generator().manual_seed(seed), quantize_base=False,
                            **TINY_LLAMA)  # fmt: skip

    def patterns(model):
        return [m.lora_a.indices.clone() for m in model.modules()
                if isinstance(m, SparseLoRALinear)]  # fmt: skip

    a, b, c = patterns(build(1)), patterns(build(1)), patterns(build(2))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))
    svd = build(1, init="svd")
    for name, m in svd.named_modules():
        if isinstance(m, SparseLoRALinear):
            assert m.lora_b.values.abs().max() > 0  # factored: B is not zero
            # By construction the svd init keeps W = base + scaling * B @ A.
            torch.testing.assert_close(m.merged_weight(), weights[name], atol=2e-5, rtol=1e-5)


def test_named_builders_pass_every_argument(monkeypatch):
    import inspect

    import squash.models._squash_builders as builders

    inits, build = [], builders.sparse_lora_linear
    monkeypatch.setattr(builders, "sparse_lora_linear",
                        lambda *a, **kw: inits.append(kw["init"]) or build(*a, **kw))  # fmt: skip

    # each sized builder: its family's one plain function with only the size bound
    for builder, template, size in (
        (squash_llama3_2_1b, builders.squash_llama3_2_sized, "1b"),
        (squash_llama3_2_3b, builders.squash_llama3_2_sized, "3b"),
        (squash_qwen2_5_0_5b, builders.squash_qwen2_5_sized, "0_5b"),
        (squash_qwen2_5_1_5b, builders.squash_qwen2_5_sized, "1_5b_instruct"),
    ):
        assert inspect.isfunction(template) and builder.func is template
        assert builder.args == (size,) and not builder.keywords
        assert list(inspect.signature(builder).parameters) == list(
            inspect.signature(template).parameters)[1:]  # fmt: skip
        assert "init" in inspect.signature(builder).parameters
    with torch.device("meta"):
        model = squash_qwen2_5_0_5b(["k_proj"], lora_rank=4, lora_alpha=2.0, lora_dropout=0.5,
                                    quantize_base=False, sparsity=0.5, sparse_factor="b",
                                    init="svd")  # fmt: skip
    k = model.layers[0].attn.k_proj
    assert (k.rank, k.alpha, k.dropout.p, k.sparse_factor) == (4, 2.0, 0.5, "b")
    assert k.lora_b.fan_in == fan_in_for(4, 0.5) == 2  # the default 0.9 keeps 1
    assert inits == ["svd"] * 24  # one k_proj a layer (nothing to factor on meta)
    for bad, name in [(dict(sparsity=1.5), "sparsity"), (dict(sparse_factor="B"), "sparse_factor"),
                      (dict(init="SVD"), "init")]:  # fmt: skip
        with pytest.raises(ValueError, match=name):
            squash_model(lora_llama3_2, **TINY_LLAMA, **bad)
