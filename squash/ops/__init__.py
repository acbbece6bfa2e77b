"""FFI custom ops (``torch.ops.squash.*``), kernel loading and the pure-PyTorch reference."""

from squash.ops import reference
from squash.ops._loader import ensure_loaded, kernels_dir, status
from squash.ops.ffi_linear import ffi_linear

__all__ = ["ensure_loaded", "ffi_linear", "kernels_dir", "reference", "status"]
