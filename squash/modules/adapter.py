"""What an adapter is, in one place: torchtune's ``AdapterModule`` protocol, extended for adapters
that hold buffers (the FFI indices), and the one function that finds a model's LoRA adapters.

torchtune's ``get_adapter_params`` finds adapters by their ``adapter_params()`` method
(``modules/peft/_utils.py``); :func:`get_adapter_modules` keeps that rule and adds what every
LoRA adapter (torchtune's ``LoRALinear``, squash's ``SparseLoRALinear``) has: ``lora_a``,
``lora_b``, ``rank`` and ``alpha``. Checkpoints, memory accounting, adapter initialisation and
the recipes all ask it.
"""

from typing import Dict, List, Protocol, runtime_checkable

from torch import nn
from torchtune.modules.peft import AdapterModule


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
    from squash.modules.surgery import state_dict_key

    return {
        state_dict_key(name): m for name, m in model.named_modules() if is_lora_adapter(m)
    }
