"""FFI and NF4 custom ops (``torch.ops.squash.*``), kernel loading and the pure-PyTorch reference
(the NF4 ops live in :mod:`squash.nf4`, whose ``nf4_linear`` and ``nf4_dequantize`` are also
reachable here, resolved on first use: ``squash.nf4`` imports this package, not the reverse)."""

from squash.ops import reference
from squash.ops._loader import ensure_loaded, kernels_dir, status
from squash.ops.ffi_linear import ffi_linear


def __getattr__(name: str):
    if name in ("nf4_dequantize", "nf4_linear"):
        import importlib

        return getattr(importlib.import_module("squash.nf4.ops"), name)
    raise AttributeError(f"module 'squash.ops' has no attribute {name!r}")


__all__ = [
    "ensure_loaded",
    "ffi_linear",
    "kernels_dir",
    "nf4_dequantize",
    "nf4_linear",
    "reference",
    "status",
]
