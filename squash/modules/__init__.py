"""Modules: ``FFILinear`` (a sparse ``nn.Linear``), ``SparseLoRALinear`` (an adapter module) and
model surgery that swaps torchtune's ``LoRALinear`` for it."""

from squash.modules.ffi_linear import FFILinear
from squash.modules.sparse_lora import SparseLoRALinear, lora_factor
from squash.modules.surgery import (
    adapter_state_dict,
    get_adapter_buffers,
    svd_initialize,
    swap_lora_linear,
)

__all__ = [
    "FFILinear",
    "SparseLoRALinear",
    "adapter_state_dict",
    "get_adapter_buffers",
    "lora_factor",
    "svd_initialize",
    "swap_lora_linear",
]
