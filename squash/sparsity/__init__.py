"""The Fixed Fan-In (FFI) sparse format: fan-in arithmetic, pruning to FFI, dense <-> FFI and
validation. This package imports nothing else of squash (mask updates, which work on modules and
optimizers, live in :mod:`squash.training`)."""

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
