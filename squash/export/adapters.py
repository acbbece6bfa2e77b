"""What a checkpoint exports of an adapted model: the squash adapter, the PEFT adapter and the
merged weights, all computed from one full state dict.

The full state dict is ``model.state_dict()`` on one device, or what an FSDP2 run gathers on
rank 0 (``training.gather_cpu_state_dict``), and only the adapter's tensors for an adapter-only
checkpoint: every recipe takes it from :func:`state_to_export`. :func:`adapter_layout` reads
what the tensors do not say (each adapter's scaling, rank and factor widths) from the model's
structure, which may be sharded or on the meta device. Every recipe calls :func:`checkpoint_exports`, so the files a
checkpoint holds cannot differ between recipes; the family's checkpointer maps the keys (OPT's,
or torchtune's HF checkpointer for Llama and the others).

- :func:`dense_adapter` is the one FFI -> dense conversion of an adapter state dict.
- :func:`merged_weights` is the one merge: ``W + (alpha / rank) * B_dense @ A_dense`` in float32.
- :func:`peft_adapter` applies the SVD delta (``model.init: svd``) in the one place it is done.
"""

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torchtune import training

from squash._io import to_plain
from squash.nf4.base_outliers import add_outliers_
from squash.modules.adapter import (  # noqa: F401  (adapters.* as before)
    AdapterLayout,
    adapter_layout,
    dense_adapter,
    merge_lora,
    state_dict_key,
)


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict key belongs to a LoRA factor (``.lora_a.`` or ``.lora_b.``)."""
    return ".lora_a." in key or ".lora_b." in key


def adapter_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The ``lora_a`` / ``lora_b`` entries of ``model.state_dict()`` (the keys
    :func:`is_adapter_key` accepts), read from those submodules only: the whole state dict would
    dequantize every NF4 base (minutes for a 30-layer model on a CPU). Activation-checkpoint
    wrappers' prefix is dropped from the keys, as their own state-dict hook drops it. Tensors as
    the modules hold them (DTensor shards under FSDP2)."""
    out = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("lora_a", "lora_b"):
            out.update(module.state_dict(prefix=state_dict_key(name) + "."))
    return out


def state_to_export(
    model: nn.Module,
    *,
    adapter_only: bool,
    is_rank_zero: bool = True,
    device: Optional[torch.device] = None,
) -> Dict[str, torch.Tensor]:
    """What :func:`checkpoint_exports` needs of ``model``, for every recipe's save.

    With ``adapter_only`` that is :func:`adapter_state` (the NF4 bases are not dequantized: no
    merged weights are written); else the full state dict. A model sharded with FSDP2 is
    gathered to the CPU of rank 0 (every rank must call this; the others get ``{}``): the full
    state dict by torchtune's ``gather_cpu_state_dict``, the adapter tensor by tensor.

    Args:
        model (nn.Module): the adapted model, on one device or sharded with ``fully_shard``.
        adapter_only (bool): the checkpoint leaves out the merged weights.
        is_rank_zero (bool): this process is rank 0 (FSDP2 only). Default True.
        device (Optional[torch.device]): the ranks' device, where CPU-offloaded shards are
            gathered (FSDP2 only). Default None.

    Returns:
        Dict[str, torch.Tensor]: full state dict or adapter tensors, keyed as
        ``model.state_dict()``.
    """
    from torch.distributed.fsdp import FSDPModule

    sharded = isinstance(model, FSDPModule)
    if not adapter_only:
        if sharded:  # the state-dict hook adds S to the whole weights, here to the gathered
            full = training.gather_cpu_state_dict(model, is_rank_zero, device=device)
            if is_rank_zero:
                add_outliers_(model, full, sharded=True)
            return full
        return model.state_dict()
    state = adapter_state(model)
    if not sharded:
        return state
    out = {}
    for key, value in state.items():  # the same order on every rank: full_tensor is collective
        if isinstance(value, DTensor):
            if value.is_cpu and device is not None:  # offloaded shards gather on the device
                value = value.to(device)
            value = value.full_tensor()
        if is_rank_zero:
            out[key] = value.detach().cpu()
    return out


def squash_adapter(full_sd: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The adapter as squash holds it (FFI ``values`` and ``indices``, dense ``weight``),
    detached, contiguous, on the CPU."""
    return {k: v.detach().cpu().contiguous() for k, v in full_sd.items() if is_adapter_key(k)}


def _plain(value: torch.Tensor) -> torch.Tensor:
    if hasattr(value, "get_original_weight"):  # NF4
        value = value.get_original_weight()
    return value.detach().cpu()


@torch.no_grad()
def merged_weights(
    full_sd: Mapping[str, torch.Tensor], layout: Mapping[str, AdapterLayout], dtype: torch.dtype
) -> Dict[str, torch.Tensor]:
    """The base state dict with every adapter merged, on the CPU: each adapted ``weight``
    becomes ``W + (alpha / rank) * B_dense @ A_dense`` computed in float32 (NF4 bases
    dequantized); adapter keys (and DoRA magnitudes) are dropped; floating tensors in ``dtype``."""
    adapters = dense_adapter(full_sd, layout)
    out = {}
    for key, value in full_sd.items():
        if is_adapter_key(key) or key.endswith(".magnitude"):
            continue
        value = _plain(value)
        name = key[: -len(".weight")] if key.endswith(".weight") else None
        if name in layout:
            a, b = adapters[f"{name}.lora_a.weight"], adapters[f"{name}.lora_b.weight"]
            value = merge_lora(value, a, b, layout[name].scaling)
        out[key] = value.to(dtype) if value.is_floating_point() else value
    return out


def peft_config(model_cfg: Any, layout: Mapping[str, AdapterLayout]) -> Dict[str, Any]:
    """PEFT's ``adapter_config.json`` fields for a model config block (torchtune's LoRA keys),
    rank and alpha of the first adapter."""
    from torchtune.modules.peft import get_lora_module_names

    first = next(iter(layout.values()))
    return {
        "r": first.rank,
        "lora_alpha": first.alpha,
        "target_modules": get_lora_module_names(
            list(model_cfg.lora_attn_modules),
            model_cfg.get("apply_lora_to_mlp", False),
            model_cfg.get("apply_lora_to_output", False),
        ),
        "peft_type": "LORA",
    }


def peft_adapter(
    dense: Dict[str, torch.Tensor],
    config: Dict[str, Any],
    svd_init: Optional[Dict[str, torch.Tensor]] = None,
) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """The PEFT adapter and its config for the *original* pretrained weights.

    Without ``svd_init`` that is ``dense`` and ``config`` as they are. With ``model.init: svd``
    (which moved ``B0 A0`` out of the base) it is the adapter of twice the rank whose product is
    ``B A - B0 A0``: ``A' = [A; A0]`` ``(2r, in)``, ``B' = [B, -B0]`` ``(out, 2r)``, and
    ``lora_alpha`` doubles with the rank to keep the scaling.

    Args:
        dense (Dict[str, torch.Tensor]): :func:`dense_adapter` of the trained model.
        config (Dict[str, Any]): :func:`peft_config`.
        svd_init (Optional[Dict[str, torch.Tensor]]): :func:`dense_adapter` of the adapters as
            the SVD initialised them.
    """
    if svd_init is None:
        return dense, config
    out = {}
    for key, value in dense.items():
        if key.endswith(".lora_a.weight"):
            out[key] = torch.cat([value, svd_init[key]], dim=0).contiguous()
        else:
            out[key] = torch.cat([value, -svd_init[key]], dim=1).contiguous()
    return out, dict(config, r=2 * config["r"], lora_alpha=2 * config["lora_alpha"])


@dataclass
class Exports:
    """What :func:`squash.runs.checkpoint.write_checkpoint` writes of the model."""

    squash_adapter: Dict[str, torch.Tensor]
    squash_adapter_config: Dict[str, Any]
    checkpointer_state: Dict[str, Any]  # model (merged), adapter (PEFT, dense), adapter_config


def checkpoint_exports(
    full_sd: Mapping[str, torch.Tensor],
    layout: Mapping[str, AdapterLayout],
    model_cfg: Any,
    *,
    dtype: torch.dtype,
    adapter_only: bool,
    svd_init: Optional[Dict[str, torch.Tensor]] = None,
) -> Exports:
    """Everything a checkpoint holds of the model, from one full state dict.

    Args:
        full_sd (Mapping[str, torch.Tensor]): :func:`state_to_export` of the model: its full
            state dict, or with ``adapter_only`` its adapter tensors alone.
        layout (Mapping[str, AdapterLayout]): :func:`adapter_layout` of the model.
        model_cfg (Any): the ``model`` config block (recorded, to rebuild the model).
        dtype (torch.dtype): dtype of the merged weights.
        adapter_only (bool): leave out the merged weights.
        svd_init (Optional[Dict[str, torch.Tensor]]): with ``model.init: svd``, the dense
            initial factors (see :func:`peft_adapter`).
    """
    config = peft_config(model_cfg, layout)
    adapter, adapter_config = peft_adapter(dense_adapter(full_sd, layout), config, svd_init)
    state: Dict[str, Any] = {training.ADAPTER_KEY: adapter, training.ADAPTER_CONFIG: adapter_config}
    if not adapter_only:
        state[training.MODEL_KEY] = merged_weights(full_sd, layout, dtype)
    return Exports(
        squash_adapter=squash_adapter(full_sd),
        squash_adapter_config={"model": to_plain(model_cfg), **config},
        checkpointer_state=state,
    )
