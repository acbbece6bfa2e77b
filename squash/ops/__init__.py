"""FFI and NF4 custom ops (``torch.ops.squash.*``), kernel loading and the pure-PyTorch reference
(the NF4 ops live in :mod:`squash.nf4`, re-exported here)."""

from squash.ops import reference
from squash.ops._loader import ensure_loaded, kernels_dir, status
from squash.ops.ffi_linear import ffi_linear
from squash.nf4.ops import nf4_dequantize, nf4_linear

__all__ = [
    "ensure_loaded",
    "ffi_linear",
    "kernels_dir",
    "nf4_dequantize",
    "nf4_linear",
    "reference",
    "status",
]
