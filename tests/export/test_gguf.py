"""GGUF export on tiny random checkpoints, read back by gguf's reader and by transformers' GGUF
loader (which undoes llama.cpp's layout on its own code path) and compared with the source model."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import gguf
from squash.cli import main as cli_main
from squash.export import UnsupportedModelError, export_gguf, parse_export_config
from squash.export.gguf import llama3_rope_factors, permute_qk
from squash.merge import export_checkpoint

TEXT = "The quick brown fox jumps over the lazy dog. In 1492 Columbus sailed the ocean blue."


def _hf(directory: Path, gguf_file: str = None):
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, **kwargs).eval()


def _ids(directory: Path) -> torch.Tensor:
    from tokenizers import Tokenizer

    return torch.tensor([Tokenizer.from_file(str(directory / "tokenizer.json")).encode(TEXT).ids])


def _rounded_to_f16(model):
    """The model with every 2-D weight rounded to float16, as the F16 file stores it."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.copy_(p.half().float())
    return model


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2"])
def test_f16_loads_in_transformers_with_the_same_logits(family, request, tmp_path):
    src = request.getfixturevalue(family)
    out = export_gguf(src, "f16", tmp_path / "m.gguf")
    ids = _ids(src)
    with torch.no_grad():
        ref = _rounded_to_f16(_hf(src))(ids).logits
        got = _hf(tmp_path, "m.gguf")(ids).logits
    # Same weights up to float summation order: the permutation and names round-trip exactly.
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert sorted(os.listdir(tmp_path)) == [out.name]  # no temporary left


def test_q8_0_weights_are_blockwise_int8_of_the_source(tiny_llama, tmp_path):
    export_gguf(tiny_llama, "q8_0", tmp_path / "m.gguf")
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["output.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    src = _hf(tiny_llama).state_dict()
    got = _hf(tmp_path, "m.gguf").state_dict()
    for key in ("model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        w = src[key]
        blocks = w.reshape(w.shape[0], -1, 32)
        # Q8_0 by hand (ggml's quantize_row_q8_0_ref): per block of 32, d = max|w| / 127,
        # q = round-half-away(w / d), and the file keeps d as float16
        d = blocks.abs().amax(-1, keepdim=True) / 127
        x = blocks / torch.where(d == 0, 1, d)
        q = torch.sign(x) * torch.floor(x.abs() + 0.5)
        torch.testing.assert_close(got[key], (q * d.half().float()).reshape(w.shape), atol=1e-7, rtol=0)


def test_metadata_carries_tokenizer_and_chat_template(tiny_llama, tmp_path):
    export_gguf(tiny_llama, "f16", tmp_path / "m.gguf")
    fields = gguf.GGUFReader(tmp_path / "m.gguf").fields
    tok = json.loads((tiny_llama / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]})
    tokens = fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == 320  # the model's vocab; ids the tokenizer lacks are padding
    assert all(tokens[i] == text for text, i in vocab.items())
    types = fields["tokenizer.ggml.token_type"].contents()
    assert [types[vocab[t]] for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [3, 3, 3]
    assert types[vocab["Ġ"]] == 1 and types[len(vocab)] == 5  # a byte, and padding
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    assert fields["tokenizer.ggml.merges"].contents() == merges
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    # llama.cpp's name for GPT-2's pre-tokenizer (llama-vocab.cpp refuses "gpt2")
    assert fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    assert fields["tokenizer.ggml.add_space_prefix"].contents() is False
    assert fields["tokenizer.ggml.bos_token_id"].contents() == vocab["<|im_start|>"]
    assert fields["tokenizer.ggml.eos_token_id"].contents() == vocab["<|im_end|>"]
    assert fields["tokenizer.ggml.padding_token_id"].contents() == vocab["<|im_end|>"]
    assert fields["tokenizer.chat_template"].contents() == (tiny_llama / "chat_template.jinja").read_text()
    assert fields["general.architecture"].contents() == "llama"
    assert fields["llama.attention.head_count_kv"].contents() == 2
    assert fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_F16)


def test_general_keys_come_from_the_model_card_and_say_squash_wrote_the_file(tiny_llama, tmp_path):
    import squash

    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    (src / "README.md").write_text(
        '---\nname: "Tiny Llama"\norganization: "Acme"\nbasename: tiny-llama\n'
        'license: apache-2.0\nlanguage: [en, fr]\n---\n# Tiny Llama\n'
    )
    export_gguf(src, "f16", tmp_path / "m.gguf")
    fields = gguf.GGUFReader(tmp_path / "m.gguf").fields
    got = {k[len("general."):]: fields[k].contents() for k in fields if k.startswith("general.")}
    # embeddings and output 2 x 320 x 64; per layer q, o 64 x 64, k, v 32 x 64, three MLP
    # 96 x 64, two norms of 64; the final norm
    n_params = 2 * 320 * 64 + 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 96 * 64 + 2 * 64) + 64
    assert n_params == sum(v.numel() for v in _hf(tiny_llama).state_dict().values()) == 102_720
    assert got == {
        "architecture": "llama", "type": "model", "name": "Tiny Llama", "organization": "Acme",
        "basename": "tiny-llama", "license": "apache-2.0", "languages": ["en", "fr"],
        "size_label": "103K",  # 102,720 parameters to three digits
        "description": f"GGUF written by squash {squash.__version__} from the Hugging Face "
        "checkpoint src",
        "file_type": int(gguf.LlamaFileType.MOSTLY_F16), "quantization_version": 2,
    }  # fmt: skip


def test_special_tokens_missing_from_tokenizer_config_come_from_config_json(tiny_qwen2, tmp_path):
    """Qwen 2.5's tokenizer_config.json has no bos_token; convert_hf_to_gguf.py then takes
    config.json's bos_token_id, and so does squash."""
    src = tmp_path / "src"
    shutil.copytree(tiny_qwen2, src)
    tok_config = json.loads((src / "tokenizer_config.json").read_text())
    del tok_config["bos_token"]
    (src / "tokenizer_config.json").write_text(json.dumps(tok_config))
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(config, bos_token_id=0, unk_token_id=[1])))
    export_gguf(src, "f16", tmp_path / "m.gguf")
    fields = gguf.GGUFReader(tmp_path / "m.gguf").fields
    assert fields["tokenizer.ggml.bos_token_id"].contents() == 0
    # a tokenizer_config.json entry wins; a list is not a token id
    assert fields["tokenizer.ggml.unknown_token_id"].contents() == 0  # <|endoftext|>
    assert fields["tokenizer.ggml.eos_token_id"].contents() == 2


def test_transformers_tokenizer_from_gguf_encodes_like_tokenizer_json(tiny_qwen2, tmp_path):
    from transformers import AutoTokenizer

    export_gguf(tiny_qwen2, "f16", tmp_path / "m.gguf")
    tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    assert tok(TEXT + " 12345").input_ids == _ids_list(tiny_qwen2, TEXT + " 12345")
    assert gguf.GGUFReader(tmp_path / "m.gguf").fields["tokenizer.ggml.pre"].contents() == "qwen2"


def _ids_list(directory: Path, text: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text).ids


def test_permutation_is_what_transformers_reverses():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = torch.randn(3 * 8, 5)  # 3 heads of head_dim 8
    back = LlamaTensorProcessor()._reverse_permute_weights(permute_qk(w, 3).numpy(), 3, 3)
    np.testing.assert_array_equal(back, w.numpy())
    assert not torch.equal(permute_qk(w, 3), w)


def test_llama3_rope_factors_match_transformers_scaled_frequencies():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_theta": 500000.0}  # fmt: skip
    config = LlamaConfig(hidden_size=2048, num_attention_heads=32, head_dim=64, rope_parameters=rope)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    hp = {"rope": rope, "head_dim": 64, "rope_theta": 500000.0}
    np.testing.assert_allclose(llama3_rope_factors(hp), (plain / scaled.double()).numpy(), rtol=1e-5)


def test_llama3_scaled_checkpoint_gets_rope_freqs(tiny_llama, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    config = json.loads((src / "config.json").read_text())
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 10000.0}  # fmt: skip
    config.pop("rope_theta", None)
    config["rope_parameters"] = rope
    (src / "config.json").write_text(json.dumps(config))
    export_gguf(src, "f16", tmp_path / "m.gguf")
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    hp = {"rope": rope, "head_dim": 16, "rope_theta": 10000.0}
    np.testing.assert_array_equal(tensors["rope_freqs.weight"].data, llama3_rope_factors(hp))


def test_unsupported_family_is_a_clear_error_and_no_file(tiny_opt, tmp_path):
    with pytest.raises(UnsupportedModelError, match="OPTForCausalLM.*supported"):
        export_gguf(tiny_opt, "f16", tmp_path / "m.gguf")
    assert os.listdir(tmp_path) == []
    assert cli_main(["export", str(tiny_opt), "--dtype", "q8_0", "--output-dir", str(tmp_path)]) == 1
    assert os.listdir(tmp_path) == []


def test_unknown_pre_tokenizer_is_refused(tiny_llama, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    tok = json.loads((src / "tokenizer.json").read_text())
    tok["pre_tokenizer"] = {"type": "Whitespace"}
    (src / "tokenizer.json").write_text(json.dumps(tok))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(UnsupportedModelError, match="pre-tokenizer.*Whitespace"):
        export_gguf(src, "f16", out / "m.gguf")
    assert os.listdir(out) == []


def test_byte_level_with_a_prefix_space_is_refused(tiny_llama, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    tok = json.loads((src / "tokenizer.json").read_text())
    tok["pre_tokenizer"]["add_prefix_space"] = True
    (src / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(UnsupportedModelError, match="add_prefix_space: true"):
        export_gguf(src, "f16", tmp_path / "m.gguf")
    assert not list(tmp_path.glob("*.gguf"))


def test_bad_inputs_are_clear_errors(tiny_llama, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_gguf(tmp_path / "nope", "f16", tmp_path / "m.gguf")
    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    with pytest.raises(ValueError, match="dtype 'q4'"):
        export_gguf(src, "q4", tmp_path / "m.gguf")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(config, intermediate_size=128)))
    with pytest.raises(ValueError, match="mlp.*wrong shapes|wrong shapes.*mlp"):
        export_gguf(src, "f16", tmp_path / "m.gguf")
    for f in src.glob("model*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="No weights.*not a Hugging Face model"):
        export_gguf(src, "f16", tmp_path / "m.gguf")
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*"))


def test_failed_write_leaves_no_file(tiny_llama, tmp_path, monkeypatch):
    def broken(self):
        raise OSError("disk full")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", broken)
    with pytest.raises(OSError, match="disk full"):
        export_gguf(tiny_llama, "f16", tmp_path / "m.gguf")
    assert os.listdir(tmp_path) == []


def test_export_config_and_cli(tiny_llama, tmp_path):
    assert parse_export_config({"gguf": "f16"}) == {"gguf": ["f16"]}
    assert parse_export_config(None) == {}
    with pytest.raises(ValueError, match="export.gguf: unknown dtype.*q4_k"):
        parse_export_config({"gguf": ["f16", "q4_k"]})
    with pytest.raises(ValueError, match="export: unknown format.*onnx"):
        parse_export_config({"onnx": ["f16"]})
    # what OmegaConf makes of export={gguf:f16} (no space after the colon)
    block = OmegaConf.to_container(OmegaConf.from_dotlist(["export={gguf:f16}"]))["export"]
    with pytest.raises(ValueError, match=r"\['gguf:f16'\].*write export.gguf=f16"):
        parse_export_config(block)
    ckpt = tmp_path / "run" / "epoch_0"
    shutil.copytree(tiny_llama, ckpt)
    files = export_checkpoint(ckpt, {"gguf": ["f16", "q8_0"]})
    assert [f.name for f in files] == ["epoch_0-f16.gguf", "epoch_0-q8_0.gguf"]
    assert all(f.parent == tmp_path / "run" / "gguf" for f in files)
    assert cli_main(["export", str(ckpt), "--format", "gguf", "--dtype", "q8_0",
                     "--output-dir", str(tmp_path)]) == 0  # fmt: skip
    a = gguf.GGUFReader(tmp_path / "epoch_0-q8_0.gguf").tensors
    b = gguf.GGUFReader(files[1]).tensors
    assert [t.name for t in a] == [t.name for t in b]
    assert all(np.array_equal(x.data, y.data) for x, y in zip(a, b))
