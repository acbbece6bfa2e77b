"""Swapping torchtune's LoRALinear for SparseLoRALinear in tiny Llama 3.2 / Qwen 2 models, and
torchtune's adapter utilities on the result."""

import pytest
import torch
import torch.nn.functional as F
from torchtune.models.llama3_2 import lora_llama3_2
from torchtune.models.qwen2 import lora_qwen2
from torchtune.modules.peft import (
    LoRALinear,
    disable_adapter,
    get_adapter_params,
    get_adapter_state_dict,
    set_trainable_params,
    validate_missing_and_unexpected_for_lora,
)

from squash.modules import (
    FFILinear,
    SparseLoRALinear,
    adapter_state_dict,
    get_adapter_buffers,
    svd_initialize,
    swap_lora_linear,
)

VOCAB = 256
LORA_ATTN = ["q_proj", "v_proj", "output_proj"]


def tiny_llama(quantize_base=True, seed=0, **kwargs):
    """Llama 3.2 layout; every adapted linear is 128x128 or 128x256 (NF4 needs 16384 | numel)."""
    torch.manual_seed(seed)
    args = dict(
        lora_attn_modules=LORA_ATTN, apply_lora_to_mlp=True, vocab_size=VOCAB, num_layers=2,
        num_heads=4, num_kv_heads=4, embed_dim=128, max_seq_len=64, intermediate_dim=256,
        lora_rank=4, lora_alpha=8.0, quantize_base=quantize_base,
    ) | kwargs  # fmt: skip
    return lora_llama3_2(**args)


def tokens(seed=0):
    return torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(seed))


def loss_of(model, tok):
    logits = model(tok[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tok[:, 1:].reshape(-1))


@pytest.mark.parametrize("quantize_base", [True, False])
def test_swap_keeps_logits_base_tensors_and_settings(quantize_base):
    model = tiny_llama(quantize_base, lora_dropout=0.1)
    model.eval()
    tok = tokens()
    before = model(tok)
    old = {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert len(old) == 2 * 6  # q, v, output_proj, w1, w2, w3 per layer
    swap_lora_linear(model, sparsity=0.9, sparse_factor="a")
    new = {n: m for n, m in model.named_modules() if isinstance(m, SparseLoRALinear)}
    assert set(new) == set(old) and not any(isinstance(m, LoRALinear) for m in model.modules())
    for name, m in new.items():
        o = old[name]
        assert m.weight is o.weight and m.bias is o.bias  # the very same base parameters
        assert (m.rank, m.alpha, m.use_bias, m._quantize_base) == (4, 8.0, False, quantize_base)
        assert m.dropout.p == 0.1 and not m.training and m.disabled is False
        assert isinstance(m.lora_a, FFILinear) and m.lora_a.fan_in == round(0.1 * m.in_dim)
    assert torch.equal(model(tok), before)  # B = 0: the output is the base output


def test_swap_qwen2_keeps_biases():
    torch.manual_seed(0)
    model = lora_qwen2(
        ["q_proj", "k_proj", "v_proj"], vocab_size=VOCAB, num_layers=1, num_heads=4,
        num_kv_heads=4, embed_dim=128, intermediate_dim=256, max_seq_len=64, lora_rank=4,
        lora_alpha=8.0, quantize_base=True, tie_word_embeddings=True,
    )  # fmt: skip
    q = model.layers[0].attn.q_proj
    assert q.use_bias and q.bias is not None
    tok = tokens()
    before = model(tok)
    swap_lora_linear(model, sparse_factor="both")
    new_q = model.layers[0].attn.q_proj
    assert isinstance(new_q, SparseLoRALinear) and new_q.bias is q.bias and new_q.use_bias
    assert torch.equal(model(tok), before)


def test_swap_rejects_dora():
    model = tiny_llama(False, use_dora=True)
    with pytest.raises(ValueError, match="DoRALinear"):
        swap_lora_linear(model)


@pytest.mark.parametrize(
    "kwargs, name",
    [(dict(sparsity=1.0), "sparsity"), (dict(sparse_factor="A"), "sparse_factor"),
     (dict(init="SVD"), "init")],
)  # fmt: skip
def test_swap_checks_arguments_before_swapping(kwargs, name):
    for model in (tiny_llama(False), torch.nn.Linear(4, 4)):  # with and without LoRA layers
        with pytest.raises(ValueError, match=name):
            swap_lora_linear(model, **kwargs)
        assert not any(isinstance(m, SparseLoRALinear) for m in model.modules())


def test_torchtune_meta_device_init_finds_sparse_adapters():
    """torchtune's distributed LoRA recipe builds on the meta device, then materialises each
    adapter with ``to_empty`` + ``initialize_parameters`` and loads the base; the same loop
    (with SparseLoRALinear among the adapter classes) gives a working squash model."""
    base_sd = swap_lora_linear(tiny_llama(False), sparse_factor="both").state_dict()
    base_sd = {k: v for k, v in base_sd.items() if ".lora_" not in k}
    with torch.device("meta"):
        model = swap_lora_linear(tiny_llama(False), sparse_factor="both")
    for m in model.modules():
        if isinstance(m, (LoRALinear, SparseLoRALinear)):
            m.to_empty(device="cpu")
            m.initialize_parameters()
        if hasattr(m, "rope_init"):
            m.rope_init()
    model.load_state_dict(base_sd, strict=False, assign=True)
    for m in model.modules():
        if isinstance(m, SparseLoRALinear):
            validate = m.lora_a.indices.long()
            assert bool((validate[:, 1:] > validate[:, :-1]).all())
            assert not m.lora_b.values.any() and m.lora_a.values.abs().min() > 0
    reference = tiny_llama(False)  # same base, no adapters' contribution (B = 0)
    reference.load_state_dict(base_sd, strict=False)
    tok = tokens()
    torch.testing.assert_close(model(tok), reference(tok))


@pytest.mark.parametrize("sparse_factor", ["a", "b", "both"])
def test_torchtune_adapter_selection_and_training(sparse_factor):
    model = swap_lora_linear(tiny_llama(), sparse_factor=sparse_factor)
    params = get_adapter_params(model)
    # Independently: the trainable adapter tensors are the lora_* state-dict entries that are
    # not index buffers.
    keys = model.state_dict().keys()
    expected = {k for k in keys if ".lora_" in k and not k.endswith(".indices")}
    assert set(params) == expected and len(expected) == 24
    assert set(get_adapter_buffers(model)) == {k for k in keys if k.endswith(".indices")}
    set_trainable_params(model, params)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == expected

    tok = tokens()
    base_logits = model(tok)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(5):
        loss = loss_of(model, tok)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert all(b < a for a, b in zip(losses[:-1], losses[1:], strict=True)), losses  # every step
    # torchtune's disable_adapter turns the adapters off: the base output again.
    with disable_adapter(model):
        assert torch.equal(model(tok), base_logits)


def test_adapter_state_dict_round_trip_and_corruption():
    model = swap_lora_linear(tiny_llama(), sparse_factor="a")
    set_trainable_params(model, get_adapter_params(model))
    tok = tokens()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        loss = loss_of(model, tok)
        opt.zero_grad()
        loss.backward()
        opt.step()
    # torchtune's key filter keeps the indices too, and matches squash's explicit selection.
    sd = get_adapter_state_dict(model.state_dict())
    ours = adapter_state_dict(model)
    assert set(sd) == set(ours) and all(torch.equal(sd[k], ours[k]) for k in sd)
    assert sum(k.endswith(".indices") for k in sd) == 12

    gen = torch.Generator().manual_seed(1)  # same base, other random adapters
    fresh = swap_lora_linear(tiny_llama(), sparse_factor="a", generator=gen)
    key = "layers.0.attn.q_proj.lora_a.indices"
    assert not torch.equal(fresh.state_dict()[key], sd[key])
    missing, unexpected = fresh.load_state_dict(sd, strict=False)
    validate_missing_and_unexpected_for_lora(
        LORA_ATTN, True, False, lora_missing=missing, lora_unexpected=unexpected
    )
    assert torch.equal(fresh.state_dict()[key], sd[key])
    assert torch.equal(fresh(tok), model(tok))

    bad = dict(sd)
    bad[key] = sd[key].flip(1)
    with pytest.raises(ValueError, match=f"not sorted.*checkpoint load of {key}"):
        fresh.load_state_dict(bad, strict=False)
    bad[key] = sd[key].clone()
    bad[key][0, 0] = 128
    with pytest.raises(ValueError, match=f"out of range.*checkpoint load of {key}"):
        fresh.load_state_dict(bad, strict=False)


def test_svd_swap_and_svd_initialize_keep_logits():
    model = tiny_llama(quantize_base=False)
    tok = tokens()
    before = model(tok)
    dense = {k: v.clone() for k, v in model.state_dict().items()}
    swap_lora_linear(model, init="svd")
    after = model(tok)
    assert float((after - before).norm() / before.norm()) < 1e-5
    q = model.layers[0].attn.q_proj
    assert q.lora_b.weight.abs().max() > 0 and not torch.equal(
        q.weight, dense["layers.0.attn.q_proj.weight"]
    )

    # QLoRA: svd_initialize from the unquantized checkpoint beats QLoRA's NF4(W) base.
    qmodel = swap_lora_linear(tiny_llama(quantize_base=True))
    qlora_err = float((qmodel(tok) - before).norm() / before.norm())
    assert len(svd_initialize(qmodel, dense)) == 12
    svd_err = float((qmodel(tok) - before).norm() / before.norm())
    assert svd_err < qlora_err, (svd_err, qlora_err)
