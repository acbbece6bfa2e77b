"""Modules: ``FFILinear`` (a sparse ``nn.Linear``), ``SparseLoRALinear`` (an adapter module) and
model surgery that swaps torchtune's ``LoRALinear`` for it; ``FlatTiedLinear``, a tied output
projection computed as one 2-D matmul; ``NF4LoRALinear`` and ``NF4Linear``, torchtune's NF4
modules computed with squash's NF4 kernel (from :mod:`squash.nf4`, re-exported here)."""

from squash.modules.adapter import SparseAdapterModule, get_adapter_modules, is_lora_adapter
from squash.modules.ffi_linear import FFILinear
from squash.nf4.modules import NF4Linear, NF4LoRALinear, is_plain_lora, use_squash_nf4_
from squash.modules.sparse_lora import (
    SparseLoRALinear,
    lora_factor,
    sparse_lora_linear,
    svd_factors,
)
from squash.modules.surgery import (
    adapter_state_dict,
    get_adapter_buffers,
    svd_initialize,
    swap_lora_linear,
)
from squash.modules.tied import FlatTiedLinear, flatten_tied_output

__all__ = [
    "FFILinear",
    "FlatTiedLinear",
    "NF4LoRALinear",
    "NF4Linear",
    "SparseAdapterModule",
    "SparseLoRALinear",
    "sparse_lora_linear",
    "svd_factors",
    "adapter_state_dict",
    "flatten_tied_output",
    "get_adapter_buffers",
    "get_adapter_modules",
    "is_lora_adapter",
    "is_plain_lora",
    "lora_factor",
    "svd_initialize",
    "swap_lora_linear",
    "use_squash_nf4_",
]
