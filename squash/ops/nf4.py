"""The NF4 custom ops, now in :mod:`squash.nf4.ops`; this path is kept for code that imports it
(resolved on first use, so that ``squash.ops`` does not import the ``squash.nf4`` above it)."""

import importlib

_NAMES = ("backend", "nf4_dequantize", "nf4_linear", "reference_dequantize")


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module("squash.nf4.ops"), name)
    raise AttributeError(f"module 'squash.ops.nf4' has no attribute {name!r}")
