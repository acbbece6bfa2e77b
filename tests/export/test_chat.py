"""``squash chat`` on tiny checkpoints: greedy tokens against transformers' ``generate``, an
adapter checkpoint merged into a base against a merge done by hand in transformers, and its
errors."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from squash.chat import load_checkpoint, main as chat_main
from squash.cli import main as cli_main
from squash.export.adapters import squash_adapter
from squash.runs import checkpoint as ckpt
from squash.runs import manifest

from tests.helpers import REPO, rehash_checkpoint
MESSAGES = [{"role": "user", "content": "The quick brown fox"}]


def _reference_generate(directory: Path, prompt_ids, n: int, model=None):
    from transformers import AutoModelForCausalLM

    if model is None:
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    out = model.generate(
        torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt_ids):].tolist()


def test_merged_greedy_tokens_equal_transformers_generate(tiny_llama):
    chat = load_checkpoint(tiny_llama)
    chat.eos_ids = []  # a random model: compare all 12 tokens
    prompt = chat.prompt_ids(MESSAGES)
    assert chat.tokenizer.decode(prompt).startswith("<|im_start|>user\nThe quick brown fox<|im_end|>")
    assert list(chat.generate(prompt, 12)) == _reference_generate(tiny_llama, prompt, 12)


def test_sampling_is_seeded_and_stays_in_the_top_k(tiny_llama):
    from transformers import AutoModelForCausalLM

    chat = load_checkpoint(tiny_llama)
    chat.eos_ids = []
    prompt = chat.prompt_ids(MESSAGES)
    run = lambda seed, k: list(chat.generate(prompt, 10, 1.5, k, torch.Generator().manual_seed(seed)))  # noqa: E731
    a, b = run(1, 5), run(1, 5)
    assert a == b and a != run(2, 5)
    assert run(3, 1) == list(chat.generate(prompt, 10))  # top-1 sampling is greedy
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    with torch.no_grad():
        for i, token in enumerate(a):
            logits = model(torch.tensor([prompt + a[:i]])).logits[0, -1]
            assert token in torch.topk(logits, 5).indices.tolist()


def test_cli_streams_the_greedy_answer(tiny_llama, capsys, monkeypatch):
    chat = load_checkpoint(tiny_llama)
    prompt = chat.prompt_ids(MESSAGES)
    ref = _reference_generate(tiny_llama, prompt, 8)
    eos = chat.eos_ids
    ref = ref[: next((i for i, t in enumerate(ref) if t in eos), len(ref))]
    assert cli_main(["chat", "--checkpoint", str(tiny_llama), "--prompt", MESSAGES[0]["content"],
                     "--max-new-tokens", "8"]) == 0  # fmt: skip
    assert capsys.readouterr().out == chat.tokenizer.decode(ref, skip_special_tokens=True) + "\n"


def test_bad_checkpoint_paths_are_clear_errors(tmp_path, tiny_llama, capsys):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="neither merged weights.*nor a squash checkpoint"):
        load_checkpoint(tmp_path)
    assert cli_main(["chat", "--checkpoint", str(tmp_path / "nope"), "--prompt", "hi"]) == 1
    assert "does not exist" in capsys.readouterr().err


# ---- base + squash adapter -----------------------------------------------------------------------
MODEL_CFG = {
    "_component_": "squash.models.opt.squash_opt_tiny", "lora_attn_modules": ["q_proj", "v_proj"],
    "lora_rank": 4, "lora_alpha": 8.0, "quantize_base": False, "sparsity": 0.75,
}  # fmt: skip


def _adapter_checkpoint(tmp_path: Path, cfg=MODEL_CFG) -> Path:
    """A checkpoint directory with a random (non-zero) squash adapter for the tiny OPT."""
    from torchtune import config

    model = config.instantiate(OmegaConf.create(cfg))
    with torch.no_grad():
        for k, v in model.named_parameters():
            if ".lora_" in k:
                v.normal_(0, 0.3)
    out = tmp_path / "epoch_0"
    out.mkdir()
    from safetensors.torch import save_file

    save_file(squash_adapter(model.state_dict()), out / ckpt.SQUASH_ADAPTER_FILE)
    (out / ckpt.SQUASH_ADAPTER_CONFIG_FILE).write_text(json.dumps({"model": cfg}))
    # written outside a run: no base recorded (as in older checkpoints), so --base is needed
    manifest.write_meta(out, {"epoch": 0, "global_step": 0}, {}, None)
    return out


def _base(tmp_path: Path) -> Path:
    base = tmp_path / "base"
    shutil.copytree(REPO / "assets" / "tiny_opt", base)
    (base / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    )
    return base


def test_base_plus_adapter_equals_a_hand_merge_in_transformers(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base, run = _base(tmp_path), _adapter_checkpoint(tmp_path)
    adapter = load_file(run / ckpt.SQUASH_ADAPTER_FILE)
    ref = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    with torch.no_grad():  # W + alpha / rank * B @ A, A written dense from its FFI values/indices
        for i in range(2):
            for proj in ("q_proj", "v_proj"):
                key = f"layers.{i}.attn.{proj}"
                values, idx = adapter[f"{key}.lora_a.values"], adapter[f"{key}.lora_a.indices"]
                a = torch.zeros(values.shape[0], 128).scatter_(1, idx.long(), values)
                b = adapter[f"{key}.lora_b.weight"]
                getattr(ref.model.decoder.layers[i].self_attn, proj).weight += 2.0 * b @ a
    with pytest.raises(ValueError, match="records no hashes of the base model.*--base"):
        load_checkpoint(run)
    chat = load_checkpoint(run, base)
    chat.eos_ids = []
    prompt = chat.prompt_ids(MESSAGES)
    assert list(chat.generate(prompt, 8)) == _reference_generate(base, prompt, 8, model=ref)


def test_adapter_that_does_not_fit_the_model_is_a_clear_error(tmp_path):
    base = _base(tmp_path)
    run = _adapter_checkpoint(tmp_path)
    # the same file under a config with another rank
    cfg = json.loads((run / ckpt.SQUASH_ADAPTER_CONFIG_FILE).read_text())
    cfg["model"]["lora_rank"] = 8
    (run / ckpt.SQUASH_ADAPTER_CONFIG_FILE).write_text(json.dumps(cfg))
    rehash_checkpoint(run)
    with pytest.raises(ValueError, match="does not fit the model.*wrong shapes"):
        load_checkpoint(run, base)
    cfg["model"]["lora_rank"] = 4
    cfg["model"]["lora_attn_modules"] = ["q_proj", "k_proj", "v_proj"]
    (run / ckpt.SQUASH_ADAPTER_CONFIG_FILE).write_text(json.dumps(cfg))
    rehash_checkpoint(run)
    with pytest.raises(ValueError, match="does not fit the model: missing.*k_proj"):
        load_checkpoint(run, base)
    assert chat_main(OmegaConf.create({"checkpoint": str(run), "base": str(base), "device": "cpu"})) == 1
