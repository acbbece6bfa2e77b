"""A corrected 4-bit base: NF4 with its worst errors held in a Fixed Fan-In outlier matrix.

SpQR's idea (Dettmers, Svirschevski et al., 2023) on squash's own format and kernels:

    W ~= dequant(NF4(W - S)) + S

where ``S`` is an FFI matrix (:mod:`squash.sparsity.ffi`) with the same number ``k`` of entries in
every row, the outliers. They are chosen by one of two criteria on the NF4 error
``E = W - dequant(NF4(W_rest))``:

- ``"magnitude"``: ``|E[o, j]|``;
- ``"sensitivity"``: ``E[o, j]^2 * E[x_j^2]``, SpQR's saliency ``(w - q(w))^2 / [H^-1]_jj`` with
  the layer's Hessian ``H = 2 X^T X`` taken as its diagonal (``[H^-1]_jj = 1 / H_jj``), i.e. the
  error weighted by the second moment of input feature ``j`` over calibration tokens.

The outliers are removed (set to zero) before NF4 quantizes the rest. Neither criterion above
picks a block's absmax entry (NF4 maps it to +-1 times its own scale, nearly exactly), so on
their own they leave the block scales as they were. ``scale_aware=True`` scores what removing an
entry wins, SpQR's leave-one-out view of outlier detection: for every entry its own (weighted)
squared error, and for each block's absmax entry, in addition, the drop in the block's other
entries' (weighted) squared error when the block is re-quantized with the next largest absmax as
its scale (NF4 levels, without the scalers' double quantization). Then the removed entries are
often block maxima and the remaining blocks get finer steps.

Selection and quantization alternate ``rounds`` times:
round 1 selects on the error of plain ``NF4(W)``; each later round re-selects on the error of the
previous round's ``NF4(W_rest)`` (a removed entry then counts with its whole value, since NF4
codes zero exactly). ``S``'s values are ``W - dequant(NF4(W_rest))`` at the outliers (``W``
itself there, as the rest is zero), rounded to ``values_dtype``. When no selected entry is a
block's absmax (the usual case for the error criteria) the scales stay, every other entry's
error with them, and a second round selects the same entries.

The frozen base forward is ``nf4_linear(x, base) + ffi_linear(x, values, indices)``: both ops
carry the input gradient, neither gives one to the weights. ``fraction = 0`` (``k = 0``) is plain
NF4, bit for bit.
"""

from typing import NamedTuple, Optional, Tuple

import torch
from torch import nn

from squash.nf4.quantize import (
    DEFAULT_SCALER_BLOCK_SIZE,
    NF4Tensor,
    deepcopy_module,
    quantize_nf4,
)
from squash.ops.ffi_linear import ffi_linear
from squash.nf4.ops import nf4_dequantize, nf4_linear
from squash.sparsity.ffi import ffi_to_dense, index_dtype, validate_ffi

__all__ = [
    "CRITERIA",
    "NF4WithOutliers",
    "Outliers",
    "SecondMoment",
    "corrected_base",
    "outlier_fan_in",
    "outlier_linear",
    "outlier_scores",
    "quantize_blocks",
    "removal_gains",
    "select_outliers",
    "split_outliers",
]

CRITERIA = ("magnitude", "sensitivity")


class Outliers(NamedTuple):
    """An FFI outlier matrix: ``values`` ``(out, k)`` and sorted ``indices`` ``(out, k)``."""

    values: torch.Tensor
    indices: torch.Tensor


def outlier_fan_in(in_dim: int, fraction: float) -> int:
    """Outliers per row: ``round(fraction * in_dim)`` (0 for ``fraction == 0``), at least 1 for
    any positive fraction.

    Args:
        in_dim (int): the weight's columns (``in_features``).
        fraction (float): share of each row kept as an outlier, in ``[0, 1)``.

    Raises:
        ValueError: naming ``in_dim`` or ``fraction`` when out of range.
    """
    if isinstance(in_dim, bool) or not isinstance(in_dim, int) or in_dim < 1:
        raise ValueError(f"in_dim must be a positive int, got {in_dim!r}")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise ValueError(f"fraction must be a number in [0, 1), got {fraction!r}")
    if not 0.0 <= float(fraction) < 1.0:
        raise ValueError(f"fraction must be in [0, 1), got {fraction}")
    if fraction == 0:
        return 0
    return max(1, min(in_dim - 1, round(float(fraction) * in_dim)))


def quantize_blocks(
    weight: torch.Tensor, name: str = "weight", block_size: Optional[int] = None
) -> NF4Tensor:
    """torchao NF4 of ``weight``: squash's block sizes (``nf4_block_sizes``)
    when ``block_size`` is None, else ``block_size`` with the largest scaler block size at most
    256 that divides the number of blocks (e.g. 32 for a bits-matched finer control)."""
    if block_size is None:
        return quantize_nf4(weight, name)
    numel = weight.numel()
    if block_size < 2 or numel % block_size:
        raise ValueError(f"{name}: block_size {block_size} does not divide {numel} elements")
    blocks = numel // block_size
    scaler = max(s for s in range(1, DEFAULT_SCALER_BLOCK_SIZE + 1) if blocks % s == 0)
    return quantize_nf4(weight, name, block_size, scaler)


def _dequant(base: NF4Tensor) -> torch.Tensor:
    return nf4_dequantize(base)


def _check_weight(weight: torch.Tensor) -> None:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must be a 2-D floating tensor (out, in), got {shape}")


def _check_second_moment(weight: torch.Tensor, criterion: str, second_moment) -> None:
    if criterion not in CRITERIA:
        raise ValueError(f"criterion must be one of {CRITERIA}, got {criterion!r}")
    if criterion == "sensitivity":
        if second_moment is None:
            raise ValueError("criterion 'sensitivity' needs second_moment (in_features,)")
        if tuple(second_moment.shape) != (weight.shape[1],):
            raise ValueError(
                f"second_moment must have shape ({weight.shape[1]},) (in_features), got "
                f"{tuple(second_moment.shape)}"
            )


def outlier_scores(
    error: torch.Tensor, criterion: str = "magnitude", second_moment: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Per-entry score of a quantization error ``(out, in)``: ``|E|`` or ``E^2 * E[x_j^2]``
    (in float64, so ties and order do not depend on the weight's dtype)."""
    _check_second_moment(error, criterion, second_moment)
    e = error.detach().double()
    if criterion == "magnitude":
        return e.abs()
    return e.square() * second_moment.detach().double().to(e.device)[None, :]


def _nf4_fake(w: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """``w`` (blocks, b) rounded to the nearest NF4 level times its block's ``scale`` (blocks, 1)
    (ties as torchao: the lower level)."""
    mids = (levels[1:] + levels[:-1]) / 2
    normed = (w / scale.clamp_min(torch.finfo(w.dtype).tiny)).clamp(-1, 1)
    return levels[torch.bucketize(normed, mids)] * scale


def removal_gains(
    weight: torch.Tensor,
    error: torch.Tensor,
    block_size: int,
    levels: torch.Tensor,
    column_weights: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """What removing each entry saves in (column-weighted) squared error, ``(out, in)`` float64.

    Every entry saves its own ``E^2 w_j``. A block's absmax entry saves, in addition, the drop in
    its block's other entries' error when the block's scale becomes the next largest absmax: the
    current error of those entries minus their error at the new scale (nearest NF4 level,
    scalers not double-quantized).

    Args:
        weight (torch.Tensor): ``(out, in)``, ``out * in`` a multiple of ``block_size``.
        error (torch.Tensor): ``weight - dequant(NF4(weight))``.
        block_size (int): NF4 block size (blocks run along the flattened rows, as torchao's).
        levels (torch.Tensor): the 16 NF4 levels (``NF4Tensor.nf4``).
        column_weights (Optional[torch.Tensor]): ``(in,)``, e.g. the input's second moment;
            None = 1.
    """
    out_dim, in_dim = weight.shape
    w = weight.detach().double().reshape(-1, block_size)  # (blocks, b)
    cw = (torch.ones(in_dim, dtype=torch.float64) if column_weights is None
          else column_weights.detach().double().cpu())  # fmt: skip
    cw = cw.to(w.device).expand(out_dim, in_dim).reshape(-1, block_size)  # (blocks, b)
    own = error.detach().double().reshape(-1, block_size).square() * cw  # (blocks, b)
    top2 = w.abs().topk(2, dim=1)
    p = top2.indices[:, :1]  # (blocks, 1) the absmax entry
    others = torch.ones_like(w, dtype=torch.bool).scatter(1, p, False)
    requant = _nf4_fake(w, top2.values[:, 1:], levels.double().to(w.device))
    after = ((w - requant).square() * cw * others).sum(1)  # (blocks,)
    before = (own * others).sum(1)
    gains = own.clone()
    gains.scatter_add_(1, p, (before - after).unsqueeze(1))
    return gains.reshape(out_dim, in_dim)


def _top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted column ids of each row's ``k`` largest scores (ties towards lower columns)."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    return torch.sort(order[:, :k], dim=1).values


def select_outliers(
    weight: torch.Tensor,
    fan_in: int,
    criterion: str = "magnitude",
    second_moment: Optional[torch.Tensor] = None,
    *,
    base: Optional[NF4Tensor] = None,
    block_size: Optional[int] = None,
    values_dtype: Optional[torch.dtype] = torch.bfloat16,
    scale_aware: bool = False,
) -> Outliers:
    """One selection: the ``fan_in`` entries of each row with the largest score of the error
    ``W - dequant(base)`` (``base`` defaults to ``NF4(W)``).

    Args:
        weight (torch.Tensor): ``(out, in)`` floating.
        fan_in (int): outliers per row ``k``, ``1 <= k < in`` (see :func:`outlier_fan_in`).
        criterion (str): ``"magnitude"`` or ``"sensitivity"``.
        second_moment (Optional[torch.Tensor]): ``(in,)`` mean of ``x_j^2`` over calibration
            tokens; required for ``"sensitivity"``.
        base (Optional[NF4Tensor]): the quantization the error is measured against.
        block_size (Optional[int]): NF4 block size when ``base`` is None (see
            :func:`quantize_blocks`).
        values_dtype (Optional[torch.dtype]): dtype of the values; None keeps ``weight.dtype``.
        scale_aware (bool): score by :func:`removal_gains` (own squared error, weighted by the
            second moment for ``"sensitivity"``, plus the block's gain from a finer scale for
            its absmax entry) instead of the error alone.

    Returns:
        Outliers: values are the error at the chosen entries, indices in
        :func:`~squash.sparsity.index_dtype`.

    Raises:
        ValueError: naming ``weight``, ``fan_in``, ``criterion`` or ``second_moment``.
    """
    _check_weight(weight)
    _check_second_moment(weight, criterion, second_moment)
    if isinstance(fan_in, bool) or not isinstance(fan_in, int) or not 1 <= fan_in < weight.shape[1]:
        raise ValueError(f"fan_in must be an int in [1, {weight.shape[1]}), got {fan_in!r}")
    if base is None:
        base = quantize_blocks(weight.detach(), block_size=block_size)
    error = weight.detach() - _dequant(base).to(weight.dtype)
    if scale_aware:
        scores = removal_gains(weight, error, base.block_size, base.nf4,
                               second_moment if criterion == "sensitivity" else None)  # fmt: skip
    else:
        scores = outlier_scores(error, criterion, second_moment)
    idx = _top_k(scores, fan_in)
    values = torch.gather(error, 1, idx).to(values_dtype or weight.dtype)
    return Outliers(values, idx.to(index_dtype(weight.shape[1])))


def split_outliers(
    weight: torch.Tensor,
    fraction: Optional[float] = None,
    criterion: str = "magnitude",
    second_moment: Optional[torch.Tensor] = None,
    *,
    fan_in: Optional[int] = None,
    rounds: int = 2,
    block_size: Optional[int] = None,
    values_dtype: Optional[torch.dtype] = torch.bfloat16,
    scale_aware: bool = False,
    name: str = "weight",
) -> Tuple[NF4Tensor, Optional[Outliers]]:
    """``W ~= dequant(NF4(W_rest)) + S``: the NF4 base of ``W`` with its outliers removed, and
    the outliers.

    ``rounds`` times: select (round 1 on ``NF4(W)``'s error, then on the previous base's), zero
    the selected entries of ``W`` to get ``W_rest``, quantize ``W_rest``. The base is exactly
    ``to_nf4(W_rest, block, scaler)`` (squash's block sizes for the shape unless ``block_size``).

    Args:
        weight (torch.Tensor): ``(out, in)`` floating.
        fraction (Optional[float]): outliers per row as a share of ``in`` (see
            :func:`outlier_fan_in`); exactly one of ``fraction`` and ``fan_in``.
        criterion (str): ``"magnitude"`` or ``"sensitivity"``.
        second_moment (Optional[torch.Tensor]): ``(in,)``, for ``"sensitivity"``.
        fan_in (Optional[int]): outliers per row, instead of ``fraction``.
        rounds (int): select-remove-quantize passes, >= 1. Default 2.
        block_size (Optional[int]): NF4 block size (default: squash's for the shape).
        values_dtype (Optional[torch.dtype]): the outliers' dtype (default bfloat16, 16 bits);
            None keeps ``weight.dtype``.
        scale_aware (bool): select once by :func:`removal_gains` on plain ``NF4(W)`` (see
            :func:`select_outliers`); ``rounds`` is then not used (a later round's gains, taken
            against a base whose scales already changed, would undervalue the removed maxima).
        name (str): the weight's name, for errors.

    Returns:
        Tuple[NF4Tensor, Optional[Outliers]]: the base and the outliers (None when ``k == 0``:
        the base is then plain ``NF4(W)``).

    Raises:
        ValueError: naming ``weight``, ``fraction``/``fan_in``, ``criterion``,
            ``second_moment`` or ``rounds``.
    """
    _check_weight(weight)
    if (fraction is None) == (fan_in is None):
        raise ValueError("give exactly one of fraction and fan_in")
    k = outlier_fan_in(weight.shape[1], fraction) if fan_in is None else fan_in
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")
    _check_second_moment(weight, criterion, second_moment)
    w = weight.detach()
    base = quantize_blocks(w, name, block_size)
    if k == 0:
        return base, None
    for _ in range(1 if scale_aware else rounds):
        out = select_outliers(w, k, criterion, second_moment, base=base, values_dtype=None,
                              scale_aware=scale_aware)  # fmt: skip
        rest = w.scatter(1, out.indices.long(), 0.0)
        base = quantize_blocks(rest, name, block_size)
    # Values: what the final base misses at the outliers (W there, as NF4 codes 0 exactly).
    error = w - _dequant(base).to(w.dtype)
    values = torch.gather(error, 1, out.indices.long()).to(values_dtype or w.dtype)
    return base, Outliers(values, out.indices)


def corrected_base(base: NF4Tensor, outliers: Optional[Outliers]) -> torch.Tensor:
    """The dense corrected weight ``dequant(base) + S`` in ``base.dtype``."""
    dense = _dequant(base)
    if outliers is None:
        return dense
    s = ffi_to_dense(outliers.values.to(dense.dtype), outliers.indices, dense.shape[1])
    return dense + s


def outlier_linear(
    x: torch.Tensor, base: NF4Tensor, outliers: Optional[Outliers]
) -> torch.Tensor:
    """``nf4_linear(x, base) + ffi_linear(x, S)``: the corrected frozen base's product, in
    ``x.dtype`` (the outliers cast to it); the gradient flows to ``x`` through both ops."""
    y = nf4_linear(x, base)
    if outliers is None:
        return y
    return y + ffi_linear(x, outliers.values.to(x.dtype), outliers.indices)


class NF4WithOutliers(nn.Module):
    """A frozen bias-free linear with a corrected 4-bit weight: ``weight`` (an NF4 parameter,
    ``requires_grad=False``) plus buffers ``outlier_values`` and ``outlier_indices``
    ``(out_features, k)``. Forward: :func:`outlier_linear`.

    Args:
        base (NF4Tensor): ``(out_features, in_features)``.
        outliers (Optional[Outliers]): validated against the FFI contract; None = plain NF4.

    Raises:
        ValueError: outliers whose shape or indices break the FFI contract.
    """

    def __init__(self, base: NF4Tensor, outliers: Optional[Outliers] = None):
        super().__init__()
        self.out_features, self.in_features = base.shape
        self.weight = nn.Parameter(base, requires_grad=False)
        if outliers is not None:
            if outliers.values.shape[0] != self.out_features:
                raise ValueError(
                    f"outliers have {outliers.values.shape[0]} rows, the base {self.out_features}"
                )
            validate_ffi(outliers.values, outliers.indices, self.in_features, where="outliers")
            self.register_buffer("outlier_values", outliers.values)
            self.register_buffer("outlier_indices", outliers.indices)
        else:
            self.outlier_values = self.outlier_indices = None

    @classmethod
    def from_dense(cls, weight: torch.Tensor, fraction: float, criterion: str = "magnitude",
                   second_moment: Optional[torch.Tensor] = None, **kwargs) -> "NF4WithOutliers":
        """:func:`split_outliers` of ``weight`` (keyword arguments passed on)."""  # fmt: skip
        return cls(*split_outliers(weight, fraction, criterion, second_moment, **kwargs))

    def __deepcopy__(self, memo):  # the NF4 base copied as it is (its own block sizes)
        return deepcopy_module(self, memo)

    def outliers(self) -> Optional[Outliers]:
        if self.outlier_values is None:
            return None
        return Outliers(self.outlier_values, self.outlier_indices)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return outlier_linear(x, self.weight, self.outliers())

    def dense_weight(self) -> torch.Tensor:
        """:func:`corrected_base` of this module's weight and outliers."""
        return corrected_base(self.weight, self.outliers())


class SecondMoment:
    """Running mean of ``x_j^2`` over every token a linear sees (its input's last dimension), in
    float64: ``update(x)`` per batch (e.g. from a forward pre-hook), ``value()`` at the end."""

    def __init__(self, in_features: int):
        self.sum = torch.zeros(in_features, dtype=torch.float64)
        self.count = 0

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).double()
        self.sum += x.square().sum(0).cpu()
        self.count += x.shape[0]

    def value(self) -> torch.Tensor:
        if self.count == 0:
            raise ValueError("SecondMoment.value(): no tokens seen")
        return self.sum / self.count

