"""What an adapter is, in one place: torchtune's ``AdapterModule`` protocol, extended for adapters
that hold buffers (the FFI indices), and the one function that finds a model's LoRA adapters.

torchtune's ``get_adapter_params`` finds adapters by their ``adapter_params()`` method
(``modules/peft/_utils.py``); :func:`get_adapter_modules` keeps that rule and adds what every
LoRA adapter (torchtune's ``LoRALinear``, squash's ``SparseLoRALinear``) has: ``lora_a``,
``lora_b``, ``rank`` and ``alpha``. Checkpoints, memory accounting, adapter initialisation and
the recipes all ask it. :class:`AdapterLayout` and :func:`dense_adapter` read an adapter's
state dict (the exports and the OPT checkpointer share them).
"""

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Protocol, Tuple, runtime_checkable

import torch
from torch import nn
from torchtune.modules.peft import AdapterModule

from squash.sparsity.ffi import ffi_to_dense


@runtime_checkable
class SparseAdapterModule(AdapterModule, Protocol):
    """An adapter whose trainable state includes buffers: ``adapter_params()`` names its
    parameters (as torchtune's protocol does), ``adapter_buffers()`` the buffers an adapter
    checkpoint must also hold (an FFI factor's ``indices``)."""

    def adapter_params(self) -> List[str]: ...

    def adapter_buffers(self) -> List[str]: ...


def is_lora_adapter(module: nn.Module) -> bool:
    """Whether ``module`` is a LoRA adapter: an ``AdapterModule`` with ``lora_a``, ``lora_b``,
    ``rank`` and ``alpha``."""
    return callable(getattr(module, "adapter_params", None)) and all(
        hasattr(module, attr) for attr in ("lora_a", "lora_b", "rank", "alpha")
    )


def get_adapter_modules(model: nn.Module) -> Dict[str, nn.Module]:
    """Every LoRA adapter of ``model``, named as in ``model.state_dict()`` (without the wrapper
    names activation checkpointing adds)."""
    return {
        state_dict_key(name): m for name, m in model.named_modules() if is_lora_adapter(m)
    }


# What torch's checkpoint_wrapper (activation checkpointing) adds to module names and removes
# from state-dict keys.
_CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module."


def state_dict_key(name: str) -> str:
    """A module or tensor name as ``model.state_dict()`` spells it (without the
    ``_checkpoint_wrapped_module.`` that activation checkpointing adds to module names)."""
    return name.replace(_CHECKPOINT_WRAPPED, "")


@dataclass(frozen=True)
class AdapterLayout:
    """What the exports need to know of one adapter that its tensors do not say.

    ``alpha`` is None where only the shapes are known (a checkpointer given an adapter state
    dict): :func:`dense_adapter` reads ``in_features`` alone; the merge needs the scaling.
    """

    rank: int
    alpha: Optional[float]
    in_features: Tuple[int, int]  # input width of lora_a, of lora_b (the rank)

    @property
    def scaling(self) -> float:
        if self.alpha is None:
            raise ValueError("The adapter's alpha is unknown: its scaling cannot be computed")
        return self.alpha / self.rank


def adapter_layout(model: nn.Module) -> Dict[str, AdapterLayout]:
    """Every adapter of ``model`` by its state-dict name (only the structure is read)."""
    return {
        name: AdapterLayout(
            rank=module.rank,
            alpha=module.alpha,
            in_features=(module.lora_a.in_features, module.lora_b.in_features),
        )
        for name, module in get_adapter_modules(model).items()
    }


def merge_lora(
    base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``base + scaling * b @ a`` in float32: the one place an adapter is merged into its base
    (:meth:`~squash.modules.SparseLoRALinear.merged_weight` of one module,
    :func:`squash.export.adapters.merged_weights` of a whole state dict).

    Args:
        base (torch.Tensor): the dense base weight ``(out_dim, in_dim)`` (NF4 dequantized, a
            corrected base's outliers added).
        a (torch.Tensor): the dense ``A`` ``(rank, in_dim)``.
        b (torch.Tensor): the dense ``B`` ``(out_dim, rank)``.
        scaling (float): ``alpha / rank``.

    Returns:
        torch.Tensor: float32 ``(out_dim, in_dim)``.
    """
    return base.float() + scaling * (b.float() @ a.float())


def dense_adapter(
    full_sd: Mapping[str, torch.Tensor], layout: Mapping[str, AdapterLayout]
) -> Dict[str, torch.Tensor]:
    """Both factors of every adapter as dense tensors with ``LoRALinear``'s keys
    (``<module>.lora_a.weight`` ``(rank, in)``, ``<module>.lora_b.weight`` ``(out, rank)``), on the
    CPU: what PEFT and torchtune's checkpointers take. FFI factors are scattered to dense.

    This is the one FFI -> dense conversion of an adapter: the recipes' exports and the OPT
    checkpointer (:func:`squash.models.opt._convert_weights.opt_adapter_layout` gives the
    layout of an adapter state dict it is handed) both call it.

    Args:
        full_sd (Mapping[str, torch.Tensor]): holds ``<module>.lora_a.*`` and
            ``<module>.lora_b.*`` of every module of ``layout``, each factor dense
            (``.weight``) or FFI (``.values`` and ``.indices``); other keys are ignored.
        layout (Mapping[str, AdapterLayout]): the adapters; only ``in_features`` is read.
    """
    out = {}
    for name, info in layout.items():
        for factor, width in zip(("lora_a", "lora_b"), info.in_features):
            prefix = f"{name}.{factor}"
            if f"{prefix}.indices" in full_sd:
                dense = ffi_to_dense(full_sd[f"{prefix}.values"], full_sd[f"{prefix}.indices"], width)
            else:
                dense = full_sd[f"{prefix}.weight"]
            out[f"{prefix}.weight"] = dense.detach().cpu().contiguous()
    return out
