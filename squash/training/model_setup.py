"""Building the adapted model a training recipe trains (and a frozen one, a teacher or a model
to evaluate): the model config block instantiated, the base weights loaded, the adapters
initialised (``init: svd`` too) and made the only trainable parameters."""

from typing import Dict, Optional

import torch
from omegaconf import DictConfig
from torch import nn
from torchtune import config, modules, training, utils
from torchtune.modules.peft import get_adapter_params, set_trainable_params

from squash.modules import FFILinear, get_adapter_modules, svd_initialize, use_squash_nf4_
from squash.training import checkpoint as ckpt
from squash.training.adapter_init import initial_adapter_state_dict
from squash.training.config_checks import ConfigKeyError
from squash.training.exports import adapter_layout, adapter_state, dense_adapter
from squash.training.mask_schedule import MaskUpdateSchedule

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


def build_adapter_model(
    cfg_model: DictConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    mask_update: Optional[MaskUpdateSchedule] = None,
) -> nn.Module:
    """Build the model of ``cfg_model`` on ``device`` (``"meta"`` too) with the LoRA init (an
    ``init: svd`` is applied once the base weights are loaded) and only its adapters trainable.
    torchtune's NF4 modules (``LoRALinear`` with an NF4 base, ``FrozenNF4Linear``) are computed
    with squash's NF4 kernel (:func:`~squash.modules.use_squash_nf4_`: equal bit for bit).

    Raises:
        ConfigKeyError: a model without adapters, or ``mask_update`` without a sparse factor.
    """
    overrides = {"init": "lora"} if "init" in cfg_model else {}
    with training.set_default_dtype(dtype), torch.device(device):
        model = use_squash_nf4_(config.instantiate(cfg_model, **overrides))
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


def setup_adapter_model(
    cfg_model: DictConfig,
    base_state_dict: Dict[str, torch.Tensor],
    *,
    device: torch.device,
    dtype: torch.dtype,
    mask_update: Optional[MaskUpdateSchedule] = None,
    activation_checkpointing: bool = False,
    compile_model: bool = False,
    seed: int = 0,
) -> nn.Module:
    """Build the model of ``cfg_model`` (a LoRA, QLoRA or squash builder), load the base weights,
    make only the adapters trainable and apply ``init: svd``, activation checkpointing and
    compile.

    Args:
        cfg_model (DictConfig): the ``model`` block; ``init: svd`` initialises the adapters from
            the singular vectors of the loaded base weights.
        base_state_dict (Dict[str, torch.Tensor]): the base model's weights (torchtune keys).
        device (torch.device): where the model is built.
        dtype (torch.dtype): parameter dtype.
        mask_update (Optional[MaskUpdateSchedule]): the ``mask_update`` schedule, if any (needs
            a sparse factor).
        activation_checkpointing (bool): wrap each self-attention layer. Default False.
        compile_model (bool): compile each layer. Default False.
        seed (int): seeds each adapter's initialisation with its module name. Default 0.

    Returns:
        nn.Module: the model, adapter parameters trainable and everything else frozen.

    Raises:
        ConfigKeyError: a model without adapters, ``mask_update`` without a sparse factor,
            ``init: svd`` without squash adapters.
        ValueError: base weights that do not fit the model.
    """
    svd = cfg_model.get("init", "lora") == "svd"
    model = build_adapter_model(cfg_model, device=device, dtype=dtype, mask_update=mask_update)
    adapters = get_adapter_modules(model)

    load_all_but_adapters(
        model, base_state_dict, f"The base checkpoint does not fit model {cfg_model._component_}"
    )
    # Every adapter drawn from a generator of its own (seed, module name): the same adapter as
    # the distributed recipe's, whatever the device or world size.
    ckpt.load_adapter_into(model, initial_adapter_state_dict(model, seed), "the initial adapter")
    if svd:
        done = svd_initialize(model, base_state_dict)
        if not done:
            raise ConfigKeyError("model.init: svd needs squash (SparseLoRALinear) adapters")
        log.info(f"SVD-initialised {len(done)} adapters from the loaded base weights")
    training.validate_expected_param_dtype(get_adapter_params(model).items(), dtype)
    if activation_checkpointing:
        training.set_activation_checkpointing(
            model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
        )
    if compile_model:
        training.compile_model(model)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info(
        f"Model {cfg_model._component_}: {len(adapters)} adapters, {n_train:,} trainable "
        f"parameters, {dtype}, on {device}"
    )
    return model


def setup_frozen_model(
    cfg_model: DictConfig,
    state_dict: Dict[str, torch.Tensor],
    *,
    device: torch.device,
    dtype: torch.dtype,
    where: str = "model",
) -> nn.Module:
    """Build ``cfg_model``, load ``state_dict``, freeze the model and put it in eval mode (a
    distillation teacher, or a model to evaluate).

    Every key must load, except adapter keys (``.lora_``) of a model with adapters, which keep
    their initialisation (``lora_b`` is zero, so the adapters add nothing until an adapter is
    loaded into them). NF4 modules are computed with squash's kernel, as in
    :func:`build_adapter_model`.

    Raises:
        ValueError: naming ``where`` if the weights do not fit the model.
    """
    with training.set_default_dtype(dtype), device:
        model = use_squash_nf4_(config.instantiate(cfg_model))
    load_all_but_adapters(
        model, state_dict, f"The checkpoint of {where} does not fit {cfg_model._component_}"
    )
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def svd_init_factors(cfg_model: DictConfig, model: nn.Module) -> Optional[Dict[str, torch.Tensor]]:
    """With ``init: svd``, the dense factors the adapters start from (call it right after
    :func:`setup_adapter_model`): the PEFT export is relative to the original weights."""
    if cfg_model.get("init", "lora") != "svd":
        return None
    # copies: a dense factor's tensor would otherwise be the live parameter (on the CPU,
    # detach().cpu() keeps its storage) and train along, and the delta would lose B0 A0
    dense = dense_adapter(adapter_state(model), adapter_layout(model))  # no NF4 dequantized
    return {k: v.clone() for k, v in dense.items()}
