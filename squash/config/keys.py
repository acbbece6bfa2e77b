"""Config keys and components, checked before anything is built; every error names the key.

A misspelled key (``batch_szie``) is not silently ignored, as a plain ``cfg.get`` would: the
recipe lists the keys it reads, and :func:`check_keys` names each unknown one with the nearest
valid key. Components (blocks with ``_component_``) are checked against the signature of what
they name, before anything is built. :class:`ConfigKeyError` is the one error every config
check raises.
"""

import difflib
import inspect
import typing
from typing import Any, Iterable, Mapping, Optional

from omegaconf import DictConfig, ListConfig

# Every top-level key the fine-tuning recipes read: torchtune's LoRA recipe keys plus squash's own.
FINETUNE_CONFIG_KEYS = frozenset({
    "output_dir", "model", "tokenizer", "checkpointer", "dataset", "seed", "shuffle",
    "batch_size", "collate_fn", "optimizer", "lr_scheduler", "loss", "epochs",
    "max_steps_per_epoch", "gradient_accumulation_steps", "clip_grad_norm", "compile", "device",
    "dtype", "enable_activation_checkpointing", "enable_activation_offloading", "metric_logger",
    "log_every_n_steps", "log_peak_memory_stats", "profiler", "resume_from_checkpoint",
    "save_adapter_weights_only", "save_every_n_steps", "keep_last_n", "mask_update",
    "low_cpu_ram", "cudnn_deterministic_mode", "resume_allow_config_change", "lora_plus_lr_ratio",
})  # fmt: skip

# Keys of the ``model`` block the assembly reads, not the builder: how the adapters start.
MODEL_ASSEMBLY_KEYS = ("init", "loftq_iterations")


class ConfigKeyError(ValueError):
    """A config key that is unknown, missing or holds a bad value; the message names it."""


def _nearest(key: str, valid: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_keys(cfg: Mapping, valid: Iterable[str], where: str = "") -> None:
    """Raise if ``cfg`` has a key that is not in ``valid``.

    Args:
        cfg (Mapping): a config block.
        valid (Iterable[str]): the keys the reader of this block understands.
        where (str): the block's dotted path, for the message (``""`` for the top level).

    Raises:
        ConfigKeyError: naming each unknown key and the nearest valid one.
    """
    valid = set(valid)
    unknown = [k for k in cfg.keys() if k not in valid]
    if unknown:
        lines = [f"{where + '.' if where else ''}{k}{_nearest(k, valid)}" for k in unknown]
        raise ConfigKeyError("Unknown config key(s): " + "; ".join(lines))


def check_component(node: Any, where: str, *, positional: int = 0) -> None:
    """Check a ``_component_`` block: its target imports and accepts the block's keys.

    Args:
        node (Any): the config block (``DictConfig`` with ``_component_``); a ``ListConfig`` of
            such blocks is checked item by item.
        where (str): the block's dotted path (``"model"``, ``"dataset"``).
        positional (int): arguments the recipe passes positionally (a dataset's tokenizer, an
            optimizer's parameters), which the block must not also set.

    Raises:
        ConfigKeyError: naming the block and the key (with the nearest accepted argument), or the
            component path that does not import.
    """
    if isinstance(node, ListConfig):
        for i, item in enumerate(node):
            check_component(item, f"{where}[{i}]", positional=positional)
        return
    if not isinstance(node, (DictConfig, Mapping)) or "_component_" not in node:
        raise ConfigKeyError(f"Config block {where!r} needs a _component_")
    from torchtune.config._utils import _get_component_from_path

    path = node["_component_"]
    try:
        target = _get_component_from_path(path)
    except Exception as e:
        raise ConfigKeyError(f"{where}._component_: cannot import {path!r}: {e}") from e
    try:
        params = dict(inspect.signature(target).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    names = [n for n, p in params.items() if p.kind is not p.VAR_POSITIONAL][positional:]
    for key in node.keys():
        if where == "model" and key in MODEL_ASSEMBLY_KEYS:
            continue  # the assembly reads it (blocks.builder_block), whatever the builder takes
        if key != "_component_" and key not in names:
            raise ConfigKeyError(
                f"{where}.{key}: {path} takes no argument {key!r}{_nearest(key, names)}"
            )
        if key != "_component_" and isinstance(node[key], str) and _takes_number(params[key]):
            raise ConfigKeyError(
                f"{where}.{key} must be a number ({path} takes a number there), got {node[key]!r}"
            )


def get_int(cfg: Mapping, key: str, default: Optional[int], *, minimum: int, where: str = "") -> Optional[int]:
    """An integer config value ``>= minimum`` (or ``default`` when absent or null).

    Raises:
        ConfigKeyError: naming the key, if the value is not such an integer.
    """
    value = cfg.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigKeyError(
            f"{where + '.' if where else ''}{key} must be an integer >= {minimum}, got {value!r}"
        )
    return value


def _takes_number(param: inspect.Parameter) -> bool:
    """Whether a parameter takes a number and no string: from its annotation (``float``,
    ``Optional[int]``, ``Union[float, Tensor]``) or else from a numeric default."""
    ann = param.annotation
    if ann is not inspect.Parameter.empty and not isinstance(ann, str):
        args = set(typing.get_args(ann)) or {ann}
        return bool(args & {int, float}) and str not in args
    default = param.default
    return isinstance(default, (int, float)) and not isinstance(default, bool)
