"""GGUF export of a checkpoint's merged Hugging Face weights (Llama family and Qwen 2), written
with the ``gguf`` package's writer, without a llama.cpp build.

What llama.cpp's ``convert_hf_to_gguf.py`` does for these families, and what transformers' GGUF
loader (``modeling_gguf_pytorch_utils.py``, ``integrations/ggml.py``) reverses:

- tensor names from gguf's own table (``gguf.get_tensor_name_map``): ``token_embd``,
  ``blk.N.attn_q`` ... ``output_norm``, ``output`` (left out when the embeddings are tied);
- Llama's ``q_proj``/``k_proj`` rows permuted from Hugging Face's rotate-half rotary layout to
  the interleaved one llama.cpp's ``llama`` architecture computes with (:func:`permute_qk`);
  Qwen 2 uses NeoX-style rotary in llama.cpp and keeps Hugging Face's layout;
- Llama 3.1+ frequency scaling as a ``rope_freqs`` tensor (:func:`llama3_rope_factors`);
- F16 (or Q8_0, quantized by ``gguf.quants``) for 2-D weights, F32 for norms and biases;
- the tokenizer (``tokenizer.json``: byte-level BPE tokens, merges, token types, special ids,
  llama.cpp's name for the pre-tokenizer, no space prefix) and the chat template in the
  metadata, with the ``general.*`` keys of :mod:`squash.export.gguf_general`.

:func:`export_gguf` writes a Hugging Face model directory; :func:`write_gguf` a model given as
``config.json`` and weights in memory (what :mod:`squash.merge` makes of a squash checkpoint).
A family or tokenizer that cannot be exported faithfully raises :class:`UnsupportedModelError`
before any file is created; the file itself is written to a temporary file beside the target
and renamed into place.
"""

import json
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, Mapping, Optional, Tuple

import numpy as np
import torch

import gguf
from gguf.metadata import Metadata
from squash._temporaries import owned_prefix, remove_stale
from squash.export.gguf_general import add_general, model_metadata
from squash.export.hf_files import GGUF_DTYPES, load_merged_checkpoint
from squash.export.hf_files import read_json as _read_json

log = logging.getLogger(__name__)

# Hugging Face architecture -> (gguf architecture, permute q/k for llama.cpp's rotary layout)
SUPPORTED_ARCHITECTURES: Dict[str, Tuple[gguf.MODEL_ARCH, bool]] = {
    "LlamaForCausalLM": (gguf.MODEL_ARCH.LLAMA, True),
    "Qwen2ForCausalLM": (gguf.MODEL_ARCH.QWEN2, False),
}
_FILE_TYPE = {"f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
# tokenizer.json pre-tokenizers llama.cpp reproduces, by its ``tokenizer.ggml.pre`` name
_LLAMA3_REGEX = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+"
    "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
_QWEN2_REGEX = _LLAMA3_REGEX.replace("\\p{N}{1,3}", "\\p{N}")
_BYTE_LEVEL = {"type": "ByteLevel", "use_regex": True}
_BYTE_LEVEL_NO_REGEX = {"type": "ByteLevel", "use_regex": False}


class UnsupportedModelError(ValueError):
    """The checkpoint's model family or tokenizer cannot be written as a faithful GGUF file."""


# ---- reading the checkpoint: squash.export.hf_files -----------------------------------------


def _hparams(config: Mapping[str, Any]) -> Dict[str, Any]:
    arch = (config.get("architectures") or [None])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"config.json architectures {config.get('architectures')} cannot be exported to GGUF; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    hp = {
        "architecture": arch,
        "layers": int(config["num_hidden_layers"]),
        "hidden": hidden,
        "intermediate": int(config["intermediate_size"]),
        "heads": heads,
        "kv_heads": int(config.get("num_key_value_heads") or heads),
        "head_dim": int(config.get("head_dim") or hidden // heads),
        "vocab": int(config["vocab_size"]),
        "context": int(config.get("max_position_embeddings", 2048)),
        "rope_theta": float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        "rms_eps": float(config["rms_norm_eps"]),
        "tied": bool(config.get("tie_word_embeddings", False)),
        "rope": rope,
    }
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3") or (rope_type == "llama3" and arch != "LlamaForCausalLM"):
        raise UnsupportedModelError(f"config.json rope scaling {rope_type!r} is not exported to GGUF")
    return hp


def _expected_shapes(hp: Mapping[str, Any]) -> Dict[str, Tuple[int, ...]]:
    h, q, kv = hp["hidden"], hp["heads"] * hp["head_dim"], hp["kv_heads"] * hp["head_dim"]
    shapes = {"model.embed_tokens.weight": (hp["vocab"], h), "model.norm.weight": (h,)}
    if not hp["tied"]:
        shapes["lm_head.weight"] = (hp["vocab"], h)
    for i in range(hp["layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (hp["intermediate"], h),
            p + "mlp.up_proj.weight": (hp["intermediate"], h),
            p + "mlp.down_proj.weight": (h, hp["intermediate"]),
        })  # fmt: skip
        if hp["architecture"] == "Qwen2ForCausalLM":
            shapes.update({
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            })  # fmt: skip
    return shapes


def _check_weights(weights: Mapping[str, torch.Tensor], hp: Mapping[str, Any], source: Path) -> None:
    expected = _expected_shapes(hp)
    present = {k for k in weights if not k.endswith("rotary_emb.inv_freq")}
    if hp["tied"]:
        present.discard("lm_head.weight")  # some writers store the tied copy
    missing, unexpected = sorted(expected.keys() - present), sorted(present - expected.keys())
    wrong = [
        f"{k}: {tuple(weights[k].shape)}, config.json says {expected[k]}"
        for k in sorted(expected.keys() & present)
        if tuple(weights[k].shape) != expected[k]
    ]
    if missing or unexpected or wrong:
        raise ValueError(
            f"The weights in {source} do not match its config.json: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, wrong shapes {wrong[:5]}"
        )


# ---- tensors ------------------------------------------------------------------------------------
def permute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of a Hugging Face Llama ``q_proj``/``k_proj`` weight ``(n_head * head_dim, in)`` (or
    bias) reordered for llama.cpp: in each head, Hugging Face keeps the first and the second half
    of the rotary pairs in two blocks (rotate-half); llama.cpp rotates adjacent pairs. Equal to
    ``convert_hf_to_gguf.py``'s ``LlamaModel.permute`` (``n_head`` is the KV head count for
    ``k_proj``); transformers' ``_reverse_permute_weights`` undoes it."""
    shape = weight.shape
    return weight.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def llama3_rope_factors(hp: Mapping[str, Any]) -> np.ndarray:
    """Per-frequency divisors of Llama 3.1+'s rotary scaling ``(head_dim // 2,)``, what
    ``convert_hf_to_gguf.py`` writes as ``rope_freqs.weight``: the scaled inverse frequencies
    are ``inv_freq / factors``."""
    rope, dim = hp["rope"], hp["head_dim"]
    freqs = 1.0 / (hp["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old_context = float(rope.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_context / low, old_context / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _gguf_tensors(
    weights: Mapping[str, torch.Tensor], hp: Mapping[str, Any], dtype: str
) -> Iterable[Tuple[str, np.ndarray, Optional[gguf.GGMLQuantizationType]]]:
    """(gguf name, data, raw dtype or None for the array's own) for every tensor to write."""
    arch, permute = SUPPORTED_ARCHITECTURES[hp["architecture"]]
    names = gguf.get_tensor_name_map(arch, hp["layers"])
    if hp["rope"].get("rope_type") == "llama3":
        yield gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", llama3_rope_factors(hp), None
    for key in _expected_shapes(hp):
        stem, suffix = key.rsplit(".", 1)
        name = names.get_name(stem)
        if name is None:
            raise UnsupportedModelError(f"gguf has no name for the tensor {key}")
        tensor = weights[key]
        if permute and stem.endswith("self_attn.q_proj"):
            tensor = permute_qk(tensor, hp["heads"])
        elif permute and stem.endswith("self_attn.k_proj"):
            tensor = permute_qk(tensor, hp["kv_heads"])
        data = tensor.numpy().astype(np.float32)
        if data.ndim == 1:
            yield f"{name}.{suffix}", data, None  # norms and biases stay F32, as llama.cpp keeps them
        elif dtype == "q8_0" and data.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0] == 0:
            q8 = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            yield f"{name}.{suffix}", q8, gguf.GGMLQuantizationType.Q8_0
        else:
            yield f"{name}.{suffix}", data.astype(np.float16), None


# ---- tokenizer ----------------------------------------------------------------------------------
def _pre_tokenizer_name(pre: Optional[Mapping[str, Any]], source: Path) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for a ``tokenizer.json`` pre-tokenizer: the name under
    which ``llama-vocab.cpp`` splits text as that pre-tokenizer does (``gpt-2``: GPT-2's regex;
    ``smollm``: each digit alone, then GPT-2's; ``llama-bpe``: Llama 3's; ``qwen2``: Qwen 2's),
    the name ``convert_hf_to_gguf.py`` writes for such a tokenizer."""
    def same(step: Mapping[str, Any], ref: Mapping[str, Any]) -> bool:
        return all(step.get(k) == v for k, v in ref.items())

    steps = [] if pre is None else list(pre.get("pretokenizers", [pre]))
    if any(s.get("type") == "ByteLevel" and s.get("add_prefix_space") for s in steps):
        raise UnsupportedModelError(
            f"The pre-tokenizer in {source} adds a space before the text (ByteLevel "
            "add_prefix_space: true), which llama.cpp's byte-level BPE does not do"
        )
    if len(steps) == 1 and same(steps[0], _BYTE_LEVEL):
        return "gpt-2"  # llama.cpp's name; "gpt2" is refused ("unknown pre-tokenizer type")
    if (
        len(steps) == 2 and same(steps[0], {"type": "Digits", "individual_digits": True})
        and same(steps[1], _BYTE_LEVEL)
    ):
        return "smollm"  # llama.cpp: each digit alone, then GPT-2's regex
    if len(steps) == 2 and steps[0].get("type") == "Split" and same(steps[1], _BYTE_LEVEL_NO_REGEX):
        regex = (steps[0].get("pattern") or {}).get("Regex")
        if regex == _LLAMA3_REGEX:
            return "llama-bpe"
        if regex == _QWEN2_REGEX:
            return "qwen2"
    raise UnsupportedModelError(
        f"The pre-tokenizer in {source} is not one llama.cpp is known to reproduce "
        f"(GPT-2, SmolLM, Llama 3, Qwen 2): {json.dumps(pre)[:300]}"
    )


def _token_id(token: Any, vocab: Mapping[str, int]) -> Optional[int]:
    if isinstance(token, dict):
        token = token.get("content")
    return vocab.get(token) if isinstance(token, str) else None


def tokenizer_metadata(
    checkpoint_dir: Path, vocab_size: int, config: Optional[Mapping[str, Any]] = None
) -> Dict[str, Any]:
    """The ``tokenizer.*`` metadata of the GGUF file from ``tokenizer.json``,
    ``tokenizer_config.json`` and the chat template of ``checkpoint_dir``.

    Returns a dict with ``pre``, ``tokens``, ``token_types``, ``merges``, ``special`` (name -> id
    for bos/eos/unk/pad: ``tokenizer_config.json``'s ``<name>_token``, else ``config``'s
    ``<name>_token_id``, as ``convert_hf_to_gguf.py`` reads them), ``add_bos`` and
    ``chat_template`` (or None).

    Raises:
        FileNotFoundError: without ``tokenizer.json``.
        UnsupportedModelError: for a tokenizer that is not byte-level BPE, or larger than the
            model's vocabulary.
    """
    checkpoint_dir = Path(checkpoint_dir)
    source = checkpoint_dir / "tokenizer.json"
    tok = _read_json(source)
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise UnsupportedModelError(f"{source} is not a byte-level BPE tokenizer (model.type {model.get('type')!r})")
    pre = _pre_tokenizer_name(tok.get("pre_tokenizer"), source)
    vocab = dict(model["vocab"])
    added = {}
    for entry in tok.get("added_tokens", []):
        vocab[entry["content"]] = int(entry["id"])
        added[int(entry["id"])] = bool(entry.get("special"))
    if max(vocab.values()) >= vocab_size:
        raise UnsupportedModelError(
            f"{source} has token id {max(vocab.values())}, beyond config.json vocab_size {vocab_size}"
        )
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [int(gguf.TokenType.UNUSED)] * vocab_size
    for text, i in vocab.items():
        tokens[i] = text
        if i in added:
            types[i] = int(gguf.TokenType.CONTROL if added[i] else gguf.TokenType.USER_DEFINED)
        else:
            types[i] = int(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    config_path = checkpoint_dir / "tokenizer_config.json"
    tok_config = _read_json(config_path) if config_path.is_file() else {}
    special = {}
    for name in ("bos", "eos", "unk", "pad"):
        i = _token_id(tok_config.get(f"{name}_token"), vocab)
        if i is None and config is not None:
            i = config.get(f"{name}_token_id")
            valid = isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size
            i = i if valid else None
        if i is not None:
            special[name] = i
    add_bos = tok_config.get("add_bos_token")
    if add_bos is None:  # a post-processor that puts a special token before the sequence
        single = (tok.get("post_processor") or {}).get("single") or []
        add_bos = bool(single) and "SpecialToken" in single[0]
    template = tok_config.get("chat_template")
    template_file = checkpoint_dir / "chat_template.jinja"
    if template_file.is_file():
        template = template_file.read_text()
    return {
        "pre": pre, "tokens": tokens, "token_types": types, "merges": merges, "special": special,
        "add_bos": bool(add_bos), "chat_template": template,
    }  # fmt: skip


# ---- writing ------------------------------------------------------------------------------------
def _write_metadata(writer: gguf.GGUFWriter, hp: Mapping[str, Any], tok: Mapping[str, Any], dtype: str) -> None:
    writer.add_context_length(hp["context"])
    writer.add_embedding_length(hp["hidden"])
    writer.add_block_count(hp["layers"])
    writer.add_feed_forward_length(hp["intermediate"])
    writer.add_head_count(hp["heads"])
    writer.add_head_count_kv(hp["kv_heads"])
    writer.add_rope_freq_base(hp["rope_theta"])
    writer.add_layer_norm_rms_eps(hp["rms_eps"])
    writer.add_vocab_size(hp["vocab"])
    writer.add_rope_dimension_count(hp["head_dim"])
    if hp["head_dim"] != hp["hidden"] // hp["heads"]:
        writer.add_key_length(hp["head_dim"])
        writer.add_value_length(hp["head_dim"])
    writer.add_file_type(_FILE_TYPE[dtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tok["pre"])
    writer.add_token_list(tok["tokens"])
    writer.add_token_types(tok["token_types"])
    writer.add_token_merges(tok["merges"])
    for name, i in tok["special"].items():
        getattr(writer, {"unk": "add_unk_token_id"}.get(name, f"add_{name}_token_id"))(i)
    # byte-level BPE: no space before the text (a tokenizer that adds one is refused above)
    writer.add_add_space_prefix(False)
    writer.add_add_bos_token(tok["add_bos"])
    if tok["chat_template"]:
        writer.add_chat_template(tok["chat_template"])


def export_gguf(checkpoint_dir: Path, dtype: str, output: Path) -> Path:
    """Write the merged weights of the Hugging Face checkpoint ``checkpoint_dir`` as one GGUF
    file ``output`` (its ``general.*`` keys from the directory: :func:`model_metadata`).

    Args:
        checkpoint_dir (Path): a Hugging Face checkpoint directory (``config.json``,
            ``model*.safetensors``, ``tokenizer.json``; squash's ``epoch_N``/``step_N``).
        dtype (str): ``"f16"`` or ``"q8_0"`` (see :func:`write_gguf`).
        output (Path): the file to write; its directory must exist.

    Returns:
        Path: ``output``.

    Raises:
        FileNotFoundError: a missing directory, config, weights or tokenizer.
        UnsupportedModelError: a family, rotary scaling or tokenizer GGUF cannot carry.
        ValueError: weights that do not match ``config.json``, or an unknown ``dtype``.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise FileNotFoundError(f"Checkpoint directory {checkpoint_dir} does not exist")
    _check_dtype(dtype)
    config = _read_json(checkpoint_dir / "config.json")
    _hparams(config)  # an unsupported family fails before the weights are read
    _, weights = load_merged_checkpoint(checkpoint_dir)
    meta = model_metadata(checkpoint_dir)
    source = f"the Hugging Face checkpoint {checkpoint_dir.name}"
    return write_gguf(config, weights, checkpoint_dir, dtype, output, meta, source)


def _check_dtype(dtype: str) -> None:
    if dtype not in GGUF_DTYPES:
        raise ValueError(f"GGUF dtype {dtype!r} is not one of {list(GGUF_DTYPES)}")


def write_gguf(
    config: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor],
    tokenizer_dir: Path,
    dtype: str,
    output: Path,
    meta: Metadata,
    source: str,
) -> Path:
    """Write a model given as Hugging Face ``config.json`` and weights as one GGUF file.

    Args:
        config (Mapping[str, Any]): the model's ``config.json``.
        weights (Mapping[str, torch.Tensor]): its weights with Hugging Face's keys.
        tokenizer_dir (Path): the directory with ``tokenizer.json``, ``tokenizer_config.json``
            and the chat template.
        dtype (str): ``"f16"`` or ``"q8_0"`` for the 2-D weights (norms and biases stay F32;
            a weight whose rows are not a multiple of 32 stays F16 under Q8_0).
        output (Path): the file to write; its directory must exist. Written to a temporary file
            in the same directory, then renamed.
        meta (Metadata): the ``general.*`` keys (:mod:`squash.export.gguf_general`).
        source (str): what the weights were read from, for ``general.description``.

    Returns:
        Path: ``output``.

    Raises:
        FileNotFoundError: a missing tokenizer or output directory.
        UnsupportedModelError: a family, rotary scaling or tokenizer GGUF cannot carry.
        ValueError: weights that do not match ``config``, or an unknown ``dtype``.
    """
    _check_dtype(dtype)
    output = Path(output)
    if not output.parent.is_dir():
        raise FileNotFoundError(f"Output directory {output.parent} does not exist")
    hp = _hparams(config)
    tok = tokenizer_metadata(Path(tokenizer_dir), hp["vocab"], config)
    _check_weights(weights, hp, Path(tokenizer_dir))

    arch = gguf.MODEL_ARCH_NAMES[SUPPORTED_ARCHITECTURES[hp["architecture"]][0]]
    # named after this process, so the next export of ``output`` removes what a killed one left
    remove_stale(output.parent, f".{output.name}.")
    fd, tmp = tempfile.mkstemp(
        prefix=owned_prefix(f".{output.name}."), suffix=".tmp", dir=output.parent
    )
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, arch=arch)
        for name, data, raw_dtype in _gguf_tensors(weights, hp, dtype):
            writer.add_tensor(name, data, raw_dtype=raw_dtype)
        add_general(writer, meta, writer.get_total_parameter_count(), source)
        _write_metadata(writer, hp, tok, dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, output)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    log.info("Wrote %s (%s)", output, dtype)
    return output
