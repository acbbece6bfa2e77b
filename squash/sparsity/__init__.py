"""The Fixed Fan-In (FFI) sparse format and mask updates."""

from squash.sparsity.ffi import (
    fan_in_for,
    ffi_to_dense,
    index_dtype,
    prune_to_ffi,
    random_ffi_indices,
    validate_ffi,
)
from squash.sparsity.mask_update import prune_and_regrow, record_dense_grads, update_masks

__all__ = [
    "fan_in_for",
    "ffi_to_dense",
    "index_dtype",
    "prune_and_regrow",
    "prune_to_ffi",
    "random_ffi_indices",
    "record_dense_grads",
    "update_masks",
    "validate_ffi",
]
