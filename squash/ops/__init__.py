"""The FFI custom ops (``torch.ops.squash.ffi_*``), kernel loading (for the NF4 ops too) and the
pure-PyTorch reference. The NF4 ops (``nf4_linear``, ``nf4_dequantize``) are :mod:`squash.nf4`'s,
which is built on this package."""

from squash.ops import reference
from squash.ops._loader import ensure_loaded, kernels_dir, status
from squash.ops.ffi_linear import ffi_linear


__all__ = [
    "ensure_loaded",
    "ffi_linear",
    "kernels_dir",
    "reference",
    "status",
]
