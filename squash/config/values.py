"""Config values every recipe reads, checked before anything is built: types and ranges
(:func:`check_value_types`, what ``squash validate`` runs too), the adapter values of the
``model`` block (:func:`check_model_values`), and the files a config names: tokenizer files,
local data files, the base model's safetensors dtypes (:func:`check_values`). Every error names
the key (or the file) and what it must be."""

import json
import math
import re
from pathlib import Path
from typing import Any, Mapping

from omegaconf import ListConfig

from squash._io import to_plain
from squash.config.keys import ConfigKeyError, get_int


# ``model.init``: the builders' own (lora, svd) and the assembly's LoftQ.
MODEL_INITS = ("lora", "svd", "loftq")


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

    check_value_types(cfg)  # device's form first, then whether this machine has one
    device = cfg.get("device", None)
    if isinstance(device, str) and device.split(":")[0] == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else (
                f"ROCm {torch.version.hip}" if torch.version.hip else "CPU only")
            raise ConfigKeyError(
                f"device: {device}, but this machine has no usable GPU "
                f"(torch.cuda.is_available() is False; torch {torch.__version__}, {build}); "
                "use device: auto or cpu, or install a GPU build of torch"
            )
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
    device (``squash validate`` runs these too): ``device`` (auto, cpu, cuda[:N]), ``dtype`` and
    ``teacher_dtype`` (auto or a precision), ``seed``, ``clip_grad_norm``, the true/false
    keys, the counts, ``optimizer.lr``, ``lr_scheduler.num_warmup_steps``, the adapter values
    of ``model`` and ``tokenizer.max_seq_len``.

    Raises:
        ConfigKeyError: naming the key and what it must be.
    """
    _check_placement(cfg)
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


# What ``device`` and the dtype keys may say; ``auto`` is resolved by squash.training.placement.
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")
DTYPES = ("auto", "bf16", "fp32", "fp16", "fp64")  # torchtune's precisions, and auto
DTYPE_KEYS = ("dtype", "teacher_dtype")


def _check_placement(cfg: Mapping) -> None:
    device = cfg.get("device", None)
    if device is not None and not (isinstance(device, str) and DEVICE_PATTERN.fullmatch(device)):
        raise ConfigKeyError(
            f"device must be auto, cpu or cuda (cuda:N; cuda also means ROCm), got {device!r}"
        )
    for key in DTYPE_KEYS:
        value = cfg.get(key, None)
        if value is not None and value not in DTYPES:
            raise ConfigKeyError(f"{key} must be one of {', '.join(DTYPES)}, got {value!r}")


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
