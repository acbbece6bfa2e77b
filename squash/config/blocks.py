"""squash's own config blocks, parsed and checked: ``mask_update`` (when masks move),
``heldout`` (the held-out report) and the ``model`` block as its builder takes it (without the
keys the assembly reads). Every error names the key at fault."""

import inspect
from typing import Any, Dict, Mapping, Optional

from omegaconf import DictConfig, OmegaConf

from squash.config.keys import (
    MODEL_ASSEMBLY_KEYS,
    ConfigKeyError,
    check_component,
    check_keys,
    get_int,
)


MASK_UPDATE_KEYS = frozenset({"every_n_steps", "drop_fraction", "until_step"})


def parse_mask_update(block: Optional[Mapping]) -> Optional[Dict[str, Any]]:
    """The ``mask_update`` block as ``{every_n_steps, until_step, drop_fraction}`` (None when
    absent: a static mask); ``drop_fraction`` defaults to 0.3.

    Raises:
        ConfigKeyError: an unknown key, a missing ``every_n_steps``/``until_step``, a bad value.
    """
    if block is None:
        return None
    check_keys(block, MASK_UPDATE_KEYS, where="mask_update")
    every = get_int(block, "every_n_steps", None, minimum=1, where="mask_update")
    until = get_int(block, "until_step", None, minimum=1, where="mask_update")
    if every is None or until is None:
        raise ConfigKeyError("mask_update needs every_n_steps and until_step")
    drop = block.get("drop_fraction", 0.3)
    if isinstance(drop, bool) or not isinstance(drop, (int, float)) or not 0.0 < drop < 1.0:
        raise ConfigKeyError(f"mask_update.drop_fraction must be in (0, 1), got {drop!r}")
    return {"every_n_steps": every, "until_step": until, "drop_fraction": float(drop)}


def builder_block(cfg_model: DictConfig) -> DictConfig:
    """``cfg_model`` as its builder takes it: without the assembly's keys
    (:data:`MODEL_ASSEMBLY_KEYS`), and with ``init: lora`` for a builder that takes ``init``
    when the block sets one (the assembly applies ``svd`` and ``loftq`` to the loaded
    weights)."""
    from torchtune.config._utils import _get_component_from_path

    block = OmegaConf.masked_copy(cfg_model, [k for k in cfg_model if k not in MODEL_ASSEMBLY_KEYS])
    if "init" in cfg_model:
        try:
            params = inspect.signature(_get_component_from_path(cfg_model._component_)).parameters
        except Exception:  # the component is checked, and named, where it is built
            params = {}
        if "init" in params:
            block.init = "lora"
    return block


HELDOUT_KEYS = frozenset(
    {"dataset", "batch_size", "prompt_index", "max_new_tokens", "exact_match_samples"}
)


def parse_heldout(block: Optional[Any]) -> Optional[Dict[str, Any]]:
    """The ``heldout`` block's settings (None when absent), checked.

    Raises:
        ConfigKeyError: an unknown key, no ``dataset``, a bad value, naming the key.
    """
    if block is None:
        return None
    if not isinstance(block, DictConfig):
        block = OmegaConf.create(block)
    check_keys(block, HELDOUT_KEYS, where="heldout")
    if block.get("dataset") is None:
        raise ConfigKeyError("heldout needs a dataset block (heldout.dataset)")
    check_component(block["dataset"], "heldout.dataset", positional=1)
    return {
        "dataset": block["dataset"],
        "batch_size": get_int(block, "batch_size", 8, minimum=1, where="heldout"),
        "prompt_index": get_int(block, "prompt_index", 0, minimum=0, where="heldout"),
        "max_new_tokens": get_int(block, "max_new_tokens", 32, minimum=1, where="heldout"),
        "exact_match_samples": get_int(block, "exact_match_samples", 0, minimum=0, where="heldout"),
    }
