"""lora_opt/qlora_opt: base weights load, zero-init adapters change nothing, merged and PEFT
exports reproduce the adapted model; model builders have the published sizes."""

import json
import math

import pytest
from safetensors.torch import load_file
import torch
from torchtune.modules.peft import (
    LoRALinear,
    get_adapter_state_dict,
    get_lora_module_names,
    get_merged_lora_ckpt,
    validate_missing_and_unexpected_for_lora,
)

from squash.models import opt as opt_models
from squash.models.opt import OPTCheckpointer, lora_opt, opt, opt_args_from_hf_config

import transformers

ATTN = ["q_proj", "k_proj", "v_proj", "output_proj"]


def _lora_from(args, rank=4, alpha=8.0, **kwargs):
    return lora_opt(
        ATTN, apply_lora_to_mlp=True, lora_rank=rank, lora_alpha=alpha, **args, **kwargs
    )


def _randomize_lora_b(model):
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.lora_b.weight.normal_(std=0.05)


def test_lora_base_weights_load_and_zero_adapters_change_nothing(make_hf, tmp_path):
    hf = make_hf("350m_like")
    hf.save_pretrained(tmp_path / "hf")
    args = opt_args_from_hf_config(hf.config.to_dict())
    base_sd = OPTCheckpointer(str(tmp_path / "hf"), ["model.safetensors"], str(tmp_path / "out"))
    base_sd = base_sd.load_checkpoint()["model"]
    base = opt(**args).eval()
    base.load_state_dict(base_sd)
    lora = _lora_from(args).eval()
    missing, unexpected = lora.load_state_dict(base_sd, strict=False)
    validate_missing_and_unexpected_for_lora(
        ATTN, True, False, base_missing=missing, base_unexpected=unexpected
    )
    assert missing and all(".lora_" in k for k in missing)
    tokens = torch.randint(3, 96, (2, 11))
    with torch.no_grad():
        assert (lora(tokens) - base(tokens)).abs().max() <= 1e-5

        # Non-zero adapters: merging them into the base weights gives the same model.
        _randomize_lora_b(lora)
        adapted = lora(tokens)
        assert (adapted - base(tokens)).abs().max() > 1e-3
        merged = get_merged_lora_ckpt(dict(lora.state_dict()), rank=4, alpha=8.0)
        base.load_state_dict(merged, strict=True)
        assert (base(tokens) - adapted).abs().max() <= 1e-4


def test_peft_loads_the_saved_adapter(make_hf, tmp_path):
    """The PEFT adapter written by OPTCheckpointer, loaded by PEFT onto transformers' model, gives
    the squash LoRA model's logits."""
    import peft
    hf = make_hf("125m_like")
    hf.save_pretrained(tmp_path / "hf")
    args = opt_args_from_hf_config(hf.config.to_dict())
    checkpointer = OPTCheckpointer(
        str(tmp_path / "hf"), ["model.safetensors"], str(tmp_path / "out")
    )
    lora = _lora_from(args).eval()
    lora.load_state_dict(checkpointer.load_checkpoint()["model"], strict=False)
    _randomize_lora_b(lora)
    adapter_config = {
        "r": 4,
        "lora_alpha": 8.0,
        "target_modules": get_lora_module_names(ATTN, True, False),
        "peft_type": "LORA",
    }
    state = {"adapter": get_adapter_state_dict(lora.state_dict()), "adapter_config": adapter_config}
    checkpointer.save_checkpoint(state, epoch=0, adapter_only=True)
    out = tmp_path / "out" / "epoch_0"
    assert not (out / "model.safetensors").exists()
    config = json.loads((out / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == [
        "fc1", "fc2", "k_proj", "out_proj", "q_proj", "v_proj"
    ]

    peft_model = peft.PeftModel.from_pretrained(hf, str(out)).eval()
    tokens = torch.randint(3, 96, (2, 9))
    with torch.no_grad():
        assert (peft_model(tokens).logits - lora(tokens)).abs().max() <= 1e-4


def test_qlora_matches_base_with_dequantized_weights(make_hf, tmp_path):
    """NF4 base weights: with zero adapters the QLoRA model equals a plain model holding the
    dequantized weights (read back through the state-dict hook), and stays near the fp32 model."""
    # Every adapted linear must hold a multiple of 16384 elements (torchao's NF4 blocks).
    hf = make_hf(
        "350m_like", hidden_size=128, word_embed_proj_dim=64, ffn_dim=256, num_hidden_layers=1
    )
    hf.save_pretrained(tmp_path / "hf")
    args = opt_args_from_hf_config(hf.config.to_dict())
    base_sd = OPTCheckpointer(str(tmp_path / "hf"), ["model.safetensors"], str(tmp_path / "out"))
    base_sd = base_sd.load_checkpoint()["model"]
    qlora = _lora_from(args, quantize_base=True).eval()
    missing, unexpected = qlora.load_state_dict(base_sd, strict=False)
    validate_missing_and_unexpected_for_lora(
        ATTN, True, False, base_missing=missing, base_unexpected=unexpected
    )
    assert type(qlora.layers[0].attn.q_proj.weight).__name__ == "NF4Tensor"

    dequantized = opt(**args).eval()
    qlora_sd = {k: v for k, v in qlora.state_dict().items() if ".lora_" not in k}
    dequantized.load_state_dict(qlora_sd, strict=True)
    tokens = torch.randint(3, 96, (2, 10))
    # Independent reference: transformers' model with each adapted weight replaced by torchao's
    # NF4 round trip of the checkpoint weight, every other weight as in the checkpoint.
    from squash.nf4 import to_nf4

    hf_sd = hf.state_dict()
    with torch.no_grad():
        for key, value in hf_sd.items():
            name = key.split(".")[-2]
            if key.endswith(".weight") and name in ("q_proj", "k_proj", "v_proj", "out_proj",
                                                      "fc1", "fc2"):  # fmt: skip
                value.copy_(to_nf4(value.clone()).get_original_weight())
        ours = qlora(tokens)
        assert (ours - dequantized(tokens)).abs().max() <= 1e-4
        assert (ours - hf(tokens).logits).abs().max() <= 1e-4


def test_lora_argument_errors():
    args = dict(
        vocab_size=32, num_layers=1, num_heads=2, embed_dim=8, intermediate_dim=16, max_seq_len=8
    )
    with pytest.raises(ValueError, match="tied"):
        lora_opt(["q_proj"], apply_lora_to_output=True, lora_rank=2, lora_alpha=4, **args)
    with pytest.raises(ValueError, match="bias"):
        lora_opt(["q_proj"], use_dora=True, lora_rank=2, lora_alpha=4, **args)
    with pytest.raises(ValueError, match="subset"):
        lora_opt([], lora_rank=2, lora_alpha=4, **args)
    with pytest.raises(ValueError, match="divisible"):
        opt(**{**args, "num_heads": 3})


# Published configs (huggingface.co/facebook/opt-*/config.json).
_PUBLISHED = {
    "125m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, ffn_dim=3072,
                 word_embed_proj_dim=768, do_layer_norm_before=True),
    "350m": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, ffn_dim=4096,
                 word_embed_proj_dim=512, do_layer_norm_before=False),
    "1_3b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, ffn_dim=8192,
                 word_embed_proj_dim=2048, do_layer_norm_before=True),
    "2_7b": dict(hidden_size=2560, num_hidden_layers=32, num_attention_heads=32, ffn_dim=10240,
                 word_embed_proj_dim=2560, do_layer_norm_before=True),
    "6_7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, ffn_dim=16384,
                 word_embed_proj_dim=4096, do_layer_norm_before=True),
}  # fmt: skip


@pytest.mark.parametrize("size", sorted(_PUBLISHED))
def test_model_builders_have_published_shapes(size):
    """Built on the meta device: every squash tensor has the shape of transformers' tensor."""
    from squash.models.opt import opt_tune_to_hf

    config = transformers.OPTConfig(
        vocab_size=50272, max_position_embeddings=2048, **_PUBLISHED[size]
    )
    with torch.device("meta"):
        theirs = transformers.OPTForCausalLM(config).state_dict()
        ours = getattr(opt_models, f"opt_{size}")().state_dict()
        lora = getattr(opt_models, f"lora_opt_{size}")(["q_proj", "v_proj"], lora_rank=8)
    theirs = {k: tuple(v.shape) for k, v in theirs.items() if k != "lm_head.weight"}
    assert {k: tuple(v.shape) for k, v in opt_tune_to_hf(ours).items()} == theirs
    base_keys = {k for k in lora.state_dict() if ".lora_" not in k}
    assert base_keys == set(ours)
    qlora = getattr(opt_models, f"qlora_opt_{size}")
    assert qlora.keywords == {"quantize_base": True} and qlora.__doc__


def test_from_scratch_init_is_transformers_opt_init():
    """Without a checkpoint, squash's OPT starts as transformers' OPTForCausalLM does: linear
    weights and embeddings N(0, 0.02), biases zero, LayerNorms (1, 0), so the first loss is
    near log(vocab_size) (PyTorch's default N(0, 1) embeddings, tied to the output, gave ~100)."""
    from squash.models.opt import opt_tiny, opt_tune_to_hf, qlora_opt_tiny, squash_opt_tiny

    config = transformers.OPTConfig(
        vocab_size=1024, hidden_size=128, num_hidden_layers=2, ffn_dim=256,
        num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=64,
        do_layer_norm_before=False, init_std=0.02,
    )  # fmt: skip
    torch.manual_seed(0)
    theirs = transformers.OPTForCausalLM(config).eval()
    theirs_sd = theirs.state_dict()
    tokens = torch.randint(4, 1024, (4, 64), generator=torch.Generator().manual_seed(0))

    def loss(logits):
        return float(torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten()))  # fmt: skip

    with torch.no_grad():
        their_loss = loss(theirs(tokens).logits)
    assert abs(their_loss - math.log(1024)) < 0.05
    for build in (opt_tiny, lambda: squash_opt_tiny(ATTN, apply_lora_to_mlp=True, init="svd"),
                  lambda: qlora_opt_tiny(ATTN, apply_lora_to_mlp=True)):  # fmt: skip
        model = build().eval()
        sd = {k: v for k, v in model.state_dict().items() if ".lora_" not in k}
        if any(".lora_" in k for k in model.state_dict()):  # the merged weights (svd: W exactly)
            for name, m in model.named_modules():
                if hasattr(m, "merged_weight"):
                    sd[f"{name}.weight"] = m.merged_weight()
        for key, value in opt_tune_to_hf(sd).items():
            reference = theirs_sd[key]
            if key.endswith("bias") or "layer_norm" in key:
                assert torch.equal(value.float(), reference), key  # zeros, or LayerNorm (1, 0)
            else:  # N(0, 0.02) draws of thousands of elements: the std within 5%
                std, their_std = float(value.float().std()), float(reference.std())
                assert abs(std - 0.02) < 1e-3 and abs(their_std - 0.02) < 1e-3, key
        with torch.no_grad():
            assert abs(loss(model(tokens)) - their_loss) < 0.05


@pytest.mark.parametrize("sparse_factor", ["a", "b", "both"])
def test_squash_adapter_saves_for_squash_and_loads_in_peft(make_hf, tmp_path, sparse_factor):
    """A squash adapter (FFI values + indices, dense B or A) passed to save_checkpoint: squash's
    file keeps its keys and reloads into a fresh model; PEFT's file holds the factors dense, and
    PEFT on transformers' OPT gives squash's logits (fp32, unquantized base)."""
    import peft
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    from squash.models.opt import squash_opt

    hf = make_hf("125m_like")
    hf.save_pretrained(tmp_path / "hf")
    args = opt_args_from_hf_config(hf.config.to_dict())
    checkpointer = OPTCheckpointer(
        str(tmp_path / "hf"), ["model.safetensors"], str(tmp_path / "out")
    )
    base_sd = checkpointer.load_checkpoint()["model"]

    def build():
        model = squash_opt(ATTN, apply_lora_to_mlp=True, lora_rank=4, lora_alpha=8.0,
                           sparsity=0.5, sparse_factor=sparse_factor, **args).eval()  # fmt: skip
        model.load_state_dict(base_sd, strict=False)
        return model

    model = build()
    set_trainable_params(model, get_adapter_params(model))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # trained-looking, non-zero factors
        for p in get_adapter_params(model).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    adapter = get_adapter_state_dict(model.state_dict())
    assert any(k.endswith(".indices") for k in adapter)
    adapter_config = {
        "r": 4, "lora_alpha": 8.0, "target_modules": get_lora_module_names(ATTN, True, False)
    }  # fmt: skip
    checkpointer.save_checkpoint(
        {"adapter": adapter, "adapter_config": adapter_config}, epoch=0, adapter_only=True
    )
    out = tmp_path / "out" / "epoch_0"

    tokens = torch.randint(3, 96, (2, 9), generator=g)
    with torch.no_grad():
        ours = model(tokens)
        saved = torch.load(out / "adapter_model.pt", weights_only=True)
        assert saved.keys() == adapter.keys()
        fresh = build()
        fresh.load_state_dict(saved, strict=False)
        assert torch.equal(fresh(tokens), ours)

        peft_weights = load_file(out / "adapter_model.safetensors")
        assert not any("indices" in k or "values" in k for k in peft_weights)
        # each factor as the model holds it, FFI values put at their indices one by one
        by_hand = {}
        for name, module in model.named_modules():
            if name.endswith((".lora_a", ".lora_b")):
                w = (torch.zeros(module.out_features, module.in_features)
                     if hasattr(module, "indices") else module.weight.detach().clone())  # fmt: skip
                if hasattr(module, "indices"):
                    for o, (cols, vals) in enumerate(zip(module.indices.tolist(),
                                                         module.values.tolist())):  # fmt: skip
                        for c, v in zip(cols, vals, strict=True):
                            w[o, c] = v
                by_hand[f"{name}.weight"] = w
        want = opt_models.opt_tune_to_peft_adapter_weights(by_hand)
        assert sorted(peft_weights) == sorted(want)
        for key in want:
            assert torch.equal(peft_weights[key], want[key]), key
        peft_model = peft.PeftModel.from_pretrained(hf, str(out)).eval()
        assert (peft_model(tokens).logits - ours).abs().max() <= 1e-4
        with peft_model.disable_adapter():  # the adapters matter
            assert (peft_model(tokens).logits - ours).abs().max() > 1e-2


def test_broken_squash_adapter_is_refused_naming_the_key(make_hf, tmp_path):
    hf = make_hf("125m_like")
    hf.save_pretrained(tmp_path / "hf")
    checkpointer = OPTCheckpointer(
        str(tmp_path / "hf"), ["model.safetensors"], str(tmp_path / "out")
    )
    key = "layers.0.attn.q_proj.lora_a"
    adapter = {f"{key}.values": torch.ones(4, 3),
               f"{key}.indices": torch.tensor([[0, 1, 2]] * 3 + [[2, 1, 0]], dtype=torch.int16),
               "layers.0.attn.q_proj.lora_b.weight": torch.ones(32, 4)}  # fmt: skip
    with pytest.raises(ValueError, match=f"not sorted.*{key}"):
        checkpointer.save_checkpoint({"adapter": adapter}, epoch=0, adapter_only=True)
    del adapter[f"{key}.indices"]
    with pytest.raises(ValueError, match="without its partner"):
        checkpointer.save_checkpoint({"adapter": adapter}, epoch=0, adapter_only=True)
    half = {"layers.0.attn.q_proj.lora_b.weight": torch.ones(32, 4)}  # PEFT would load B alone
    with pytest.raises(ValueError, match=r"q_proj\.lora_b but no layers\.0\.attn\.q_proj\.lora_a"):
        checkpointer.save_checkpoint({"adapter": half}, epoch=0, adapter_only=True)
    wrong = {"layers.0.attn.q_proj.lora_a.weight": torch.ones(4, 31),  # q_proj takes 32
             "layers.0.attn.q_proj.lora_b.weight": torch.ones(32, 4)}  # fmt: skip
    with pytest.raises(ValueError, match=r"q_proj\.lora_a is \(4, 31\).*\(4, 32\) at rank 4"):
        checkpointer.save_checkpoint({"adapter": wrong}, epoch=0, adapter_only=True)
    with pytest.raises(ValueError, match=r"Unexpected keys.*layers\.0\.attn\.rotary\.lora_a"):
        checkpointer.save_checkpoint(
            {"adapter": {"layers.0.attn.rotary.lora_a.weight": torch.ones(4, 32),
                         "layers.0.attn.rotary.lora_b.weight": torch.ones(32, 4)}},
            epoch=0, adapter_only=True,
        )  # fmt: skip
    assert not (tmp_path / "out" / "epoch_0").exists()
