"""The model a checkpoint directory holds, as Hugging Face weights in memory: what ``squash
export`` writes as GGUF and ``squash chat`` talks to.

A checkpoint saved with merged weights (``save_adapter_weights_only: False``) is read as it is.
One saved with the adapter alone (what the shipped configs save) is merged here, in memory, into
the base model its ``checkpoint.json`` records, exactly as the recipe merges when it writes the
merged weights: the model rebuilt as it was trained (NF4 base, ``init: svd`` residual or LoftQ's base, FFI
adapter; :func:`squash.assembly.model_setup.assemble_adapter_model`, the recipes' own path), the
adapter loaded, then :func:`squash.export.adapters.merged_weights` (``W + alpha / rank * B A``
on the dequantized base) and the family's key conversion. Nothing is written anywhere.

The base is trusted only as far as it can be checked: a run records the sha256 of every file of
``checkpointer.checkpoint_dir`` when it starts (``checkpoint.json``'s ``base``), and the base is
checked against that record, wherever it is now (``--base DIR`` names a moved copy). Checkpoints
written before runs recorded these hashes are merged only into a base named with ``--base``,
with a warning that it cannot be checked.
"""

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
from omegaconf import OmegaConf

from squash.export.hf_files import load_merged_checkpoint
from squash.runs import checkpoint as ckpt
from squash.runs import manifest, run_lock

if TYPE_CHECKING:  # the gguf package is loaded when a model is read, not on import
    from gguf.metadata import Metadata

log = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class CheckpointModel:
    """A model as Hugging Face files would hold it.

    Attributes:
        config (Dict[str, Any]): its ``config.json``.
        weights (Dict[str, torch.Tensor]): its weights with Hugging Face's keys, on the CPU.
        tokenizer_dir (Path): the directory with its tokenizer, chat template and
            ``generation_config.json``.
        meta (Metadata): its GGUF ``general.*`` keys.
        source (str): what it was read from, in words.
        reads (List[Path]): the directories its files were read from.
    """

    config: Dict[str, Any]
    weights: Dict[str, torch.Tensor]
    tokenizer_dir: Path
    meta: "Metadata"
    source: str
    reads: List[Path]


def has_merged_weights(directory: Path) -> bool:
    """Whether ``directory`` holds Hugging Face weights: config.json and model*.safetensors."""
    directory = Path(directory)
    return (directory / "config.json").is_file() and any(directory.glob("model*.safetensors"))


def load_checkpoint_model(checkpoint_dir: Path, base: Optional[Path] = None) -> CheckpointModel:
    """The model of ``checkpoint_dir``: its merged weights, or its adapter merged into its base.

    Args:
        checkpoint_dir (Path): a squash checkpoint (``epoch_N``, ``step_N``) or any Hugging Face
            model directory.
        base (Optional[Path]): the base model directory for an adapter-only checkpoint, if not
            where the run read it (checked against the recorded hashes where there are some).

    Raises:
        FileNotFoundError: a missing directory, adapter or weights.
        CheckpointIntegrityError: a checkpoint or base that does not match what was recorded.
        ValueError: a base that cannot be found or checked, a checkpoint config naming other code
            than a model builder, an adapter that does not fit.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise FileNotFoundError(f"Checkpoint directory {checkpoint_dir} does not exist")
    meta = None
    squash_files = (manifest.META_FILE, manifest.RECIPE_STATE, ckpt.SQUASH_ADAPTER_FILE)
    if any((checkpoint_dir / name).is_file() for name in squash_files):
        # the verification resume and squash_eval run: every file against checkpoint.json
        meta = manifest.verify(checkpoint_dir)
    if has_merged_weights(checkpoint_dir):
        config, weights = load_merged_checkpoint(checkpoint_dir)
        if meta is None:  # a Hugging Face model directory
            from squash.export.gguf_general import model_metadata

            source = f"the Hugging Face checkpoint {checkpoint_dir.name}"
            general = model_metadata(checkpoint_dir)
        else:  # names only, not weights, are read from the recorded base: it is not checked
            recorded = Path((meta.get("base") or {}).get("path", checkpoint_dir))
            described = recorded if recorded.is_dir() else checkpoint_dir
            general = _finetune_meta(checkpoint_dir, described)
            source = f"the merged weights of {_label(checkpoint_dir, meta)}"
        return CheckpointModel(config, weights, checkpoint_dir, general, source, [checkpoint_dir])
    if meta is None:
        raise FileNotFoundError(
            f"{checkpoint_dir} holds neither merged weights (config.json, model*.safetensors) nor "
            f"a squash checkpoint ({manifest.META_FILE}, {ckpt.SQUASH_ADAPTER_FILE})"
        )
    base_dir = verified_base(checkpoint_dir, meta, base)
    config, weights = merge_adapter(checkpoint_dir, base_dir, meta)
    # the tokenizer files a checkpoint holds (recorded in checkpoint.json), else the base's
    tokenizer_dir = checkpoint_dir if (checkpoint_dir / "tokenizer.json").is_file() else base_dir
    source = f"{_label(checkpoint_dir, meta)}, its adapter merged into the base {base_dir.name}"
    general = _finetune_meta(checkpoint_dir, base_dir)
    reads = [checkpoint_dir, base_dir]
    return CheckpointModel(config, weights, tokenizer_dir, general, source, reads)


def _label(checkpoint_dir: Path, meta: Optional[Dict[str, Any]] = None) -> str:
    step = (meta or {}).get("global_step")
    at = f" (step {step})" if isinstance(step, int) else ""
    return f"{checkpoint_dir.parent.name}/{checkpoint_dir.name}{at}"


def _finetune_meta(checkpoint_dir: Path, base_dir: Path) -> "Metadata":
    from squash.export.gguf_general import finetune_metadata, model_metadata

    return finetune_metadata(model_metadata(base_dir), _label(checkpoint_dir))


def verified_base(checkpoint_dir: Path, meta: Dict[str, Any], base: Optional[Path] = None) -> Path:
    """The base model directory of an adapter-only checkpoint, checked against the hashes its
    ``checkpoint.json`` records (``meta``, already verified).

    Raises:
        CheckpointIntegrityError: a base whose files differ from the record.
        ValueError: no record and no ``base`` given.
    """
    record = meta.get("base")
    where = Path(checkpoint_dir) / manifest.META_FILE
    if record is None:
        if base is None:
            recorded = ((meta.get("config") or {}).get("checkpointer") or {}).get("checkpoint_dir")
            hint = f" (the run read {recorded})" if recorded else ""
            raise ValueError(
                f"{where} records no hashes of the base model (written before squash recorded "
                f"them, or outside a run){hint}; give the base with --base DIR to merge the "
                "adapter into it unchecked"
            )
        log.warning("%s records no hashes of the base model: %s is used unchecked", where, base)
        return Path(base)
    path = Path(base) if base is not None else Path(record["path"])
    return manifest.verify_directory(record, path, f"the base recorded in {where}")


def merge_adapter(
    checkpoint_dir: Path, base_dir: Path, meta: Dict[str, Any]
) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """``config.json`` of ``base_dir`` and the merged weights (Hugging Face keys, float32) of the
    squash adapter of ``checkpoint_dir`` on that base: the weights the recipe would have written
    with ``save_adapter_weights_only: False``, in the dtype the run trained in, then float32.
    A ``model.base_outliers`` base with ``criterion: sensitivity`` is calibrated with the run's
    tokenizer, rebuilt from verified files by an allow-listed builder only
    (:func:`squash.checkpoint_tokenizer.checkpoint_tokenizer`).

    Raises:
        FileNotFoundError: a missing adapter, adapter config or base weights.
        ValueError: a model block naming other code than a model builder (or a tokenizer block
            other code than a tokenizer builder), or weights that do not fit it.
    """
    from squash.assembly.model_setup import assemble_adapter_model
    from squash.config.keys import ConfigKeyError
    from squash.export.adapters import adapter_layout, merged_weights

    checkpoint_dir, base_dir = Path(checkpoint_dir), Path(base_dir)
    cfg_path = checkpoint_dir / ckpt.SQUASH_ADAPTER_CONFIG_FILE
    if not cfg_path.is_file():
        raise FileNotFoundError(f"No {ckpt.SQUASH_ADAPTER_CONFIG_FILE} in {checkpoint_dir}")
    model_cfg = OmegaConf.create(_model_block(cfg_path))
    run = meta.get("config") or {}
    dtype = _DTYPES.get(str(run.get("dtype", "fp32")))
    if dtype is None:
        raise ValueError(
            f"{checkpoint_dir / manifest.META_FILE}: dtype {run.get('dtype')!r} is not one of "
            f"{list(_DTYPES)}"
        )
    seed = (meta.get("counters") or {}).get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(
            f"{checkpoint_dir / manifest.META_FILE}: counters.seed must be an integer >= 0, "
            f"got {seed!r}"
        )
    tokenizer = None
    outliers = model_cfg.get("base_outliers")
    if outliers is not None and outliers.get("criterion", "sensitivity") == "sensitivity":
        from squash.checkpoint_tokenizer import checkpoint_tokenizer

        tokenizer = checkpoint_tokenizer(checkpoint_dir, meta, base_dir)  # the calibration's
    config, base = base_state_dict(base_dir)
    try:
        model = assemble_adapter_model(
            model_cfg, base, device=torch.device("cpu"), dtype=dtype, seed=seed,
            tokenizer=tokenizer,
        ).model  # fmt: skip
    except ConfigKeyError as e:  # a value the model's builder refuses
        raise ValueError(f"{cfg_path}: {e}") from None
    del base
    adapter = ckpt.load_squash_adapter(checkpoint_dir)
    ckpt.load_adapter_into(model, adapter, checkpoint_dir / ckpt.SQUASH_ADAPTER_FILE)
    with torch.no_grad():
        merged = merged_weights(model.state_dict(), adapter_layout(model), dtype)
    del model
    return config, {k: v.float() for k, v in to_hf(merged, config, base_dir).items()}


def trained_model_block(cfg_model: Any, checkpoint_dir: Path) -> Any:
    """The model block to rebuild ``checkpoint_dir``'s adapter on: the block the run trained with
    (its ``squash_adapter_config.json``, checked as every checkpoint's block is), under the keys
    ``cfg_model`` (a config's ``model`` block) adds. What decides the model the adapter was
    trained in (``init``, ``base_outliers``, ``quantize_base``, the rank...) is the run's, so an
    evaluation config need not restate it, and one that says otherwise is refused.

    Raises:
        ConfigKeyError: one line naming ``model.KEY``, the run's value and the config's.
        FileNotFoundError: no ``squash_adapter_config.json`` in ``checkpoint_dir``.
    """
    import inspect

    from squash.config.keys import ConfigKeyError
    from squash.models import adapter_builders

    cfg_path = Path(checkpoint_dir) / ckpt.SQUASH_ADAPTER_CONFIG_FILE
    if not cfg_path.is_file():
        raise FileNotFoundError(f"No {ckpt.SQUASH_ADAPTER_CONFIG_FILE} in {checkpoint_dir}")
    trained = _model_block(cfg_path)
    given = OmegaConf.to_container(cfg_model, resolve=True)
    builder = adapter_builders()[trained["_component_"]]
    defaults = {n: p.default for n, p in inspect.signature(builder).parameters.items()
                if p.default is not inspect.Parameter.empty}  # fmt: skip
    defaults.update(init="lora", loftq_iterations=1)
    for key in sorted(given):
        ran = trained.get(key, defaults.get(key, inspect.Parameter.empty))
        if given[key] != ran:
            was = "unset" if ran is inspect.Parameter.empty else repr(ran)
            raise ConfigKeyError(
                f"model.{key}: the adapter in {checkpoint_dir} was trained with {was}, the config "
                f"says {given[key]!r}; drop model.{key} from the config (the run's own model "
                "block is used) or set it as the run did"
            )
    return OmegaConf.merge(OmegaConf.create(trained), cfg_model)


def _model_block(cfg_path: Path) -> Dict[str, Any]:
    try:
        block = json.loads(cfg_path.read_text()).get("model")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{cfg_path} cannot be read as a JSON object: {e}") from e
    return checked_model_block(block, cfg_path)


_PLAIN = (bool, int, float, str, type(None))


def checked_model_block(block: Any, where: Path) -> Dict[str, Any]:
    """``block``, the ``model`` block a checkpoint file ``where`` holds, if it is data only: its
    ``_component_`` one of squash's own model builders (:func:`squash.models.adapter_builders`,
    an allow-list), every other key a parameter of that builder, every value a JSON scalar or a
    list of them (no nested ``_component_``, no mapping but ``base_outliers``' keys of plain
    values, no ``${...}`` interpolation), and the adapter values of the right type and range
    (the recipes' own :func:`~squash.config.values.check_model_values`: ``lora_rank``,
    ``lora_alpha``, ``lora_dropout``, ``sparsity``, ``sparse_factor``, ``init`` and
    ``loftq_iterations`` (read by the assembly, whatever the builder takes), ``base_outliers``,
    the true/false keys). A checkpoint someone sent must never name code that
    runs, nor build from a value no recipe would accept.

    Raises:
        ValueError: one line naming ``where`` and the key at fault.
    """
    import inspect

    from squash.config.keys import MODEL_ASSEMBLY_KEYS, ConfigKeyError
    from squash.config.values import check_model_values
    from squash.models import adapter_builders

    if not isinstance(block, dict):
        raise ValueError(f"{where}: model is {type(block).__name__}, not a mapping of builder "
                         "arguments")  # fmt: skip
    builders = adapter_builders()
    component = block.get("_component_")
    if not isinstance(component, str) or component not in builders:
        raise ValueError(
            f"{where}: model._component_ {component!r} is not one of squash's model builders "
            "(squash.models.opt.squash_opt_tiny, squash.models.smollm2.squash_smollm2_135m, ...: "
            "the lora_*, qlora_* and squash_* builders of squash.models); a checkpoint names no "
            "other code"
        )
    params = inspect.signature(builders[component]).parameters
    any_key = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = {n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    for key, value in block.items():
        if key == "_component_":
            continue
        known = key in named or key in MODEL_ASSEMBLY_KEYS  # init: the assembly reads it
        if not isinstance(key, str) or not (known or (any_key and key.isidentifier())):
            raise ValueError(f"{where}: model.{key} is not an argument of {component}")
        if key == "base_outliers" and isinstance(value, dict):
            values = _outlier_values(value, where)
        else:
            values = value if isinstance(value, list) else [value]
        for v in values:
            if not isinstance(v, _PLAIN) or (isinstance(v, str) and "${" in v):
                raise ValueError(
                    f"{where}: model.{key} holds {_describe(v)}, not a plain value (a number, "
                    "string, boolean, null or a list of them); a checkpoint names no code"
                )
    try:  # the type and range checks the recipes run on their config's model block
        check_model_values(block)
    except ConfigKeyError as e:
        raise ValueError(f"{where}: {e}") from None
    return block


def _outlier_values(block: Dict[str, Any], where: Path) -> List[Any]:
    """The plain values of a ``model.base_outliers`` mapping (its one nested mapping,
    ``calibration``, flattened), its keys checked.

    Raises:
        ValueError: one line naming ``where`` and the key at fault.
    """
    from squash.nf4.base_outliers import parse_base_outliers

    try:
        parse_base_outliers(block, "model.base_outliers")
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    calibration = block.get("calibration") or {}
    return [v for k, v in block.items() if k != "calibration"] + list(calibration.values())


def _describe(value: Any) -> str:
    if isinstance(value, dict) and "_component_" in value:
        return f"a _component_ {value['_component_']!r}"
    if isinstance(value, str):
        return f"the interpolation {value!r}"
    return f"a {type(value).__name__}"


def base_state_dict(base_dir: Path) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """``config.json`` and the weights of the Hugging Face model ``base_dir`` with torchtune's
    keys, for its family (Llama, Qwen 2, OPT).

    Raises:
        FileNotFoundError: missing config or weights.
        ValueError: a family squash cannot convert.
    """
    # in the dtype stored, as the recipe's checkpointer loads it: NF4 quantizes a float16
    # weight in float16 arithmetic, so an upcast would change the base
    config, weights = load_merged_checkpoint(base_dir, float32=False)
    family = config.get("model_type")
    if family == "opt":
        from squash.models.opt import opt_hf_to_tune

        return config, opt_hf_to_tune(weights)
    kwargs = _head_args(config)
    if family == "llama":
        from torchtune.models.convert_weights import hf_to_tune

        sd = hf_to_tune(weights, **kwargs)
    elif family == "qwen2":
        from torchtune.models.qwen2._convert_weights import qwen2_hf_to_tune

        sd = qwen2_hf_to_tune(weights, **kwargs, tie_word_embeddings=False)
    else:
        raise ValueError(_unknown_family(base_dir, family))
    if config.get("tie_word_embeddings"):
        sd.pop("output.weight", None)  # torchtune's tied models share tok_embeddings.weight
    return config, sd


def _unknown_family(base_dir: Path, family: Any) -> str:
    return f"{base_dir}/config.json: model_type {family!r} is not one squash can merge into"


def to_hf(
    state_dict: Dict[str, torch.Tensor], config: Dict[str, Any], base_dir: Path
) -> Dict[str, torch.Tensor]:
    """torchtune's keys back to Hugging Face's for the family of ``config``, as the checkpointer
    the recipe uses converts them when it writes merged weights."""
    family = config.get("model_type")
    if family == "opt":
        from squash.models.opt import opt_tune_to_hf

        return opt_tune_to_hf(state_dict)
    if family == "llama":
        from torchtune.models.convert_weights import tune_to_hf

        return tune_to_hf(state_dict, **_head_args(config))
    if family == "qwen2":
        from torchtune.models.qwen2._convert_weights import qwen2_tune_to_hf

        tied = bool(config.get("tie_word_embeddings", False))
        return qwen2_tune_to_hf(state_dict, **_head_args(config), tie_word_embeddings=tied)
    raise ValueError(_unknown_family(base_dir, family))


def _head_args(config: Dict[str, Any]) -> Dict[str, Any]:
    heads = int(config["num_attention_heads"])
    return dict(
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        dim=int(config["hidden_size"]),
        head_dim=config.get("head_dim"),
    )


def export_checkpoint(
    checkpoint_dir: Path,
    formats: Any,
    output_dir: Optional[Path] = None,
    base: Optional[Path] = None,
) -> List[Path]:
    """The exports an ``export`` config block asks for (``{"gguf": ["f16", "q8_0"]}``, see
    :func:`squash.export.parse_export_config`) of one checkpoint, merged or adapter-only.

    Files are named ``<checkpoint name>-<dtype>.gguf`` and go to ``output_dir`` (default:
    ``gguf/`` beside the checkpoint), never inside the checkpoint or the base directory.

    Returns:
        List[Path]: the files written.

    Raises:
        ValueError: an unknown format or dtype, an output directory inside what is read, and
            what :func:`load_checkpoint_model` raises.
    """
    from squash.export.formats import parse_export_config
    from squash.export.gguf import write_gguf

    checkpoint_dir = Path(checkpoint_dir)
    dtypes = parse_export_config(formats).get("gguf", [])
    output_dir = Path(output_dir) if output_dir is not None else checkpoint_dir.parent / "gguf"
    if not dtypes:
        return []
    _refuse_inside(output_dir, [checkpoint_dir])
    model = load_checkpoint_model(checkpoint_dir, base)
    _refuse_inside(output_dir, model.reads)
    # the directories made here are removed again, when still empty, if the export fails (a
    # family GGUF cannot carry is found only when writing): a refused export leaves nothing
    run_lock.check_owned(output_dir)  # a recipe's export into its output_dir: still its own
    created = [p for p in (output_dir, *output_dir.parents) if not p.exists()][::-1]
    output_dir.mkdir(parents=True, exist_ok=True)
    try:
        return [
            write_gguf(model.config, model.weights, model.tokenizer_dir, d,
                       export_path(checkpoint_dir, d, output_dir), model.meta, model.source)
            for d in dtypes
        ]  # fmt: skip
    except BaseException:
        for path in reversed(created):
            try:
                path.rmdir()  # only if empty
            except OSError:
                break
        raise


def export_path(checkpoint_dir: Path, dtype: str, output_dir: Optional[Path] = None) -> Path:
    """Where :func:`export_checkpoint` writes the GGUF of ``checkpoint_dir`` in ``dtype``."""
    checkpoint_dir = Path(checkpoint_dir)
    output_dir = Path(output_dir) if output_dir is not None else checkpoint_dir.parent / "gguf"
    return output_dir / f"{checkpoint_dir.name}-{dtype}.gguf"


def missing_exports(
    checkpoint_dir: Path, formats: Any, output_dir: Optional[Path] = None
) -> Dict[str, List[str]]:
    """The part of an ``export`` block (as :func:`export_checkpoint` takes it) whose files are not
    there: what a run killed during its export left undone, for its resume to redo."""
    from squash.export.formats import parse_export_config

    dtypes = parse_export_config(formats).get("gguf", [])
    missing = [d for d in dtypes if not export_path(checkpoint_dir, d, output_dir).is_file()]
    return {"gguf": missing} if missing else {}


def _refuse_inside(output_dir: Path, reads: List[Path]) -> None:
    out = Path(output_dir).resolve()
    for path in reads:
        src = Path(path).resolve()
        if out == src or src in out.parents:
            raise ValueError(
                f"--output-dir {output_dir} is inside {path}, which the export reads; give a "
                "directory outside the checkpoint and the base model"
            )
