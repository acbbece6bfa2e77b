"""Tiny random Hugging Face checkpoints (Llama with GQA and untied output, Qwen 2 with biases and
tied embeddings, OPT) with a small byte-level BPE tokenizer: GGUF export tests without a download."""

import json
from pathlib import Path

import pytest
import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a "
    "single step. In 1492 Columbus sailed the ocean blue; 2 + 2 = 4. "
) * 20


def write_tokenizer(directory: Path, pre_tokenizer: str = "gpt2") -> int:
    """A byte-level BPE tokenizer trained on TEXT, with ChatML special tokens; returns its size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if pre_tokenizer == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:  # Qwen 2's split regex, then byte-level without its own regex
        from squash.export.gguf import _QWEN2_REGEX

        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT], trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast",
    }))  # fmt: skip
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return tok.get_vocab_size()


def _save(model, directory: Path, tokenizer: str = "gpt2") -> Path:
    directory.mkdir(parents=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    write_tokenizer(directory, tokenizer)
    return directory


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    return _save(model, tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    config = Qwen2Config(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # random, visible biases
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return _save(model, tmp_path_factory.mktemp("tiny") / "qwen2", tokenizer="qwen2")


@pytest.fixture(scope="session")
def tiny_opt(tmp_path_factory) -> Path:
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(
        vocab_size=320, hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=2,
        word_embed_proj_dim=32, max_position_embeddings=64,
    )  # fmt: skip
    return _save(OPTForCausalLM(config), tmp_path_factory.mktemp("tiny") / "opt")
