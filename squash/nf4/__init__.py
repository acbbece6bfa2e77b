"""Better 4-bit bases on torchao's NF4: a corrected base with a Fixed Fan-In outlier matrix
(:mod:`squash.nf4.outliers`, SpQR's idea) and LoftQ's adapter initialization
(:mod:`squash.nf4.loftq`). squash's NF4 quantization itself stays in
:mod:`squash.modules._nf4` and :mod:`squash.ops.nf4`."""

from squash.nf4.loftq import loftq_factors
from squash.nf4.outliers import (
    CRITERIA,
    NF4WithOutliers,
    Outliers,
    SecondMoment,
    corrected_base,
    outlier_fan_in,
    outlier_linear,
    outlier_scores,
    quantize_blocks,
    removal_gains,
    select_outliers,
    split_outliers,
)

__all__ = [
    "CRITERIA",
    "NF4WithOutliers",
    "Outliers",
    "SecondMoment",
    "corrected_base",
    "loftq_factors",
    "outlier_fan_in",
    "outlier_linear",
    "outlier_scores",
    "quantize_blocks",
    "removal_gains",
    "select_outliers",
    "split_outliers",
]
