"""The exports of a checkpoint computed from a gathered full state dict (the FSDP2 recipe) equal
those computed from the model itself (the single-device recipe)."""

import pytest
import torch

from squash.models.opt import qlora_opt_tiny, squash_opt_tiny
from squash.modules._nf4 import NF4Tensor
from squash.training import checkpoint as ckpt

ATTN = ["q_proj", "k_proj", "v_proj", "output_proj"]


def _trained(model):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _full(model):
    """What torchtune's gather_cpu_state_dict returns: NF4 weights dequantized."""
    out = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, t in list(module._parameters.items()) + list(module._buffers.items()):
            if t is not None:
                out[prefix + name] = t.get_original_weight() if isinstance(t, NF4Tensor) else t.detach()
    return out


@pytest.mark.parametrize("build", [
    lambda: squash_opt_tiny(ATTN, True, lora_rank=8, lora_alpha=16, quantize_base=True,
                            sparsity=0.9, sparse_factor="both"),
    lambda: squash_opt_tiny(ATTN, True, lora_rank=8, lora_alpha=16, sparsity=0.9,
                            sparse_factor="a"),
    lambda: qlora_opt_tiny(ATTN, True, lora_rank=8, lora_alpha=16),
])  # fmt: skip
def test_exports_from_the_full_state_dict_equal_those_from_the_model(build):
    torch.manual_seed(0)
    model = _trained(build())
    layout = ckpt.adapter_layout(model)
    full = _full(model)
    dense_model = ckpt.dense_adapter_state_dict(model)
    dense_full = ckpt.dense_adapter_from_full(full, layout)
    assert sorted(dense_model) == sorted(dense_full)
    for key in dense_model:
        assert torch.equal(dense_model[key], dense_full[key]), key
    merged_model = ckpt.merged_state_dict(model, torch.bfloat16)
    merged_full = ckpt.merged_from_full(full, layout, torch.bfloat16)
    assert sorted(merged_model) == sorted(merged_full)
    for key in merged_model:
        assert merged_full[key].dtype == merged_model[key].dtype
        torch.testing.assert_close(merged_full[key], merged_model[key], rtol=0, atol=0)
    # the merge is not a no-op
    base = full["layers.0.attn.q_proj.weight"].to(torch.bfloat16)
    assert not torch.equal(merged_full["layers.0.attn.q_proj.weight"], base)


def test_exports_are_keyed_as_the_state_dict_under_activation_checkpointing():
    """checkpoint_wrapper renames modules (``layers.0._checkpoint_wrapped_module.attn``) but not
    state-dict keys; the exports must follow the state dict, or the merge silently does nothing."""
    from torchtune import modules, training

    from squash.modules import adapter_state_dict

    torch.manual_seed(0)
    model = _trained(squash_opt_tiny(ATTN, True, lora_rank=8, lora_alpha=16, quantize_base=True,
                                     sparsity=0.9))  # fmt: skip
    plain_merged = ckpt.merged_state_dict(model, torch.float32)
    plain_adapter = adapter_state_dict(model)
    training.set_activation_checkpointing(
        model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
    )
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_modules())
    keys = set(model.state_dict())
    assert set(adapter_state_dict(model)) == set(plain_adapter) <= keys
    assert set(ckpt.dense_adapter_state_dict(model)) <= keys | {
        k.replace(".values", ".weight") for k in keys
    }
    merged = ckpt.merged_state_dict(model, torch.float32)
    assert sorted(merged) == sorted(plain_merged)
    for key in merged:
        assert torch.equal(merged[key], plain_merged[key]), key
