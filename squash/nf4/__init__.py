"""NF4 in one place: torchao's NF4 tensor (one import fallback, :mod:`squash.nf4._torchao`),
block sizes for every weight shape and quantization (:mod:`~squash.nf4.quantize`), the
``torch.ops.squash.nf4_*`` custom ops (:mod:`~squash.nf4.ops`, registered on import), torchtune's
NF4 modules computed with them (:mod:`~squash.nf4.modules`). squash calls torchao's NF4 API and
its own functions beside it (:func:`to_nf4_exact`, :func:`copy_nf4_`, :func:`clone_nf4`), and
replaces no attribute of torchao's or torchtune's classes. The kernels are ``kernels/nf4_*``.
Better 4-bit bases on it: a corrected base with a Fixed Fan-In outlier matrix
(:mod:`~squash.nf4.outliers`, SpQR's idea; a model's corrected base and its config block in
:mod:`~squash.nf4.base_outliers`) and LoftQ's adapter initialization (:mod:`~squash.nf4.loftq`).
NF4 weights under FSDP2 (which can be split into row shards, and a rank's shard of one):
:mod:`~squash.nf4.sharding`.

The modules and quantization helpers (which import torchtune's modules) load on first use, so
``import squash`` (which registers the ops) stays as light as the ops are."""

import importlib

from squash.nf4._torchao import NF4Tensor, linear_nf4, to_nf4
from squash.nf4.ops import nf4_dequantize, nf4_linear

_LAZY = {
    "NF4Linear": "modules",
    "NF4LoRALinear": "modules",
    "is_plain_lora": "modules",
    "use_squash_nf4_": "modules",
    "check_nf4_shape": "quantize",
    "clone_nf4": "quantize",
    "copy_nf4_": "quantize",
    "nearest_nf4_level": "quantize",
    "quantize_on_load": "quantize",
    "to_nf4_exact": "quantize",
    "nf4_block_sizes": "quantize",
    "nf4_bytes": "quantize",
    "quantize_base_": "modules",
    "quantize_nf4": "quantize",
    "CRITERIA": "outliers",
    "NF4WithOutliers": "outliers",
    "Outliers": "outliers",
    "SecondMoment": "outliers",
    "corrected_base": "outliers",
    "outlier_fan_in": "outliers",
    "outlier_linear": "outliers",
    "outlier_scores": "outliers",
    "quantize_blocks": "outliers",
    "removal_gains": "outliers",
    "select_outliers": "outliers",
    "split_outliers": "outliers",
    "LoftQ": "loftq",
    "loftq_factors": "loftq",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"squash.nf4.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'squash.nf4' has no attribute {name!r}")


__all__ = [
    "CRITERIA",
    "LoftQ",
    "NF4Linear",
    "NF4LoRALinear",
    "NF4Tensor",
    "NF4WithOutliers",
    "Outliers",
    "SecondMoment",
    "check_nf4_shape",
    "clone_nf4",
    "copy_nf4_",
    "corrected_base",
    "is_plain_lora",
    "linear_nf4",
    "loftq_factors",
    "nearest_nf4_level",
    "nf4_block_sizes",
    "nf4_bytes",
    "nf4_dequantize",
    "nf4_linear",
    "outlier_fan_in",
    "outlier_linear",
    "outlier_scores",
    "quantize_base_",
    "quantize_blocks",
    "quantize_nf4",
    "quantize_on_load",
    "removal_gains",
    "select_outliers",
    "split_outliers",
    "to_nf4",
    "to_nf4_exact",
    "use_squash_nf4_",
]
