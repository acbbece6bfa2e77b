"""Building the adapted model a training recipe trains (and a frozen one, a teacher or a model
to evaluate), in one pass: the model config block instantiated on the meta device with its
final classes, sharded or not, and loaded once from one full state dict (the base weights or
their SVD residual, plus the adapter: initial, SVD or resumed). Every training recipe, one device
or FSDP2, calls :func:`assemble_adapter_model`."""

from pathlib import Path
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple, Union

import torch
import torch.distributed as dist
from omegaconf import DictConfig, ListConfig
from torch import nn
from torchtune import config, modules, training, utils
from torchtune.modules.peft import get_adapter_params, set_trainable_params

from squash.assembly.adapter_init import (
    initial_adapter_state_dict,
    loftq_initial_state,
    svd_initial_state,
)
from squash.assembly.calibration import apply_base_outliers_, input_width, model_second_moments
from squash.assembly.fsdp import broadcast, load_full_state_dict
from squash.config.blocks import builder_block
from squash.config.keys import ConfigKeyError
from squash.modules import FFILinear, get_adapter_modules, use_squash_nf4_
from squash.modules.adapter import adapter_layout, dense_adapter
from squash.nf4.base_outliers import outlier_modules
from squash.runs import checkpoint as ckpt
from squash.training.masks import MaskUpdateSchedule
from squash.training.memory import base_memory, outlier_memory

log = utils.get_logger("INFO")


def load_all_but_adapters(model: nn.Module, state_dict: Dict[str, torch.Tensor], what: str) -> None:
    """Load ``state_dict`` into ``model``: every key must fit except adapter keys (``.lora_``),
    which keep their values.

    Raises:
        ValueError: ``what``, then the first missing and unexpected keys.
    """
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = [k for k in missing if ".lora_" not in k]
    if missing or unexpected:
        raise ValueError(f"{what}: missing {missing[:5]}, unexpected {list(unexpected)[:5]}")


def load_base(checkpointer_cfg: DictConfig, where: str = "checkpointer") -> Tuple[Any, Dict]:
    """The checkpointer ``checkpointer_cfg`` names and the model state dict it loads, after the
    dtype of each ``.safetensors`` file it will read is checked against its ``config.json``
    (:func:`squash._checks.check_safetensors_dtypes`). torchtune's checkpointers
    (``FullModelHFCheckpointer``) read a header as it declares: F16 data declared BF16 would
    load as garbage. The files are those the checkpointer resolved (a ``filename_format``
    mapping too), so every recipe's every checkpointer (a teacher's too) is checked on one path.

    Returns:
        Tuple[Any, Dict]: the checkpointer (recipes save through it) and its model state dict.

    Raises:
        ConfigKeyError: ``WHERE.checkpoint_files: FILE declares ...``, naming the file, a tensor
            and both dtypes.
    """
    from squash._checks import check_safetensors_dtypes

    checkpointer = config.instantiate(checkpointer_cfg)
    directory = getattr(checkpointer, "_checkpoint_dir", None)
    paths = getattr(checkpointer, "_checkpoint_paths", None)
    if directory is None or paths is None:  # another checkpointer: the files its config names
        directory = checkpointer_cfg.get("checkpoint_dir", None)
        paths = checkpointer_cfg.get("checkpoint_files", None)
    if directory is not None and isinstance(paths, (list, tuple, ListConfig)):
        try:
            check_safetensors_dtypes(Path(directory), [str(p) for p in paths])
        except ValueError as e:
            raise ConfigKeyError(f"{where}.checkpoint_files: {e}") from None
    return checkpointer, checkpointer.load_checkpoint()[training.MODEL_KEY]


def build_adapter_model(
    cfg_model: DictConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    mask_update: Optional[MaskUpdateSchedule] = None,
) -> nn.Module:
    """Build the model of ``cfg_model`` on ``device`` (``"meta"`` too) with the LoRA init (an
    ``init: svd`` or ``loftq`` is applied once the base weights are loaded, by
    :func:`assemble_adapter_model`) and only its adapters trainable.
    torchtune's NF4 modules (``LoRALinear`` with an NF4 base, ``FrozenNF4Linear``) are computed
    with squash's NF4 kernel (:func:`~squash.modules.use_squash_nf4_`: equal bit for bit).

    Raises:
        ConfigKeyError: a value the builder refuses (its message, after ``model``), a model
            without adapters, or ``mask_update`` without a sparse factor.
    """
    with training.set_default_dtype(dtype), torch.device(device):
        try:
            model = config.instantiate(builder_block(cfg_model))
        except (ValueError, TypeError) as e:  # a value the builder refuses: a config error
            raise ConfigKeyError(f"model ({cfg_model._component_}): {e}") from e
        model = use_squash_nf4_(model)
    if not get_adapter_modules(model):
        raise ConfigKeyError(
            f"model: {cfg_model._component_} has no LoRA adapters; use a lora_*, qlora_* or "
            "squash_* builder"
        )
    has_sparse = any(isinstance(m, FFILinear) for m in model.modules())
    if mask_update is not None and not has_sparse:
        raise ConfigKeyError(
            f"mask_update is set but model {cfg_model._component_} has no sparse (FFI) "
            "factor; use a squash_* builder or remove mask_update"
        )
    set_trainable_params(model, get_adapter_params(model))
    return model


class AdapterModel(NamedTuple):
    """What :func:`assemble_adapter_model` returns."""

    model: nn.Module
    """The model, adapter parameters trainable and everything else frozen."""
    svd_init: Optional[Dict[str, torch.Tensor]]
    """With ``init: svd`` or ``loftq``, the dense factors the adapters started from (the PEFT
    export is relative to the original weights), in the model's dtype; None otherwise."""


def _rank_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def assemble_adapter_model(
    cfg_model: DictConfig,
    base_state_dict: Dict[str, torch.Tensor],
    *,
    device: torch.device,
    dtype: torch.dtype,
    mask_update: Optional[MaskUpdateSchedule] = None,
    activation_checkpointing: bool = False,
    compile_model: bool = False,
    seed: int = 0,
    adapter: Optional[Dict[str, torch.Tensor]] = None,
    adapter_source: Union[str, Path, None] = None,
    shard: Optional[Callable[[nn.Module], None]] = None,
    cpu_offload: bool = False,
    tokenizer: Any = None,
) -> AdapterModel:
    """The model of ``cfg_model`` (a LoRA, QLoRA or squash builder), assembled in one pass.

    Built on the meta device (nothing drawn), only its adapters trainable, compiled and
    activation-checkpointed as asked, sharded by ``shard`` (FSDP2) or not, then loaded once from
    one full state dict: ``base_state_dict`` (with ``init: svd``, each adapted weight replaced
    by its SVD residual; with ``init: loftq``, by what LoftQ quantizes) plus the adapter:
    ``adapter`` (resumed) if given, else the SVD or LoftQ factors or the initial adapter, each
    drawn once from a generator of its own (seed, module name), so every device and world size
    starts from the same adapter.

    Args:
        cfg_model (DictConfig): the ``model`` block; ``init: svd`` initialises the adapters from
            the singular vectors of the base weights, ``init: loftq`` (with
            ``loftq_iterations``, default 1) from LoftQ's alternation with NF4
            (:func:`~squash.assembly.adapter_init.loftq_initial_state`).
        base_state_dict (Dict[str, torch.Tensor]): the base model's weights (torchtune keys).
        device (torch.device): the compute device.
        dtype (torch.dtype): parameter dtype.
        mask_update (Optional[MaskUpdateSchedule]): the ``mask_update`` schedule, if any (needs
            a sparse factor).
        activation_checkpointing (bool): wrap each self-attention layer. Default False.
        compile_model (bool): compile each layer. Default False.
        seed (int): seeds each adapter's initialisation with its module name. Default 0.
        adapter (Optional[Dict[str, torch.Tensor]]): a resumed adapter, loaded instead of the
            initial one; it must hold exactly the model's adapter tensors.
        adapter_source (Union[str, Path, None]): where ``adapter`` came from, for messages.
        shard (Optional[Callable[[nn.Module], None]]): shards the model in place (FSDP2), after
            compile and activation checkpointing, before the load.
        cpu_offload (bool): the sharded parameters live on the CPU.
        tokenizer (Any): the run's tokenizer; cuts the calibration text of
            ``model.base_outliers`` with ``criterion: sensitivity``.

    With ``model.base_outliers`` each NF4 base is split, after the load, into ``NF4(W - S)``
    and its outliers ``S`` (:mod:`squash.assembly.calibration`; the sensitivity criterion's
    second moments measured on the unquantized model first): ``S`` is rebuilt from the base
    weights on every assembly, never read from a checkpoint. Sharded, each process keeps its
    rows of the NF4 base and the whole ``S``.

    Returns:
        AdapterModel: the model and, with ``init: svd`` or ``loftq``, its initial dense factors.

    Raises:
        ConfigKeyError: a model without adapters, ``mask_update`` without a sparse factor,
            ``init: svd`` without squash adapters, ``init: loftq`` with an adapter not on an NF4
            base, or ``criterion: sensitivity`` without a tokenizer.
        ValueError: base weights or an adapter that do not fit the model.
    """
    init = cfg_model.get("init", "lora")
    model = build_adapter_model(cfg_model, device="meta", dtype=dtype, mask_update=mask_update)
    adapters = get_adapter_modules(model)
    moments = _outlier_moments(model, cfg_model, base_state_dict, tokenizer, device, dtype, shard)
    if compile_model:
        training.compile_model(model, verbose=_rank_zero())
    if activation_checkpointing:
        training.set_activation_checkpointing(
            model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
        )
    if shard is not None:
        shard(model)
    # what the state dict does not hold: the adapters' own materialisation, RoPE caches
    adapter_ids = {id(m) for m in adapters.values()}
    with training.set_default_dtype(dtype), device:
        for module in model.modules():
            if id(module) in adapter_ids:
                module.to_empty(device="cpu" if cpu_offload else device)
            if hasattr(module, "rope_init"):
                module.rope_init()

    # Every adapter drawn from a generator of its own (seed, module name): the same adapter on
    # every device and world size.
    if init in ("svd", "loftq"):
        initial, residual = _factored_initial_state(model, cfg_model, base_state_dict)
        base_state_dict = {**base_state_dict, **residual}
    else:
        initial = initial_adapter_state_dict(model, seed)
    svd_init = None
    if init in ("svd", "loftq"):  # the PEFT export is relative to the original weights
        # copies: loaded on one device, a dense factor's tensor becomes the live parameter and
        # would train along
        dense = dense_adapter(initial, adapter_layout(model))
        svd_init = {k: v.to(dtype).clone() for k, v in dense.items()}
    if adapter is not None:
        ckpt.check_adapter_fits(initial, adapter, adapter_source)
    missing, unexpected = load_full_state_dict(
        model, {**base_state_dict, **(initial if adapter is None else adapter)}, device,
        cpu_offload=cpu_offload,
    )  # fmt: skip
    if missing or unexpected:
        raise ValueError(
            f"The base checkpoint does not fit model {cfg_model._component_}: missing "
            f"{missing[:5]}, unexpected {list(unexpected)[:5]}"
        )
    if moments is not None:  # the corrected bases, from the weights just loaded
        n = apply_base_outliers_(model, base_state_dict, moments, device=device)
        log.info(f"Split {n} NF4 bases into NF4 + FFI outliers (model.base_outliers)")
    training.validate_no_params_on_meta_device(model)
    training.validate_expected_param_dtype(get_adapter_params(model).items(), dtype)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if _rank_zero():
        log.info(
            f"Model {cfg_model._component_}: {len(adapters)} adapters, {n_train:,} trainable "
            f"parameters, {dtype}, on {device}{_outliers_summary(model)}"
        )
    return AdapterModel(model, svd_init)


def _factored_initial_state(model, cfg_model, base_state_dict):
    """``init: svd`` or ``loftq``: the adapter tensors and the base weights they replace."""
    if cfg_model.init == "svd":
        initial, residual = svd_initial_state(model, base_state_dict)
        if not initial:
            raise ConfigKeyError("model.init: svd needs squash (SparseLoRALinear) adapters")
        log.info(f"SVD-initialised {len(residual)} adapters from the loaded base weights")
        return initial, residual
    iterations = cfg_model.get("loftq_iterations", None) or 1
    try:
        initial, residual = loftq_initial_state(model, base_state_dict, iterations)
    except ValueError as e:
        raise ConfigKeyError(f"model.init: loftq: {e}") from e
    log.info(f"LoftQ-initialised {len(residual)} adapters ({iterations} iteration(s)) from the "
             "loaded base weights")  # fmt: skip
    return initial, residual


def _outliers_summary(model: nn.Module) -> str:
    """``", frozen base B bytes, S of them the FFI outliers of N bases"`` for a corrected base
    (``model.base_outliers``), else empty."""
    sizes = outlier_memory(model)
    if not sizes:
        return ""
    return (f", frozen base {base_memory(model):,} bytes, {sum(sizes.values()):,} of them the "
            f"FFI outliers S of {len(sizes)} bases")  # fmt: skip


def _outlier_moments(model, cfg_model, base_state_dict, tokenizer, device, dtype, shard):
    """None without ``model.base_outliers``; else the calibration second moments by module name
    (empty for the ``magnitude`` criterion). Sharded (FSDP2), rank 0 calibrates and the others
    receive its moments (sent on ``device``, as NCCL needs), so that all select the same
    outliers."""
    mods = outlier_modules(model)
    if not mods:
        return None
    if cfg_model.base_outliers.get("criterion", "sensitivity") != "sensitivity":
        return {}
    if shard is None or _rank_zero():
        moments = model_second_moments(cfg_model, base_state_dict, list(mods), tokenizer,
                                       device=device, dtype=dtype)  # fmt: skip
    else:  # filled by rank 0's broadcast below
        moments = {name: torch.empty(input_width(m), dtype=torch.float32)
                   for name, m in mods.items()}  # fmt: skip
    if shard is not None:
        moments = {name: broadcast(moments[name].to(device)).cpu() for name in sorted(moments)}
    return moments


def assemble_trained_model(
    cfg_model: DictConfig,
    base_state_dict: Dict[str, torch.Tensor],
    adapter: Dict[str, torch.Tensor],
    *,
    adapter_source: Union[str, Path],
    device: torch.device,
    dtype: torch.dtype,
    tokenizer: Any = None,
) -> nn.Module:
    """The model a run trained, rebuilt to be evaluated: :func:`assemble_adapter_model`, the
    path training and resume take (with ``init: svd`` or ``loftq`` the base's residual under the
    adapter, with ``model.base_outliers`` the corrected base), with ``adapter`` loaded, then
    frozen and in eval mode. ``cfg_model`` is the block the run trained with
    (:func:`squash.merge.trained_model_block`).

    Raises:
        ValueError: weights or an adapter that do not fit the model.
    """
    model = assemble_adapter_model(
        cfg_model, base_state_dict, device=device, dtype=dtype, adapter=adapter,
        adapter_source=adapter_source, tokenizer=tokenizer,
    ).model  # fmt: skip
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def setup_frozen_model(
    cfg_model: DictConfig,
    state_dict: Dict[str, torch.Tensor],
    *,
    device: torch.device,
    dtype: torch.dtype,
    where: str = "model",
    tokenizer: Any = None,
) -> nn.Module:
    """Build ``cfg_model``, load ``state_dict``, freeze the model and put it in eval mode (a
    distillation teacher, or a model evaluated without an adapter; a trained adapter is
    evaluated in the model it trained in, :func:`assemble_trained_model`).

    Every key must load, except adapter keys (``.lora_``) of a model with adapters, which keep
    their initialisation (``lora_b`` is zero, so the adapters add nothing until an adapter is
    loaded into them). NF4 modules are computed with squash's kernel, as in
    :func:`build_adapter_model`. With ``model.base_outliers`` each NF4 base is split into NF4
    and outliers from ``state_dict`` as in :func:`assemble_adapter_model` (``tokenizer`` for
    the sensitivity criterion's calibration).

    Raises:
        ValueError: naming ``where`` if the weights do not fit the model.
    """
    with training.set_default_dtype(dtype), device:
        model = use_squash_nf4_(config.instantiate(builder_block(cfg_model)))
    moments = _outlier_moments(model, cfg_model, state_dict, tokenizer, device, dtype, None)
    load_all_but_adapters(
        model, state_dict, f"The checkpoint of {where} does not fit {cfg_model._component_}"
    )
    if moments is not None:
        apply_base_outliers_(model, state_dict, moments)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()
