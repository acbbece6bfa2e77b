"""A whole config checked without building anything: what ``squash validate`` runs, and the
part of it every recipe runs first (:func:`load_config`, :func:`check_config`), so that
``squash validate`` refuses what ``tune run`` refuses before building, with the same line."""

from pathlib import Path
from typing import Iterable, Sequence

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from squash.config.blocks import parse_heldout, parse_mask_update
from squash.config.keys import ConfigKeyError, check_component, check_keys
from squash.config.values import check_value_types, check_values

# Blocks whose component the recipes call with a positional argument first (a dataset's
# tokenizer, an optimizer's parameters, a scheduler's optimizer).
POSITIONAL_ARGS = {"dataset": 1, "optimizer": 1, "lr_scheduler": 1}


def load_config(path: str, overrides: Sequence[str] = ()) -> DictConfig:
    """The config file ``path`` as ``tune run`` reads it (``key=value`` ``overrides`` merged),
    or one line saying why it is not a config: what a recipe's entry point checks before
    torchtune's parser reads the file (whose own errors are tracebacks), and what ``squash
    validate`` reads.

    Raises:
        ConfigKeyError: ``path`` is missing, a directory, not valid YAML, a YAML list, or
            empty; naming the file.
    """
    where = f"config file {path}"
    if Path(path).is_dir():
        raise ConfigKeyError(f"{where} is a directory; give a YAML config file")
    if not Path(path).is_file():
        raise ConfigKeyError(f"{where} does not exist")
    try:
        cfg = OmegaConf.load(path)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(err, "problem", None) or " ".join(str(err).split())
        raise ConfigKeyError(f"{where} is not valid YAML: {problem}{at}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigKeyError(f"{where} cannot be read ({err})") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigKeyError(
            f"{where} holds a YAML list, not a mapping of config keys (model: ..., tokenizer: ...)"
        )
    if len(cfg) == 0:
        raise ConfigKeyError(
            f"{where} is empty: a config is a YAML mapping of keys (model: ..., tokenizer: ...)"
        )
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides))) if overrides else cfg


def check_config(
    cfg: DictConfig, valid_keys: Iterable[str], required: Iterable[str] = (), *, files: bool = True
) -> None:
    """What every recipe checks first, before it builds or writes anything, and ``squash
    validate`` too: every top-level key is one the recipe reads (:func:`check_keys`), every
    value has its type and range (:func:`check_values`; with ``files=False``,
    :func:`check_value_types`, which reads no file and needs no device), and each ``required``
    key is given.

    Raises:
        ConfigKeyError: naming the first key at fault (``Missing config key: KEY``).
    """
    check_keys(cfg, valid_keys)
    (check_values if files else check_value_types)(cfg)
    for key in required:
        if cfg.get(key) is None:
            raise ConfigKeyError(f"Missing config key: {key}")


def validate_config(cfg: DictConfig, valid_keys: Iterable[str], required: Iterable[str] = ()) -> None:
    """squash's own checks of a whole config, without building anything (``squash validate``):
    :func:`check_config` (without its file checks: a config may name files of another machine),
    then every interpolation resolves, every ``_component_`` block imports and accepts its keys,
    and ``mask_update`` and ``heldout`` are well-formed.

    Args:
        cfg (DictConfig): the config (overrides merged).
        valid_keys (Iterable[str]): the recipe's top-level keys (its ``CONFIG_KEYS``).
        required (Iterable[str]): the keys the recipe needs (its ``REQUIRED_KEYS``).

    Raises:
        ConfigKeyError: naming the first key at fault.
        omegaconf.errors.OmegaConfBaseException: an interpolation that does not resolve.
    """
    check_config(cfg, valid_keys, required, files=False)
    OmegaConf.to_container(cfg, resolve=True)
    for key, value in cfg.items():
        if isinstance(value, DictConfig) and "_component_" in value:
            check_component(value, key, positional=POSITIONAL_ARGS.get(key, 0))
        elif isinstance(value, ListConfig) and len(value) and all(
            isinstance(v, DictConfig) and "_component_" in v for v in value
        ):
            check_component(value, key, positional=POSITIONAL_ARGS.get(key, 0))
    parse_mask_update(cfg.get("mask_update", None))
    parse_heldout(cfg.get("heldout", None))
