"""NF4LoRALinear and NF4Linear: torchtune's LoRALinear and FrozenNF4Linear computed with squash's
NF4 kernel, checked against torchtune's own modules bit for bit (outputs and every gradient),
and shown not to call torchao's ``linear_nf4``."""

import copy

import pytest
import torch
import torchtune.modules.low_precision.nf4_linear as tt_nf4_linear
import torchtune.modules.peft.lora as tt_lora
from torch import nn
from torchtune.modules.low_precision import FrozenNF4Linear
from torchtune.modules.peft import DoRALinear, LoRALinear
from torchtune.training import set_default_dtype

from squash.models.opt import lora_opt
from squash.modules import (
    NF4Linear,
    NF4LoRALinear,
    SparseLoRALinear,
    sparse_lora_linear,
    is_plain_lora,
    swap_lora_linear,
    use_squash_nf4_,
)

DTYPES = [torch.float32, torch.bfloat16]


def _no_torchao(monkeypatch):
    """Make torchao's linear_nf4, as torchtune's modules call it, fail if called."""

    def refuse(*args, **kwargs):
        raise AssertionError("torchao's linear_nf4 was called")

    monkeypatch.setattr(tt_lora, "linear_nf4", refuse)
    monkeypatch.setattr(tt_nf4_linear, "linear_nf4", refuse)


def _lora(dtype, use_bias, dropout=0.0):
    torch.manual_seed(0)
    with set_default_dtype(dtype):
        m = LoRALinear(256, 128, rank=8, alpha=16.0, dropout=dropout, use_bias=use_bias,
                       quantize_base=True)  # fmt: skip
    with torch.no_grad():
        m.lora_b.weight.normal_()  # a non-zero update, so that the adapter path counts
        if use_bias:
            m.bias.normal_()
    return m


def _run(module, x, g, seed=0):
    """Output, input gradient and factor gradients of one forward and backward."""
    x = x.clone().requires_grad_(True)
    torch.manual_seed(seed)  # dropout draws alike
    y = module(x)
    y.backward(g)
    grads = [p.grad.clone() for p in (module.lora_a.weight, module.lora_b.weight)]
    module.zero_grad(set_to_none=True)
    return [y.detach(), x.grad, *grads]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_nf4_lora_linear_equals_torchtune_bit_for_bit(monkeypatch, dtype, use_bias, dropout):
    ref = _lora(dtype, use_bias, dropout)
    ours = use_squash_nf4_(copy.deepcopy(ref))
    assert type(ours) is NF4LoRALinear
    x = torch.randn(3, 5, 256, dtype=dtype)
    g = torch.randn(3, 5, 128, dtype=dtype)
    want = _run(ref, x, g)
    _no_torchao(monkeypatch)
    with pytest.raises(AssertionError, match="linear_nf4 was called"):
        ref(x)  # torchtune's own module does call it
    got = _run(ours, x, g)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    ours.disabled, ref.disabled = True, True
    monkeypatch.undo()
    want_base = ref(x)
    _no_torchao(monkeypatch)
    assert torch.equal(ours(x), want_base)


def test_nf4_lora_linear_without_an_nf4_base_is_lora_linear():
    torch.manual_seed(0)
    ref = LoRALinear(32, 16, rank=4, alpha=8.0, use_bias=True)
    nn.init.normal_(ref.lora_b.weight)
    ours = NF4LoRALinear(32, 16, rank=4, alpha=8.0, use_bias=True)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(4, 32)
    assert torch.equal(ours(x), ref(x))
    assert use_squash_nf4_(ref) is ref and type(ref) is LoRALinear  # nothing to compute in NF4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_nf4_linear_equals_frozen_nf4_linear_bit_for_bit(monkeypatch, dtype, bias):
    torch.manual_seed(0)
    ref = FrozenNF4Linear(256, 64, bias=bias, dtype=dtype)
    if bias:
        with torch.no_grad():
            ref.bias.normal_()
    ours = use_squash_nf4_(copy.deepcopy(ref))
    assert type(ours) is NF4Linear
    x = torch.randn(6, 256, dtype=dtype, requires_grad=True)
    g = torch.randn(6, 64, dtype=dtype)
    y_ref = ref(x)
    y_ref.backward(g)
    gx_ref, x.grad = x.grad, None
    _no_torchao(monkeypatch)
    y = ours(x)
    y.backward(g)
    assert torch.equal(y, y_ref) and torch.equal(x.grad, gx_ref)


def test_use_squash_nf4_keeps_the_parameters_and_hooks_and_leaves_others_alone():
    torch.manual_seed(0)
    q = LoRALinear(256, 64, rank=4, alpha=8.0, quantize_base=True)
    frozen = FrozenNF4Linear(256, 64)
    plain = LoRALinear(256, 64, rank=4, alpha=8.0)
    dora = DoRALinear(256, 64, rank=4, alpha=8.0)
    model = nn.ModuleDict(dict(q=q, frozen=frozen, plain=plain, dora=dora, lin=nn.Linear(4, 4)))
    params = {n: p for n, p in model.named_parameters()}
    calls = []
    handle = q.register_forward_hook(lambda *a: calls.append(1))
    q.eval()
    assert use_squash_nf4_(model) is model
    new_q, new_frozen = model["q"], model["frozen"]
    assert type(new_q) is NF4LoRALinear and type(q) is LoRALinear  # replaced, not changed
    assert new_q.lora_a is q.lora_a and new_q.lora_b is q.lora_b and not new_q.training
    assert (new_q.in_dim, new_q.out_dim, new_q.rank, new_q.alpha) == (256, 64, 4, 8.0)
    new_q(torch.randn(2, 256))
    assert calls == [1]
    handle.remove()  # the handle reaches the replacement's hooks
    new_q(torch.randn(2, 256))
    assert calls == [1]
    assert type(new_frozen) is NF4Linear and new_frozen.weight is frozen.weight
    assert type(plain) is LoRALinear and type(dora) is DoRALinear
    assert type(model["lin"]) is nn.Linear
    assert all(p is params[n] for n, p in model.named_parameters())
    assert is_plain_lora(new_q) and is_plain_lora(q) and is_plain_lora(plain)
    assert not is_plain_lora(dora) and not is_plain_lora(frozen)
    assert not is_plain_lora(sparse_lora_linear(16, 16, 2, 4.0))


def test_qlora_opt_builds_nf4_lora_linear_that_swaps_to_sparse():
    kw = dict(vocab_size=64, num_layers=1, num_heads=2, embed_dim=128, intermediate_dim=256,
              max_seq_len=16, lora_rank=4, lora_alpha=8.0)  # fmt: skip
    model = lora_opt(["q_proj", "v_proj"], True, quantize_base=True, **kw)
    q = model.layers[0].attn.q_proj
    assert type(q) is NF4LoRALinear and q._quantize_base
    assert type(lora_opt(["q_proj"], False, **kw).layers[0].attn.q_proj) is LoRALinear
    weight = q.weight
    swap_lora_linear(model, sparsity=0.5)
    new_q = model.layers[0].attn.q_proj
    assert isinstance(new_q, SparseLoRALinear) and new_q.weight is weight
