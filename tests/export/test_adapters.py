"""squash.export.adapters: the exports of a checkpoint from a gathered full state dict (the FSDP2
recipe) equal those from ``model.state_dict()`` (the single-device recipes), and both equal the
adapter modules' own dense factors and merged weights."""

import pytest
import torch

from squash.models.opt import qlora_opt_tiny, squash_opt_tiny
from squash.nf4 import NF4Tensor
from squash.modules import get_adapter_modules
from squash.export import adapters

ATTN = ["q_proj", "k_proj", "v_proj", "output_proj"]


def _trained(model):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _by_hand(factor):
    """A factor's dense weight: FFI values put at their indices one by one."""
    if not hasattr(factor, "indices"):
        return factor.weight.detach()
    w = torch.zeros(factor.out_features, factor.in_features, dtype=factor.values.dtype)
    for o, (row_idx, row_val) in enumerate(zip(factor.indices.tolist(), factor.values.tolist())):
        for c, v in zip(row_idx, row_val, strict=True):
            w[o, c] = v
    return w


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
    layout = adapters.adapter_layout(model)
    full = _full(model)
    dense_model = adapters.dense_adapter(model.state_dict(), layout)
    dense_full = adapters.dense_adapter(full, layout)
    assert sorted(dense_model) == sorted(dense_full)
    for key in dense_model:
        assert torch.equal(dense_model[key], dense_full[key]), key
    merged_model = adapters.merged_weights(model.state_dict(), layout, torch.bfloat16)
    merged_full = adapters.merged_weights(full, layout, torch.bfloat16)
    assert sorted(merged_model) == sorted(merged_full)
    for key in merged_model:
        assert merged_full[key].dtype == merged_model[key].dtype
        torch.testing.assert_close(merged_full[key], merged_model[key], rtol=0, atol=0)
    # against the modules' own tensors: each FFI factor scattered to dense by a Python loop,
    # and W + (alpha / rank) B A by hand
    for name, module in get_adapter_modules(model).items():
        a, b = _by_hand(module.lora_a), _by_hand(module.lora_b)
        base = module.weight
        base = base.get_original_weight() if isinstance(base, NF4Tensor) else base
        want = base.float() + (module.alpha / module.rank) * (b.float() @ a.float())
        assert torch.equal(dense_full[f"{name}.lora_a.weight"], a), name
        assert torch.equal(dense_full[f"{name}.lora_b.weight"], b), name
        torch.testing.assert_close(merged_full[f"{name}.weight"], want.to(torch.bfloat16))
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
    plain_merged = adapters.merged_weights(
        model.state_dict(), adapters.adapter_layout(model), torch.float32
    )
    plain_adapter = adapter_state_dict(model)
    training.set_activation_checkpointing(
        model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
    )
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_modules())
    keys = set(model.state_dict())
    assert set(adapter_state_dict(model)) == set(plain_adapter) <= keys
    layout = adapters.adapter_layout(model)
    assert set(adapters.dense_adapter(model.state_dict(), layout)) <= keys | {
        k.replace(".values", ".weight") for k in keys
    }
    merged = adapters.merged_weights(model.state_dict(), layout, torch.float32)
    assert sorted(merged) == sorted(plain_merged)
    for key in merged:
        assert torch.equal(merged[key], plain_merged[key]), key


def test_the_peft_adapter_of_an_svd_init_is_twice_the_rank_and_adds_b_a_minus_b0_a0():
    g = torch.Generator().manual_seed(1)
    now = {"m.lora_a.weight": torch.randn(3, 7, generator=g),
           "m.lora_b.weight": torch.randn(5, 3, generator=g)}  # fmt: skip
    init = {k: torch.randn(v.shape, generator=g) for k, v in now.items()}
    config = {"r": 3, "lora_alpha": 6.0, "target_modules": ["q_proj"], "peft_type": "LORA"}
    assert adapters.peft_adapter(now, config) == (now, config)
    adapter, out = adapters.peft_adapter(now, config, init)
    assert out == dict(config, r=6, lora_alpha=12.0)  # the scaling alpha / r kept
    a, b = adapter["m.lora_a.weight"], adapter["m.lora_b.weight"]
    assert a.shape == (6, 7) and b.shape == (5, 6)
    want = now["m.lora_b.weight"] @ now["m.lora_a.weight"] - init["m.lora_b.weight"] @ init["m.lora_a.weight"]
    torch.testing.assert_close(b @ a, want)


def test_an_adapter_only_checkpoint_never_dequantizes_the_nf4_base(tmp_path, monkeypatch):
    """What every recipe saves with ``save_adapter_weights_only`` comes from
    ``state_to_export``: the adapter's tensors alone, so no NF4 base is dequantized (counted at
    torchao's ``get_original_weight`` and squash's ``nf4`` ops), and the files are those the full
    state dict gave (the former path)."""
    from pathlib import Path

    from omegaconf import OmegaConf
    from safetensors.torch import load_file
    from torch.utils._python_dispatch import TorchDispatchMode

    from squash.models.opt import OPTCheckpointer
    from squash.runs import checkpoint as ckpt

    tiny = Path(__file__).resolve().parents[2] / "assets" / "tiny_opt"
    torch.manual_seed(0)
    model = _trained(squash_opt_tiny(ATTN, True, lora_rank=8, lora_alpha=16, quantize_base=True,
                                     sparsity=0.9, sparse_factor="both"))  # fmt: skip
    assert sum(isinstance(p, NF4Tensor) for p in model.parameters()) == 12
    model_cfg = OmegaConf.create({"_component_": "squash.models.opt.squash_opt_tiny",
                                  "lora_attn_modules": ATTN, "apply_lora_to_mlp": True,
                                  "lora_rank": 8, "lora_alpha": 16})  # fmt: skip
    calls = []
    original = NF4Tensor.get_original_weight

    def counted(self):
        calls.append("get_original_weight")
        return original(self)

    monkeypatch.setattr(NF4Tensor, "get_original_weight", counted)

    class SquashNF4Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "squash" and "nf4" in func.__name__:
                calls.append(str(func))
            return func(*args, **(kwargs or {}))

    def save(out, state):
        made = adapters.checkpoint_exports(state, adapters.adapter_layout(model), model_cfg,
                                          dtype=torch.float32, adapter_only=True)  # fmt: skip
        return ckpt.write_checkpoint(
            out, "epoch_0", checkpointer=OPTCheckpointer(str(tiny), ["model.safetensors"], str(out)),
            exports=made, recipe_state={}, epoch=0, global_step=1, adapter_only=True,
        )  # fmt: skip

    with SquashNF4Ops():
        ours = save(tmp_path / "ours", adapters.state_to_export(model, adapter_only=True))
    assert calls == []
    with SquashNF4Ops():
        full = model.state_dict()
    assert calls.count("get_original_weight") == 12  # the counters see a dequantization
    before = save(tmp_path / "full", full)

    files = sorted(str(p.relative_to(ours)) for p in ours.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(before)) for p in before.rglob("*") if p.is_file())
    assert "model.safetensors" not in files and "adapter/adapter_model.safetensors" in files
    for name in files:
        if name.endswith(".safetensors"):
            a, b = load_file(ours / name), load_file(before / name)
        elif name.endswith(".pt"):
            a = torch.load(ours / name, weights_only=True)
            b = torch.load(before / name, weights_only=True)
        else:
            if name != "checkpoint.json":  # its hashes follow the other files, its config none
                assert (ours / name).read_bytes() == (before / name).read_bytes(), name
            continue
        assert sorted(a) == sorted(b), name
        for key in a:
            assert torch.is_tensor(a[key]) == torch.is_tensor(b[key]), (name, key)
            if torch.is_tensor(a[key]):
                assert torch.equal(a[key], b[key]), (name, key)
    assert len(load_file(ours / "squash_adapter.safetensors")) == 4 * 12  # values + indices, A, B
