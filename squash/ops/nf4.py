"""The NF4 custom ops, now in :mod:`squash.nf4.ops`; this path is kept for code that imports it."""

from squash.nf4.ops import backend, nf4_dequantize, nf4_linear, reference_dequantize  # noqa: F401
