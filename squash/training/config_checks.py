"""Config checks shared by squash's recipes: every error names the key at fault.

A misspelled key (``batch_szie``) is not silently ignored, as a plain ``cfg.get`` would: the
recipe lists the keys it reads, and :func:`check_keys` names each unknown one with the nearest
valid key. Components (blocks with ``_component_``) are checked against the signature of what
they name, before anything is built.
"""

import difflib
import inspect
import json
import math
import typing
from pathlib import Path
from typing import Any, Dict, Iterable, Mapping, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

from squash._io import to_plain


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
MASK_UPDATE_KEYS = frozenset({"every_n_steps", "drop_fraction", "until_step"})
# Keys of the ``model`` block the assembly reads, not the builder: how the adapters start.
MODEL_ASSEMBLY_KEYS = ("init", "loftq_iterations")
# ``model.init``: the builders' own (lora, svd) and the assembly's LoftQ.
MODEL_INITS = ("lora", "svd", "loftq")


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
            continue  # the assembly's (:func:`builder_block`), whatever the builder takes
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


def _takes_number(param: inspect.Parameter) -> bool:
    """Whether a parameter takes a number and no string: from its annotation (``float``,
    ``Optional[int]``, ``Union[float, Tensor]``) or else from a numeric default."""
    ann = param.annotation
    if ann is not inspect.Parameter.empty and not isinstance(ann, str):
        args = set(typing.get_args(ann)) or {ann}
        return bool(args & {int, float}) and str not in args
    default = param.default
    return isinstance(default, (int, float)) and not isinstance(default, bool)


def _number(cfg: Mapping, key: str, *, positive: bool) -> None:
    value = cfg.get(key, None)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and not value > 0):
        raise ConfigKeyError(
            f"{key} must be a number{' > 0' if positive else ''} or null, got {value!r}"
        )


_LOCAL_LOADERS = ("json", "csv", "parquet", "text", "arrow")


def _check_data_files(node: Mapping, where: str) -> None:
    if not isinstance(node, Mapping) or node.get("source") not in _LOCAL_LOADERS:
        return
    files = node.get("data_files")
    if isinstance(files, Mapping):
        files = [f for v in files.values() for f in (v if isinstance(v, (list, ListConfig)) else [v])]
    elif not isinstance(files, (list, ListConfig)):
        files = [files]
    for f in files:
        if not isinstance(f, str) or any(c in f for c in "*?["):
            continue  # a glob: the loader reports what it matches
        path = Path(f)
        if not path.is_file():
            raise ConfigKeyError(f"{where}.data_files: {f} does not exist (or is not a file)")
        if path.stat().st_size == 0:
            raise ConfigKeyError(f"{where}.data_files: {f} is empty (0 bytes)")
        if node.get("source") == "json" and path.suffix in (".json", ".jsonl"):  # not .gz etc.
            _parse_json(path, f"{where}.data_files", lines_ok=True)


def check_values(cfg: Mapping) -> None:
    """Values every recipe reads before it builds anything, checked where they are given:
    ``device`` (a GPU device needs a GPU), ``seed``, ``clip_grad_norm``, the true/false keys
    (:data:`BOOLEAN_KEYS`: a string such as ``nope`` is refused, not read as true), the counts
    (:data:`COUNT_KEYS`, ``lr_scheduler.num_warmup_steps``), ``optimizer.lr`` (finite, > 0),
    the adapter values of ``model`` (:func:`check_model_values`), ``tokenizer.max_seq_len`` and
    the tokenizer's files (JSON that parses, a ``merges.txt`` with merges), the local files of
    ``dataset`` (present, not empty, JSON data that parses) and the dtype of each safetensors
    file of ``checkpointer`` against its ``config.json``. Other numbers inside components are
    checked by :func:`check_component`. Nothing is written: a recipe calls this first.

    Raises:
        ConfigKeyError: naming the key (or the file) and what it must be.
    """
    import torch

    device = cfg.get("device", None)
    if isinstance(device, str) and device.split(":")[0] in ("cuda", "rocm", "hip"):
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else (
                f"ROCm {torch.version.hip}" if torch.version.hip else "CPU only")
            raise ConfigKeyError(
                f"device: {device}, but this machine has no usable GPU "
                f"(torch.cuda.is_available() is False; torch {torch.__version__}, {build}); "
                "use device: cpu or install a GPU build of torch"
            )
    check_value_types(cfg)
    tokenizer = cfg.get("tokenizer", None)
    if isinstance(tokenizer, Mapping):
        _check_tokenizer_files(tokenizer)
    dataset = cfg.get("dataset", None)
    nodes = list(dataset) if isinstance(dataset, (list, ListConfig)) else [dataset]
    for i, node in enumerate(nodes):
        _check_data_files(node, f"dataset[{i}]" if isinstance(dataset, (list, ListConfig)) else "dataset")
    checkpointer = cfg.get("checkpointer", None)
    if isinstance(checkpointer, Mapping) and isinstance(checkpointer.get("checkpoint_dir"), str):
        from squash._checks import check_safetensors_dtypes

        files = checkpointer.get("checkpoint_files", None)
        if isinstance(files, (list, ListConfig)) and all(isinstance(f, str) for f in files):
            try:
                check_safetensors_dtypes(Path(checkpointer.checkpoint_dir), list(files))
            except ValueError as e:
                raise ConfigKeyError(f"checkpointer.checkpoint_files: {e}") from e


def check_value_types(cfg: Mapping) -> None:
    """The type and range of each value :func:`check_values` checks that needs no file and no
    device (``squash validate`` runs these too): ``seed``, ``clip_grad_norm``, the true/false
    keys, the counts, ``optimizer.lr``, ``lr_scheduler.num_warmup_steps``, the adapter values
    of ``model`` and ``tokenizer.max_seq_len``.

    Raises:
        ConfigKeyError: naming the key and what it must be.
    """
    get_int(cfg, "seed", None, minimum=0)
    _number(cfg, "clip_grad_norm", positive=True)
    for key in BOOLEAN_KEYS:
        _boolean(cfg, key)
    for key, minimum in COUNT_KEYS.items():
        get_int(cfg, key, None, minimum=minimum)
    _check_optimizer(cfg.get("optimizer", None))
    scheduler = cfg.get("lr_scheduler", None)
    if isinstance(scheduler, Mapping):
        get_int(scheduler, "num_warmup_steps", None, minimum=0, where="lr_scheduler")
    model = cfg.get("model", None)
    if isinstance(model, Mapping):
        check_model_values(model)
    tokenizer = cfg.get("tokenizer", None)
    if isinstance(tokenizer, Mapping):
        get_int(tokenizer, "max_seq_len", None, minimum=1, where="tokenizer")
    dataset = cfg.get("dataset", None)
    nodes = list(dataset) if isinstance(dataset, (list, ListConfig)) else [dataset]
    for i, node in enumerate(nodes):
        if isinstance(node, Mapping):
            where = f"dataset[{i}]" if isinstance(dataset, (list, ListConfig)) else "dataset"
            for key in DATASET_BOOLEAN_KEYS:
                _boolean(node, key, where)


# Keys the recipes read as true/false: a string there ('nope') would count as true.
BOOLEAN_KEYS = (
    "shuffle", "compile", "resume_from_checkpoint", "save_adapter_weights_only",
    "enable_activation_checkpointing", "enable_activation_offloading", "log_peak_memory_stats",
    "resume_allow_config_change", "low_cpu_ram", "fsdp_cpu_offload", "fsdp_reshard_after_forward",
)  # fmt: skip
MODEL_BOOLEAN_KEYS = ("apply_lora_to_mlp", "apply_lora_to_output", "quantize_base", "use_dora")
DATASET_BOOLEAN_KEYS = ("packed", "train_on_input")
# Counts and the least value each may take (absent or null: the recipe's default).
COUNT_KEYS = {
    "epochs": 1, "batch_size": 1, "max_steps_per_epoch": 1, "gradient_accumulation_steps": 1,
    "save_every_n_steps": 1, "keep_last_n": 1, "log_every_n_steps": 1,
}  # fmt: skip


def _boolean(cfg: Mapping, key: str, where: str = "") -> None:
    value = cfg.get(key, None)
    if value is not None and not isinstance(value, bool):
        raise ConfigKeyError(
            f"{where + '.' if where else ''}{key} must be true or false, got {value!r}"
        )


def _check_optimizer(node: Any) -> None:
    if not isinstance(node, Mapping) or "lr" not in node:
        return
    lr = node.get("lr")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ConfigKeyError(f"optimizer.lr must be a number, finite and > 0, got {lr!r}")


def check_model_values(model: Mapping, where: str = "model") -> None:
    """The adapter values of a ``model`` block, where present: ``lora_rank`` an integer >= 1,
    ``lora_alpha`` a finite number, ``lora_dropout`` and ``sparsity`` in [0, 1),
    ``sparse_factor`` one of a, b, both, ``init`` one of lora, svd, loftq (``loftq_iterations``
    an integer >= 1, only with loftq; loftq without ``base_outliers``), its true/false keys real
    booleans, and ``base_outliers`` (``fraction`` in (0, 0.5], a known ``criterion`` and
    ``calibration`` keys, only with an NF4 base).

    Raises:
        ConfigKeyError: naming the key (``model.sparsity``) and what it must be.
    """
    from squash._checks import SPARSE_FACTORS

    get_int(model, "lora_rank", None, minimum=1, where=where)
    alpha = model.get("lora_alpha", None)
    if alpha is not None and (
        isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha)
    ):
        raise ConfigKeyError(f"{where}.lora_alpha must be a finite number, got {alpha!r}")
    for key in ("lora_dropout", "sparsity"):
        value = model.get(key, None)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1
        ):
            raise ConfigKeyError(f"{where}.{key} must be a number in [0, 1), got {value!r}")
    factor = model.get("sparse_factor", None)
    if factor is not None and factor not in SPARSE_FACTORS:
        raise ConfigKeyError(
            f"{where}.sparse_factor must be one of {', '.join(SPARSE_FACTORS)}, got {factor!r}"
        )
    init = model.get("init", None)
    if init is not None and init not in MODEL_INITS:
        raise ConfigKeyError(f"{where}.init must be one of {', '.join(MODEL_INITS)}, got {init!r}")
    get_int(model, "loftq_iterations", None, minimum=1, where=where)
    if model.get("loftq_iterations", None) is not None and init != "loftq":
        raise ConfigKeyError(f"{where}.loftq_iterations is set but {where}.init is "
                             f"{init or 'lora'!r}; set init: loftq or remove it")  # fmt: skip
    if init == "loftq" and model.get("base_outliers", None) is not None:
        raise ConfigKeyError(f"{where}.init: loftq spends the adapter on plain NF4's error; "
                             f"remove {where}.base_outliers or use init: lora")  # fmt: skip
    for key in MODEL_BOOLEAN_KEYS:
        _boolean(model, key, where)
    _check_base_outliers(model, where)


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


def _check_base_outliers(model: Mapping, where: str) -> None:
    """``model.base_outliers``: keys and values (:func:`~squash.nf4.base_outliers.
    parse_base_outliers`), and never with ``quantize_base: false``."""
    from squash.nf4.base_outliers import parse_base_outliers

    value = model.get("base_outliers", None)
    try:
        parsed = parse_base_outliers(to_plain(value), f"{where}.base_outliers")
    except ValueError as e:
        raise ConfigKeyError(str(e)) from e
    if parsed is not None and model.get("quantize_base", None) is False:
        raise ConfigKeyError(f"{where}.base_outliers needs quantize_base: true (an NF4 base to "
                             "correct); remove it or quantize the base")  # fmt: skip


def _check_tokenizer_files(node: Mapping) -> None:
    """Each tokenizer file the block names (keys ending in ``path`` or ``file``) that exists:
    a ``.json`` file (or a named directory's ``tokenizer.json`` and ``tokenizer_config.json``)
    must parse as JSON, a ``merges.txt`` must hold at least one merge."""
    for key, value in node.items():
        if not (isinstance(value, str) and (key.endswith("path") or key.endswith("file"))):
            continue
        path = Path(value)
        if path.is_dir():  # a checkpoint directory (SmolLM2): its tokenizer files
            for name in ("tokenizer.json", "tokenizer_config.json"):
                if (path / name).is_file():
                    _parse_json(path / name, f"tokenizer.{key}")
            continue
        if not path.is_file():
            continue  # the tokenizer names a missing file itself
        if path.suffix == ".json":
            _parse_json(path, f"tokenizer.{key}")
        elif path.name == "merges.txt" or key == "merges_path":
            try:
                lines = path.read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigKeyError(f"tokenizer.{key}: {path} cannot be read ({e})") from e
            if not any(line.strip() and not line.startswith("#") for line in lines):
                raise ConfigKeyError(
                    f"tokenizer.{key}: {path} holds no merges (a BPE merges.txt lists one merge "
                    "a line); give the tokenizer's real merges.txt"
                )


def _parse_json(path: Path, where: str, *, lines_ok: bool = False) -> None:
    """Raise naming ``path`` if it is not JSON (with ``lines_ok``, JSON Lines is accepted)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigKeyError(f"{where}: {path} cannot be read as UTF-8 text ({e})") from e
    try:
        json.loads(text)
        return
    except ValueError as e:
        error = e
    if lines_ok:
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except ValueError as e:
                raise ConfigKeyError(
                    f"{where}: {path} is neither JSON nor JSON Lines (line {n}: {e})"
                ) from e
        return
    raise ConfigKeyError(f"{where}: {path} is not JSON ({error})") from error


class NamedRecordErrors:
    """A map-style dataset whose records, when one cannot be turned into a sample (a null
    ``output``, a value of the wrong type), raise a ``ValueError`` naming the record, the data
    files and the record's null fields, instead of the transform's own error (torchtune's
    ``AssertionError: content must be of type List[Dict[str, Any]], got None``).

    A ``KeyError`` (a missing column) passes through unchanged: the recipe names the columns
    there are. Every other attribute is the wrapped dataset's.

    Args:
        dataset (Any): the dataset (``len`` and ``[]``).
        where (str): the config key and data files, for the message.
    """

    def __init__(self, dataset: Any, where: str) -> None:
        self._dataset, self._where = dataset, where

    def __len__(self) -> int:
        return len(self._dataset)

    def __getattr__(self, name: str) -> Any:
        if "_dataset" not in self.__dict__:  # during unpickling
            raise AttributeError(name)
        return getattr(self.__dict__["_dataset"], name)

    def __getitem__(self, index: int) -> Any:
        try:
            return self._dataset[index]
        except KeyError:
            raise
        except Exception as e:
            raise ValueError(
                f"{self._where}: record {index} cannot be used{self._nulls(index)} "
                f"({type(e).__name__}: {e})"
            ) from e

    def _nulls(self, index: int) -> str:
        try:
            raw = self._dataset._data[index]
            nulls = [k for k, v in raw.items() if v is None]
        except Exception:  # not an HF-backed dataset: the message is useful without it
            return ""
        return f": it has null {nulls}" if nulls else ""


def dataset_where(cfg_dataset: Any) -> str:
    """``dataset (data_files ...)``: how messages name a dataset block."""
    nodes = cfg_dataset if isinstance(cfg_dataset, (list, ListConfig)) else [cfg_dataset]
    files = [n.get("data_files") or n.get("source") for n in nodes if isinstance(n, Mapping)]
    files = [to_plain(f) for f in files]
    return f"dataset ({files[0] if len(files) == 1 else files})"


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
