"""OPT weight conversion between Hugging Face's ``OPTForCausalLM`` and squash's ``OPTDecoder``.

One table maps templated HF keys (``{}`` = layer index, without the ``model.`` prefix) to squash
keys; ``None`` drops a key. HF OPT keeps q, k and v separate and has no rotary embedding, so no
tensor is split, merged or permuted: conversion renames keys only.
"""

import re
from typing import Any, Dict, List, Optional

import torch

from squash.sparsity import validate_ffi
from squash.modules.adapter import AdapterLayout

# HF key (without the "model." prefix) -> squash key; None = drop.
_FROM_HF = {
    "decoder.embed_tokens.weight": "tok_embeddings.weight",
    "decoder.embed_positions.weight": "pos_embeddings.weight",
    "decoder.project_in.weight": "project_in.weight",
    "decoder.project_out.weight": "project_out.weight",
    "decoder.final_layer_norm.weight": "norm.weight",
    "decoder.final_layer_norm.bias": "norm.bias",
    "decoder.layers.{}.self_attn.q_proj.weight": "layers.{}.attn.q_proj.weight",
    "decoder.layers.{}.self_attn.q_proj.bias": "layers.{}.attn.q_proj.bias",
    "decoder.layers.{}.self_attn.k_proj.weight": "layers.{}.attn.k_proj.weight",
    "decoder.layers.{}.self_attn.k_proj.bias": "layers.{}.attn.k_proj.bias",
    "decoder.layers.{}.self_attn.v_proj.weight": "layers.{}.attn.v_proj.weight",
    "decoder.layers.{}.self_attn.v_proj.bias": "layers.{}.attn.v_proj.bias",
    "decoder.layers.{}.self_attn.out_proj.weight": "layers.{}.attn.output_proj.weight",
    "decoder.layers.{}.self_attn.out_proj.bias": "layers.{}.attn.output_proj.bias",
    "decoder.layers.{}.self_attn_layer_norm.weight": "layers.{}.sa_norm.weight",
    "decoder.layers.{}.self_attn_layer_norm.bias": "layers.{}.sa_norm.bias",
    "decoder.layers.{}.fc1.weight": "layers.{}.mlp.w1.weight",
    "decoder.layers.{}.fc1.bias": "layers.{}.mlp.w1.bias",
    "decoder.layers.{}.fc2.weight": "layers.{}.mlp.w2.weight",
    "decoder.layers.{}.fc2.bias": "layers.{}.mlp.w2.bias",
    "decoder.layers.{}.final_layer_norm.weight": "layers.{}.mlp_norm.weight",
    "decoder.layers.{}.final_layer_norm.bias": "layers.{}.mlp_norm.bias",
    # The output projection is tied to decoder.embed_tokens.
    "lm_head.weight": None,
}
_TO_HF = {v: k for k, v in _FROM_HF.items() if v is not None}

# The prefix of OPTForCausalLM's keys; checkpoints saved from OPTModel (facebook/opt-*'s
# pytorch_model.bin files) have bare "decoder.*" keys.
HF_PREFIX = "model."

# torchtune module names -> OPT's HF module names, for PEFT's target_modules.
_TO_PEFT_TARGET_MODULES = {
    "q_proj": "q_proj",
    "k_proj": "k_proj",
    "v_proj": "v_proj",
    "output_proj": "out_proj",
    "w1": "fc1",
    "w2": "fc2",
}
_PEFT_PREFIX = "base_model.model." + HF_PREFIX

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def opt_args_from_hf_config(config: Dict[str, Any]) -> Dict[str, Any]:
    """Read the :func:`~squash.models.opt.opt` builder arguments from an HF ``config.json``.

    Args:
        config (Dict[str, Any]): the parsed ``config.json`` of an OPT checkpoint.

    Returns:
        Dict[str, Any]: ``vocab_size``, ``num_layers``, ``num_heads``, ``embed_dim``,
        ``intermediate_dim``, ``max_seq_len``, ``word_embed_proj_dim`` and ``pre_norm``.

    Raises:
        ValueError: if the config is not an OPT config that squash's OPT can express (ReLU, biases,
            affine LayerNorms, a final LayerNorm exactly when pre-norm), or lacks a size or gives
            one that is not a positive integer.
    """
    if config.get("model_type", "opt") != "opt":
        raise ValueError(f"Not an OPT config: model_type={config.get('model_type')!r}")
    unsupported = {
        "activation_function": config.get("activation_function", "relu") != "relu",
        "enable_bias": not config.get("enable_bias", True),
        "layer_norm_elementwise_affine": not config.get("layer_norm_elementwise_affine", True),
        "_remove_final_layer_norm": bool(config.get("_remove_final_layer_norm", False)),
    }
    if any(unsupported.values()):
        bad = {k: config.get(k) for k, v in unsupported.items() if v}
        raise ValueError(f"Unsupported OPT config values: {bad}")
    try:
        args = dict(
            vocab_size=config["vocab_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            embed_dim=config["hidden_size"],
            intermediate_dim=config["ffn_dim"],
            max_seq_len=config["max_position_embeddings"],
            word_embed_proj_dim=config.get("word_embed_proj_dim") or config["hidden_size"],
            pre_norm=config.get("do_layer_norm_before", True),
        )
    except KeyError as e:
        raise ValueError(f"The OPT config lacks {e.args[0]!r}") from e
    hf_names = dict(vocab_size="vocab_size", num_layers="num_hidden_layers",
                    num_heads="num_attention_heads", embed_dim="hidden_size",
                    intermediate_dim="ffn_dim", max_seq_len="max_position_embeddings",
                    word_embed_proj_dim="word_embed_proj_dim")  # fmt: skip
    for name, hf_name in hf_names.items():
        value = args[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"The OPT config's {hf_name} must be a positive integer, got {value!r}"
            )
    if not isinstance(args["pre_norm"], bool):
        raise ValueError(f"The OPT config's do_layer_norm_before must be a bool, got "
                         f"{args['pre_norm']!r}")  # fmt: skip
    return args


def opt_hf_shapes(config: Dict[str, Any]) -> Dict[str, tuple]:
    """The shape of every tensor of an HF OPT checkpoint, keyed without the ``model.`` prefix
    (``lm_head.weight`` not included: it is tied and usually absent).

    Args:
        config (Dict[str, Any]): the parsed ``config.json``.

    Returns:
        Dict[str, tuple]: HF key -> shape.

    Raises:
        ValueError: as :func:`opt_args_from_hf_config`.
    """
    a = opt_args_from_hf_config(config)
    d, w, f = a["embed_dim"], a["word_embed_proj_dim"], a["intermediate_dim"]
    shapes = {
        "decoder.embed_tokens.weight": (a["vocab_size"], w),
        "decoder.embed_positions.weight": (a["max_seq_len"] + 2, d),
    }
    if w != d:
        shapes["decoder.project_in.weight"] = (d, w)
        shapes["decoder.project_out.weight"] = (w, d)
    if a["pre_norm"]:
        shapes["decoder.final_layer_norm.weight"] = shapes["decoder.final_layer_norm.bias"] = (d,)
    layer = {
        "self_attn.q_proj.weight": (d, d),
        "self_attn.k_proj.weight": (d, d),
        "self_attn.v_proj.weight": (d, d),
        "self_attn.out_proj.weight": (d, d),
        "fc1.weight": (f, d),
        "fc1.bias": (f,),
        "fc2.weight": (d, f),
    }
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj",
                 "fc2", "self_attn_layer_norm", "final_layer_norm"):  # fmt: skip
        layer[f"{name}.bias"] = (d,)
    layer["self_attn_layer_norm.weight"] = layer["final_layer_norm.weight"] = (d,)
    for i in range(a["num_layers"]):
        shapes.update({f"decoder.layers.{i}.{k}": v for k, v in layer.items()})
    return shapes


def _template(key: str) -> tuple:
    """``"decoder.layers.3.fc1.weight"`` -> ``("decoder.layers.{}.fc1.weight", "3")``."""
    match = _LAYER_INDEX.search(key)
    if match is None:
        return key, None
    return key[: match.start()] + ".{}." + key[match.end() :], match.group(1)


def _map_keys(
    state_dict: Dict[str, Any], table: Dict[str, Optional[str]], what: str
) -> Dict[str, Any]:
    converted, unknown = {}, []
    for key, value in state_dict.items():
        template, layer = _template(key)
        if template not in table:
            unknown.append(key)
            continue
        new_key = table[template]
        if new_key is not None:
            converted[new_key.format(layer) if layer is not None else new_key] = value
    if unknown:
        raise ValueError(f"Unexpected keys in the {what} state dict: {sorted(unknown)}")
    return converted


def opt_hf_to_tune(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Convert an HF OPT state dict to squash's key names.

    Accepts ``OPTForCausalLM`` keys (``model.decoder.*``) and ``OPTModel`` keys
    (``decoder.*``); drops ``lm_head.weight``, which is tied to the token embedding.

    Args:
        state_dict (Dict[str, torch.Tensor]): HF state dict.

    Returns:
        Dict[str, torch.Tensor]: squash state dict (same tensors, new keys).

    Raises:
        ValueError: naming every key that is not an OPT key.
    """
    stripped = {
        (k[len(HF_PREFIX) :] if k.startswith(HF_PREFIX) else k): v for k, v in state_dict.items()
    }
    if len(stripped) != len(state_dict):
        raise ValueError("The HF state dict has the same key with and without the 'model.' prefix")
    return _map_keys(stripped, _FROM_HF, "HF OPT")


def opt_tune_to_hf(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Convert a squash OPT state dict to ``OPTForCausalLM`` key names (``model.decoder.*``).

    ``lm_head.weight`` is not written: as in the checkpoints transformers saves, it is tied to
    ``model.decoder.embed_tokens.weight`` and restored on load.

    Args:
        state_dict (Dict[str, torch.Tensor]): squash state dict (no adapter keys; merge LoRA
            first, e.g. with ``torchtune.modules.peft.get_merged_lora_ckpt``).

    Returns:
        Dict[str, torch.Tensor]: HF state dict.

    Raises:
        ValueError: naming every key that is not an OPT key.
    """
    converted = _map_keys(state_dict, _TO_HF, "squash OPT")
    return {HF_PREFIX + k: v for k, v in converted.items()}


def opt_tune_to_peft_adapter_weights(
    state_dict: Dict[str, torch.Tensor],
) -> Dict[str, torch.Tensor]:
    """Convert squash LoRA adapter weights to PEFT's key names for ``OPTForCausalLM``.

    ``layers.0.attn.q_proj.lora_a.weight`` becomes
    ``base_model.model.model.decoder.layers.0.self_attn.q_proj.lora_A.weight``.

    Args:
        state_dict (Dict[str, torch.Tensor]): adapter state dict (``lora_a.weight`` and
            ``lora_b.weight`` entries).

    Returns:
        Dict[str, torch.Tensor]: PEFT adapter state dict.

    Raises:
        ValueError: naming every key that is not a dense LoRA parameter of an OPT linear.
    """
    table = {}
    for tune_key, hf_key in _TO_HF.items():
        if not tune_key.endswith(".weight"):
            continue
        base_tune, base_hf = tune_key[: -len(".weight")], _PEFT_PREFIX + hf_key[: -len(".weight")]
        table[f"{base_tune}.lora_a.weight"] = f"{base_hf}.lora_A.weight"
        table[f"{base_tune}.lora_b.weight"] = f"{base_hf}.lora_B.weight"
    return _map_keys(state_dict, table, "adapter")


def opt_adapter_layout(
    state_dict: Dict[str, torch.Tensor], config: Dict[str, Any]
) -> Dict[str, AdapterLayout]:
    """Check a squash adapter state dict for the OPT of ``config`` and say how wide each factor
    is, for :func:`squash.modules.adapter.dense_adapter` (the one FFI -> dense conversion).

    Every key is ``X.lora_a.*`` or ``X.lora_b.*`` of an OPT linear ``X``
    (``layers.0.attn.q_proj``, ...), each factor either dense (``.weight``) or FFI (``.values``
    and ``.indices``). ``lora_a`` is as wide as ``X``'s input (from ``config``), ``lora_b`` as the
    rank (the rows of ``X``'s ``lora_a``).

    Args:
        state_dict (Dict[str, torch.Tensor]): adapter state dict with squash keys.
        config (Dict[str, Any]): the parsed HF ``config.json``.

    Returns:
        Dict[str, AdapterLayout]: module name -> rank and factor widths (``alpha`` None: the
        tensors do not say it, and the conversion does not need it).

    Raises:
        ValueError: a ``values`` without its ``indices`` (or the reverse), a factor without its
            partner factor, a key that is not a LoRA factor of a linear OPT has, a factor of
            the wrong shape, or indices that break the FFI format (naming the key).
    """
    shapes = opt_hf_shapes(config)
    factors: Dict[str, Dict[str, torch.Tensor]] = {}  # "layers.0.attn.q_proj.lora_a" -> parts
    unknown = []
    for key, value in state_dict.items():
        factor, _, part = key.rpartition(".")
        if part in ("weight", "values", "indices") and factor.endswith((".lora_a", ".lora_b")):
            factors.setdefault(factor, {})[part] = value
        else:
            unknown.append(key)
    modules = sorted({factor.rsplit(".", 1)[0] for factor in factors})
    hf_weight = {}  # module -> the HF key of the weight it adapts
    for base in modules:
        template, layer = _template(f"{base}.weight")
        hf_key = _TO_HF.get(template)
        hf_key = hf_key.format(layer) if hf_key is not None and layer is not None else hf_key
        if hf_key not in shapes:
            unknown += [k for k in state_dict if k.startswith(f"{base}.lora_")]
        hf_weight[base] = hf_key
    if unknown:
        raise ValueError(f"Unexpected keys in the adapter state dict: {sorted(unknown)}")
    for factor, parts in sorted(factors.items()):
        if "weight" not in parts and set(parts) != {"values", "indices"}:
            raise ValueError(f"The adapter has {factor}.{next(iter(parts))} without its partner")
        if "weight" in parts and len(parts) > 1:
            raise ValueError(f"The adapter has {factor} both dense and FFI: {sorted(parts)}")
    layout = {}
    for base in modules:
        a, b = factors.get(f"{base}.lora_a"), factors.get(f"{base}.lora_b")
        if a is None or b is None:
            have, lacks = ("lora_a", "lora_b") if b is None else ("lora_b", "lora_a")
            raise ValueError(f"The adapter has {base}.{have} but no {base}.{lacks}")
        out_dim, in_dim = shapes[hf_weight[base]]
        rank = (a["weight"] if "weight" in a else a["values"]).shape[0]
        for name, rows, width, parts in (("lora_a", rank, in_dim, a), ("lora_b", out_dim, rank, b)):
            dense = parts.get("weight")
            if dense is None:
                validate_ffi(parts["values"], parts["indices"], width,
                             where=f"adapter key {base}.{name}")  # fmt: skip
            got = tuple(dense.shape) if dense is not None else (parts["values"].shape[0], width)
            if got != (rows, width):
                raise ValueError(
                    f"The adapter's {base}.{name} is {got}, the OPT of config.json takes "
                    f"{(rows, width)} at rank {rank}"
                )
        layout[base] = AdapterLayout(rank=rank, alpha=None, in_features=(in_dim, rank))
    return layout


def opt_tune_to_peft_adapter_config(
    adapter_config: Dict[str, Any], base_model_name_or_path: Optional[str] = None
) -> Dict[str, Any]:
    """Turn a torchtune adapter config into PEFT's ``adapter_config.json`` for OPT.

    Args:
        adapter_config (Dict[str, Any]): at least ``r``, ``lora_alpha`` and ``target_modules``
            (torchtune module names, e.g. from ``torchtune.modules.peft.get_lora_module_names``;
            ``w3``, which OPT does not have, is ignored).
        base_model_name_or_path (Optional[str]): written into the config when given.

    Returns:
        Dict[str, Any]: a new config with OPT's module names, ``peft_type`` and ``task_type``.

    Raises:
        ValueError: if a required key is missing or a target module is unknown (``output``: OPT's
            output projection is tied and cannot carry an adapter).
    """
    missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in adapter_config]
    if missing:
        raise ValueError(f"The adapter config lacks {missing}: {adapter_config}")
    modules: List[str] = [m for m in adapter_config["target_modules"] if m != "w3"]
    unknown = [m for m in modules if m not in _TO_PEFT_TARGET_MODULES]
    if unknown:
        raise ValueError(f"Unknown target modules for OPT: {unknown}")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", **adapter_config}
    config["target_modules"] = [_TO_PEFT_TARGET_MODULES[m] for m in modules]
    if base_model_name_or_path:
        config["base_model_name_or_path"] = base_model_name_or_path
    return config
