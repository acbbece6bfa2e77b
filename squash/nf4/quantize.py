"""NF4 quantization for every weight shape: block sizes chosen per weight, and a model's frozen
bases quantized in place.

torchao quantizes blocks of ``block_size`` elements (64 by default) and then the blocks' scalers
in blocks of ``scaler_block_size`` (256), so its defaults only take weights with a multiple of
16384 elements: SmolLM2's 576x576 and 192x576 projections are refused.
:func:`nf4_block_sizes` picks, per weight, the largest scaler block size (and only if needed the
largest block size) that divides it, and :func:`quantize_nf4` quantizes with them; the NF4 tensor
itself records both (``NF4Tensor.block_size``, ``.scaler_block_size``), so dequantization, a
state-dict load (torchao's ``copy_`` re-quantizes a plain tensor with the target's sizes) and a
clone (squash's, :func:`~squash.nf4.install_torchao_extensions`) keep them.
"""

from typing import Optional, Tuple

import torch

from squash.nf4._torchao import NF4Tensor, linear_nf4, to_nf4
from squash.nf4.extensions import install_torchao_extensions

__all__ = [
    "NF4Tensor",
    "check_nf4_shape",
    "linear_nf4",
    "nf4_block_sizes",
    "nf4_bytes",
    "quantize_nf4",
    "to_nf4",
]

DEFAULT_BLOCK_SIZE = 64  # torchao's (and QLoRA's) defaults
DEFAULT_SCALER_BLOCK_SIZE = 256
# Block sizes tried, largest first: powers of two down to 32, bitsandbytes' smallest NF4 block.
# Each halving costs another 8-bit scaler per block (+0.125 bit per weight at 64 -> 32).
BLOCK_SIZES = (64, 32)


def check_nf4_shape(
    name: str, shape: tuple, block_size: int = 64, scaler_block_size: int = 256
) -> None:
    """Refuse, naming ``name``, a weight shape that torchao cannot quantize to NF4.

    torchao's ``to_nf4`` quantizes blocks of ``block_size`` elements and then the block scalers in
    blocks of ``scaler_block_size``, so the number of elements must be a multiple of
    ``block_size * scaler_block_size`` (16384 with the defaults); otherwise it fails with a bare
    ``AssertionError`` (or, under ``python -O``, a reshape error).

    Raises:
        ValueError: naming the module, the shape and the block sizes.
    """
    shape = tuple(int(d) for d in shape)
    numel = 1
    for d in shape:
        numel *= d
    unit = block_size * scaler_block_size
    if len(shape) > 2 or numel == 0 or numel % unit != 0:
        raise ValueError(
            f"{name}: cannot quantize a weight of shape {shape} ({numel} elements) to NF4 with "
            f"torchao's block_size={block_size} and scaler_block_size={scaler_block_size}: the "
            f"number of elements must be a non-zero multiple of block_size * scaler_block_size "
            f"= {unit} (use quantize_base=False for this layer's size)"
        )


def _numel(shape: tuple) -> int:
    numel = 1
    for d in shape:
        numel *= int(d)
    return numel


def nf4_block_sizes(name: str, shape: tuple) -> Tuple[int, int]:
    """The NF4 ``(block_size, scaler_block_size)`` for a weight of ``shape``.

    torchao's defaults (64, 256) where they divide it; otherwise block size 64 and the largest
    scaler block size at most 256 that divides the number of blocks; only if 64 does not divide
    the number of elements, block size 32 (and its largest scaler block size). For example
    576x576 (5184 blocks of 64) gets (64, 216), 192x576 (1728 blocks) gets (64, 216).

    Args:
        name (str): what the weight is, for the error message.
        shape (tuple): the weight's shape (at most 2-D).

    Returns:
        Tuple[int, int]: ``(block_size, scaler_block_size)``.

    Raises:
        ValueError: naming ``name`` and the shape, when no block size in ``BLOCK_SIZES``
            divides the number of elements (or the weight is empty or more than 2-D).
    """
    shape = tuple(int(d) for d in shape)
    numel = _numel(shape)
    if len(shape) <= 2 and numel > 0:
        for block in BLOCK_SIZES:
            if numel % block == 0:
                blocks = numel // block
                scaler = max(
                    s for s in range(1, DEFAULT_SCALER_BLOCK_SIZE + 1) if blocks % s == 0
                )
                return block, scaler
    raise ValueError(
        f"{name}: cannot quantize a weight of shape {shape} ({numel} elements) to NF4: no block "
        f"size in {BLOCK_SIZES} divides it (torchao's defaults are "
        f"block_size={DEFAULT_BLOCK_SIZE} and scaler_block_size={DEFAULT_SCALER_BLOCK_SIZE}; "
        f"use quantize_base=False for this layer's size)"
    )


def quantize_nf4(
    weight: torch.Tensor,
    name: str = "weight",
    block_size: Optional[int] = None,
    scaler_block_size: Optional[int] = None,
) -> NF4Tensor:
    """torchao's ``to_nf4`` of ``weight`` with the block sizes of :func:`nf4_block_sizes`.

    Given block sizes are used as they are (checked by :func:`check_nf4_shape`); with none given
    they are chosen for the shape. The result is exactly ``to_nf4(weight, block, scaler)``.

    Raises:
        ValueError: naming ``name``, as :func:`nf4_block_sizes` or :func:`check_nf4_shape`.
    """
    if block_size is None and scaler_block_size is None:
        block_size, scaler_block_size = nf4_block_sizes(name, tuple(weight.shape))
    else:
        block_size = block_size or DEFAULT_BLOCK_SIZE
        scaler_block_size = scaler_block_size or DEFAULT_SCALER_BLOCK_SIZE
        check_nf4_shape(name, tuple(weight.shape), block_size, scaler_block_size)
    install_torchao_extensions()
    return to_nf4(weight, block_size, scaler_block_size)


def nf4_bytes(weight: NF4Tensor) -> int:
    """Bytes an NF4 tensor holds: its packed 4-bit codes, int8 block scalers, per-scaler-block
    factors, the scaler mean and the 16-entry code book (each at its own dtype)."""
    names = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")
    return sum(getattr(weight, n).numel() * getattr(weight, n).element_size() for n in names)
