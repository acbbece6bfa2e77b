"""assets/tiny_opt checked against transformers (which loads its model and tokenizer) and
hand-written rules: small, matched by opt_tiny, and run by squash as by transformers."""

import json

import torch
from safetensors.torch import load_file

from squash.models.opt import OPTCheckpointer, opt_args_from_hf_config, opt_tiny

import transformers

def test_transformers_loads_the_asset_as_opt_tiny(tiny_opt_dir):
    """transformers reads the shipped config, weights and tokenizer; the sizes are opt_tiny's,
    every weight is stored in float16 and carries noise (no constant tensor), and the tokenizer
    has OPT's special tokens at OPT's ids and round-trips the shipped texts without <unk>."""
    hf = transformers.OPTForCausalLM.from_pretrained(tiny_opt_dir, dtype=torch.float32).eval()
    config = hf.config
    model = opt_tiny()
    assert config.model_type == "opt" and config.vocab_size == 1024
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (
        model.layers[0].attn.embed_dim, len(model.layers), model.layers[0].attn.num_heads)
    assert config.ffn_dim == model.layers[0].mlp.w1.out_features
    assert config.word_embed_proj_dim == model.tok_embeddings.embedding_dim
    assert config.max_position_embeddings == model.max_seq_len
    assert config.do_layer_norm_before is False  # post-norm, like OPT-350m
    stored = load_file(tiny_opt_dir / "model.safetensors")
    assert {t.dtype for t in stored.values()} == {torch.float16}
    assert all(float(t.float().std()) > 0 for t in stored.values())

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_opt_dir)
    assert len(tokenizer) == config.vocab_size
    assert tokenizer.convert_tokens_to_ids(["<s>", "<pad>", "</s>", "<unk>"]) == [0, 1, 2, 3]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        config.bos_token_id, config.eos_token_id, config.pad_token_id)
    records = json.loads((tiny_opt_dir / "alpaca_tiny.json").read_text())
    corpus = (tiny_opt_dir / "corpus.txt").read_text(encoding="utf-8")
    texts = [corpus] + [" ".join(r.values()) for r in records]
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == 2 and 3 not in ids  # BOS </s>, no <unk>
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_shipped_instructions_are_answered_correctly(tiny_opt_dir):
    """The dataset's answers, checked by hand-written rules for the tasks that have one."""
    records = json.loads((tiny_opt_dir / "alpaca_tiny.json").read_text())
    assert len(records) == 200
    assert all(set(r) == {"instruction", "input", "output"} for r in records)
    checked = 0
    for r in records:
        task, given, answer = r["instruction"], r["input"], r["output"]
        if task == "Add the two numbers.":
            a, b = (int(x) for x in given.split(" and "))
            assert answer == str(a + b)
        elif task == "Reverse the order of the words.":
            assert answer == " ".join(reversed(given.split()))
        elif task == "Convert the word to upper case.":
            assert answer == given.upper()
        elif task == "Is the number even or odd?":
            assert answer == ("Even." if int(given) % 2 == 0 else "Odd.")
        else:
            continue
        checked += 1
    assert checked > 50


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
