"""assets/tiny_opt: reproduced exactly by scripts/make_tiny_opt.py, small, matched by opt_tiny,
and run by squash as by transformers."""

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file

from squash.models.opt import OPTCheckpointer, opt_args_from_hf_config, opt_tiny

import transformers

_TEXT_FILES = ["alpaca_tiny.json", "vocab.json", "merges.txt", "tokenizer_config.json"]


def _script(repo):
    path = repo / "scripts" / "make_tiny_opt.py"
    spec = importlib.util.spec_from_file_location("make_tiny_opt", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_reproduces_the_shipped_files(tiny_opt_dir, tmp_path):
    script = _script(tiny_opt_dir.parents[1])
    records = script.make_records()
    (tmp_path / "alpaca_tiny.json").write_text(json.dumps(records, indent=1) + "\n")
    corpus = (tiny_opt_dir / "corpus.txt").read_text(encoding="utf-8")
    script.train_tokenizer(corpus.split("\n\n") + [" ".join(r.values()) for r in records], tmp_path)
    with torch.random.fork_rng():
        script.make_model(tmp_path)
    for name in _TEXT_FILES:
        assert (tmp_path / name).read_bytes() == (tiny_opt_dir / name).read_bytes(), name
    ours, shipped = (json.loads((d / "config.json").read_text()) for d in (tmp_path, tiny_opt_dir))
    assert ours == shipped
    ours, shipped = (load_file(d / "model.safetensors") for d in (tmp_path, tiny_opt_dir))
    assert ours.keys() == shipped.keys()
    assert all(torch.equal(ours[k], shipped[k]) for k in ours)


def test_shipped_files_are_small_and_match_opt_tiny(tiny_opt_dir):
    assert sum(f.stat().st_size for f in tiny_opt_dir.iterdir()) < 1024**2
    config = json.loads((tiny_opt_dir / "config.json").read_text())
    args = opt_args_from_hf_config(config)
    assert args["embed_dim"] != args["word_embed_proj_dim"] and not args["pre_norm"]
    vocab = json.loads((tiny_opt_dir / "vocab.json").read_text(encoding="utf-8"))
    assert len(vocab) == config["vocab_size"]
    assert [vocab[t] for t in ("<s>", "<pad>", "</s>", "<unk>")] == [0, 1, 2, 3]
    model = opt_tiny()
    assert model.max_seq_len == args["max_seq_len"]
    assert model.tok_embeddings.weight.shape == (args["vocab_size"], args["word_embed_proj_dim"])


def test_tiny_model_matches_transformers(tiny_opt_dir, tmp_path):
    checkpointer = OPTCheckpointer(str(tiny_opt_dir), ["model.safetensors"], str(tmp_path))
    state_dict = checkpointer.load_checkpoint()
    model = opt_tiny().eval()
    model.load_state_dict(state_dict["model"], strict=True)  # fp16 on disk, cast on copy
    hf = transformers.OPTForCausalLM.from_pretrained(tiny_opt_dir, dtype=torch.float32).eval()
    tokens = torch.randint(3, 1024, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max() <= 1e-4


def test_builders_instantiate_from_a_torchtune_config(tiny_opt_dir):
    from omegaconf import OmegaConf
    from torchtune import config

    cfg = OmegaConf.create(
        {
            "model": {
                "_component_": "squash.models.opt.qlora_opt_tiny",
                "lora_attn_modules": ["q_proj", "v_proj"],
                "apply_lora_to_mlp": True,
                "lora_rank": 8,
                "lora_alpha": 16,
            },
            "tokenizer": {
                "_component_": "squash.models.opt.opt_tokenizer",
                "vocab_path": str(tiny_opt_dir / "vocab.json"),
                "merges_path": str(tiny_opt_dir / "merges.txt"),
                "max_seq_len": 256,
            },
        }
    )
    model = config.instantiate(cfg.model)
    tokenizer = config.instantiate(cfg.tokenizer)
    assert type(model.layers[0].mlp.w1.weight).__name__ == "NF4Tensor"
    tokens = torch.tensor([tokenizer.encode("Name a colour.")])
    with torch.no_grad():
        assert model(tokens).shape == (1, tokens.shape[1], tokenizer.vocab_size)
