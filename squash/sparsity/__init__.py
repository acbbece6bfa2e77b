"""The Fixed Fan-In (FFI) sparse format and mask updates."""

from squash.sparsity.ffi import (
    fan_in_for,
    ffi_to_dense,
    index_dtype,
    prune_to_ffi,
    random_ffi_indices,
    validate_ffi,
)

__all__ = [
    "fan_in_for",
    "ffi_to_dense",
    "index_dtype",
    "prune_to_ffi",
    "random_ffi_indices",
    "validate_ffi",
]
