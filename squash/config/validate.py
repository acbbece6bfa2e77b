"""A whole config checked without building anything: what ``squash validate`` runs."""

from typing import Iterable

from omegaconf import DictConfig, ListConfig, OmegaConf

from squash.config.blocks import parse_heldout, parse_mask_update
from squash.config.keys import check_component, check_keys
from squash.config.values import check_value_types

# Blocks whose component the recipes call with a positional argument first (a dataset's
# tokenizer, an optimizer's parameters, a scheduler's optimizer).
POSITIONAL_ARGS = {"dataset": 1, "optimizer": 1, "lr_scheduler": 1}


def validate_config(cfg: DictConfig, valid_keys: Iterable[str]) -> None:
    """squash's own checks of a whole config, without building anything (``squash validate``):
    every top-level key is one the recipe reads, every interpolation resolves, every
    ``_component_`` block imports and accepts its keys, every value has its type and range
    (:func:`check_value_types`), and ``mask_update`` and ``heldout`` are well-formed.

    Args:
        cfg (DictConfig): the config (overrides merged).
        valid_keys (Iterable[str]): the recipe's top-level keys (its ``CONFIG_KEYS``).

    Raises:
        ConfigKeyError: naming the first key at fault.
        omegaconf.errors.OmegaConfBaseException: an interpolation that does not resolve.
    """
    check_keys(cfg, valid_keys)
    OmegaConf.to_container(cfg, resolve=True)
    for key, value in cfg.items():
        if isinstance(value, DictConfig) and "_component_" in value:
            check_component(value, key, positional=POSITIONAL_ARGS.get(key, 0))
        elif isinstance(value, ListConfig) and len(value) and all(
            isinstance(v, DictConfig) and "_component_" in v for v in value
        ):
            check_component(value, key, positional=POSITIONAL_ARGS.get(key, 0))
    check_value_types(cfg)
    parse_mask_update(cfg.get("mask_update", None))
    parse_heldout(cfg.get("heldout", None))
