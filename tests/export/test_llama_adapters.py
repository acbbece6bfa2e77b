"""The checkpoint exports are family-generic: a squash adapter on torchtune's Llama 3.2 builder,
saved through torchtune's FullModelHFCheckpointer the way the recipes save it, gives a PEFT
adapter that transformers' LlamaForCausalLM + PEFT turn into squash's logits, and merged weights
that load in LlamaForCausalLM; with ``init: svd`` the PEFT adapter carries the SVD delta."""

import json

import pytest
import torch
from omegaconf import OmegaConf

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SIZES = dict(vocab_size=256, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64,
             intermediate_dim=128, max_seq_len=128)  # fmt: skip
MODEL_CFG = OmegaConf.create({
    "_component_": "squash.models.squash_model",
    "lora_attn_modules": ["q_proj", "k_proj", "v_proj", "output_proj"],
    "apply_lora_to_mlp": True,
    "lora_rank": 8,
    "lora_alpha": 16,
})  # fmt: skip


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random LlamaForCausalLM with tied embeddings and Llama 3.2's RoPE scaling."""
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    out = tmp_path_factory.mktemp("llama")
    model.save_pretrained(out)
    return out


def _checkpointer(hf_dir, out):
    from torchtune.training import FullModelHFCheckpointer

    return FullModelHFCheckpointer(str(hf_dir), ["model.safetensors"], "LLAMA3_2", str(out))


def _model(base, svd):
    from torchtune.models.llama3_2 import lora_llama3_2

    from squash.models import squash_model
    from squash.modules import svd_initialize

    model = squash_model(lora_llama3_2, sparsity=0.5, sparse_factor="both", **SIZES,
                         **{k: v for k, v in MODEL_CFG.items() if k != "_component_"})  # fmt: skip
    missing, unexpected = model.load_state_dict(base, strict=False)
    assert not unexpected and all(".lora_" in k for k in missing)
    if svd:
        assert svd_initialize(model, base)
    return model.eval()


def _train(model):
    """A few AdamW steps on a next-token loss, so every factor moves away from its init."""
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    set_trainable_params(model, get_adapter_params(model))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


@pytest.mark.parametrize("svd", [False, True], ids=["lora", "svd"])
def test_llama_peft_adapter_and_merged_weights_match_transformers(hf_dir, tmp_path, svd):
    from peft import PeftModel

    from squash.export import adapters
    from squash.runs import checkpoint as ckpt

    checkpointer = _checkpointer(hf_dir, tmp_path / "out")  # loads, then saves, as a recipe's
    base = checkpointer.load_checkpoint()["model"]
    model = _model(base, svd)
    svd_init = None
    if svd:
        svd_init = adapters.dense_adapter(model.state_dict(), adapters.adapter_layout(model))
    model = _train(model)
    made = adapters.checkpoint_exports(
        model.state_dict(), adapters.adapter_layout(model), MODEL_CFG,
        dtype=torch.float32, adapter_only=False, svd_init=svd_init,
    )  # fmt: skip
    path = ckpt.write_checkpoint(
        tmp_path / "out", "epoch_0", checkpointer=checkpointer,
        exports=made, recipe_state={}, epoch=0, global_step=3, adapter_only=False,
    )  # fmt: skip
    config = json.loads((path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == ((16, 32) if svd else (8, 16))
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj", "up_proj"]
    )

    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ours = model(tokens)
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = hf(tokens).logits
    peft_model = PeftModel.from_pretrained(hf, path / "adapter").eval()
    with torch.no_grad():
        theirs = peft_model(tokens).logits
    assert (ours - theirs).abs().max() <= 1e-4
    assert (plain - theirs).abs().max() > 1e-2  # the adapter is not a no-op

    merged = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (merged(tokens).logits - ours).abs().max() <= 1e-4
