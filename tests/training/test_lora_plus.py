"""LoRA+ (``lora_plus_lr_ratio``): B's factors at ``ratio x lr``, checked against a hand-computed
SGD step, and a ratio of 1 equal bit for bit to the single-group optimizer."""

import pytest
import torch
from torch import nn
from torchtune.modules.peft import LoRALinear, get_adapter_params, set_trainable_params

from squash.config.keys import ConfigKeyError
from squash.modules import sparse_lora_linear
from squash.training.steps import optimizer_params


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(
        LoRALinear(8, 6, rank=2, alpha=4.0),
        sparse_lora_linear(6, 4, rank=3, alpha=6.0, sparsity=0.5, sparse_factor="both"),
    )
    for m in model:
        nn.init.normal_(m.lora_b.weight if hasattr(m.lora_b, "weight") else m.lora_b.values)
    set_trainable_params(model, get_adapter_params(model))
    return model


def _grads(model: nn.Module) -> dict:
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    model(x).square().sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_sgd_step_moves_b_ratio_times_faster():
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    grads = _grads(model)
    opt = torch.optim.SGD(optimizer_params(model, 4.0, 0.1), lr=0.1)
    opt.step()
    assert any(".lora_b." in f".{n}" for n in before) and any(".lora_a." in f".{n}" for n in before)
    for n, p in model.named_parameters():
        if n in before:
            lr = 0.4 if ".lora_b." in f".{n}" else 0.1
            # SGD without momentum: p - lr * grad, as torch computes it (add with alpha)
            assert torch.equal(p.detach(), before[n].add(grads[n], alpha=-lr)), n


def test_ratio_one_equals_one_group_bit_for_bit():
    runs = []
    for ratio in (None, 1.0):
        model = _model()
        opt = torch.optim.AdamW(optimizer_params(model, ratio, 1e-2), lr=1e-2)
        for _ in range(3):
            _grads(model)
            opt.step()
            opt.zero_grad()
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_no_ratio_is_model_parameters():
    model = _model()
    assert list(optimizer_params(model, None, 1e-3)) == list(model.parameters())


@pytest.mark.parametrize("ratio", [0, -2.0, float("inf"), True, "16"])
def test_bad_ratio_names_the_key(ratio):
    with pytest.raises(ConfigKeyError, match="lora_plus_lr_ratio"):
        optimizer_params(_model(), ratio, 1e-3)


def test_model_without_b_refused():
    with pytest.raises(ConfigKeyError, match="no lora_b"):
        optimizer_params(nn.Linear(3, 3), 16.0, 1e-3)
