"""The corrected 4-bit base of an assembled model (config ``model.base_outliers``): calibration
and the split of each loaded base weight into ``NF4(W - S)`` and the outliers ``S``.

For the ``"sensitivity"`` criterion each projection's outliers are scored by the NF4 error
squared times the second moment of the projection's input features (SpQR's saliency with a
diagonal Hessian), measured once, before anything is quantized, on the unquantized model:
:func:`calibration_tokens` cuts the train split of squash's Python Language Reference text
(:func:`squash.datasets.pydoc_text.pydoc_text`, built at run time from the standard library, the
text ``benchmarks/nf4_bases.py`` calibrates on) into ``samples`` windows of ``max_seq_len``
tokens of the run's tokenizer, and :func:`second_moments` hooks the inputs of the named linears
(:class:`~squash.nf4.SecondMoment`). :func:`apply_base_outliers_` then splits each loaded
weight (:func:`~squash.nf4.base_outliers.set_corrected_base_`).

Everything here is deterministic given the base weights, the config and the tokenizer, so a
resume, an evaluation or an export rebuilds the same ``S`` from the base: no checkpoint holds it.
"""

from functools import partial
from typing import Any, Dict, Iterable, Mapping, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torchtune import config, training

from squash.config.blocks import builder_block
from squash.config.keys import ConfigKeyError
from squash.modules.adapter import state_dict_key
from squash.nf4 import SecondMoment
from squash.nf4.base_outliers import outlier_modules, parse_base_outliers, set_corrected_base_
from squash.nf4.sharding import shard_nf4_like

__all__ = [
    "apply_base_outliers_",
    "calibration_tokens",
    "input_width",
    "model_second_moments",
    "second_moments",
]


def calibration_tokens(tokenizer: Any, samples: int, max_seq_len: int) -> torch.Tensor:
    """The first ``samples`` windows of ``max_seq_len`` tokens of the pydoc train split,
    ``(n, max_seq_len)`` with ``n = min(samples, tokens // max_seq_len)``.

    Args:
        tokenizer (Any): a torchtune tokenizer (``encode(text, add_bos=..., add_eos=...)``).
        samples (int): windows wanted.
        max_seq_len (int): tokens a window.

    Raises:
        ValueError: a text too short for one window.
    """
    from squash.datasets.pydoc_text import pydoc_text

    ids = tokenizer.encode(pydoc_text("train"), add_bos=False, add_eos=False)
    n = min(samples, len(ids) // max_seq_len)
    if n < 1:
        raise ValueError(f"the calibration text has {len(ids)} tokens, no window of "
                         f"{max_seq_len}")  # fmt: skip
    return torch.tensor(ids[: n * max_seq_len]).view(n, max_seq_len)


def input_width(module: nn.Module) -> int:
    """The input features of a linear (``in_features``) or a LoRA module (``in_dim``)."""
    return getattr(module, "in_features", None) or module.in_dim


@torch.no_grad()
def second_moments(
    model: nn.Module, batches: Iterable[torch.Tensor], names: Iterable[str]
) -> Dict[str, torch.Tensor]:
    """``{name: (in,)}``: the mean of ``x_j^2`` over every token the input ``x`` of each named
    module sees while ``model(batch)`` runs for each batch (float64 sums, float32 result).

    Raises:
        ValueError: a named module that saw no token.
    """
    mods = dict(model.named_modules())
    stats, hooks = {}, []
    for name in names:
        stats[name] = SecondMoment(input_width(mods[name]))
        hooks.append(mods[name].register_forward_pre_hook(
            lambda _m, args, s=stats[name]: s.update(args[0])))  # fmt: skip
    try:
        for batch in batches:
            model(batch)
    finally:
        for h in hooks:
            h.remove()
    return {name: s.value().float() for name, s in stats.items()}


def model_second_moments(
    cfg_model: Mapping,
    base_state_dict: Dict[str, torch.Tensor],
    names: Iterable[str],
    tokenizer: Any,
    *,
    device: torch.device,
    dtype: torch.dtype,
    batch_size: int = 8,
) -> Dict[str, torch.Tensor]:
    """Second moments of the inputs of the modules ``names`` of the model of ``cfg_model`` built
    unquantized (``quantize_base: false``, no outliers, adapters disabled) with
    ``base_state_dict``, over :func:`calibration_tokens` of ``model.base_outliers.calibration``.
    The unquantized model is freed before this returns.

    Raises:
        ConfigKeyError: no tokenizer to cut the calibration text with.
    """
    cal = parse_base_outliers(cfg_model.get("base_outliers"), "model.base_outliers")["calibration"]
    if tokenizer is None:
        raise ConfigKeyError("model.base_outliers.criterion: sensitivity needs the run's "
                             "tokenizer for its calibration text; none was given here")  # fmt: skip
    tokens = calibration_tokens(tokenizer, cal["samples"], cal["max_seq_len"]).to(device)
    overrides = {"quantize_base": False, "base_outliers": None}
    with training.set_default_dtype(dtype), torch.device(device):
        model = config.instantiate(builder_block(cfg_model), **overrides)
    missing, unexpected = model.load_state_dict(base_state_dict, strict=False)
    missing = [k for k in missing if ".lora_" not in k]
    if missing or unexpected:
        raise ValueError(f"calibration model: missing {missing[:5]}, unexpected "
                         f"{list(unexpected)[:5]}")  # fmt: skip
    for m in model.modules():
        if hasattr(m, "disabled"):
            m.disabled = True  # the base alone
    model.eval()
    moments = second_moments(model, tokens.split(batch_size), names)
    del model
    return moments


@torch.no_grad()
def apply_base_outliers_(
    model: nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    moments: Optional[Dict[str, torch.Tensor]] = None,
    device: Optional[torch.device] = None,
) -> int:
    """Split the dense base weight of each module of ``model`` with a ``base_outliers`` setting
    (``state_dict[<name>.weight]``) into its corrected base (see
    :func:`~squash.nf4.base_outliers.set_corrected_base_`).

    In a model sharded by FSDP2 (and not yet run: FSDP2 takes the new parameters at its lazy
    init, as after :func:`~squash.assembly.fsdp.load_full_state_dict`) each process splits
    the full weight, as one device does, and keeps its row shard of the NF4 base; ``S`` is kept
    whole on every process, on ``device``.

    Args:
        model (nn.Module): the loaded model (NF4 bases in place).
        state_dict (Mapping[str, torch.Tensor]): the dense weights it was loaded from (with
            ``init: svd``, the residuals).
        moments (Optional[Dict[str, torch.Tensor]]): :func:`model_second_moments` by module
            name, for the ``"sensitivity"`` criterion.
        device (Optional[torch.device]): the compute device (default: each weight's own; give it
            for a sharded model whose shards are offloaded to the CPU).

    Returns:
        int: how many bases were split.

    Raises:
        ValueError: a weight missing from ``state_dict``.
    """
    count = 0
    for name, module in outlier_modules(model).items():
        key = f"{state_dict_key(name)}.weight"
        if key not in state_dict:
            raise ValueError(f"{key}: no dense base weight to split into NF4 and outliers")
        moment = None
        if module.base_outliers["criterion"] == "sensitivity":
            moment = moments[name]
        place = None
        if isinstance(module.weight, DTensor):
            place = partial(shard_nf4_like, module.weight)
        set_corrected_base_(module, state_dict[key], moment, name=key, device=device, place=place)
        count += 1
    return count
