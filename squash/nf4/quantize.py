"""NF4 quantization for every weight shape: block sizes chosen per weight, and a model's frozen
bases quantized in place.

torchao quantizes blocks of ``block_size`` elements (64 by default) and then the blocks' scalers
in blocks of ``scaler_block_size`` (256), so its defaults only take weights with a multiple of
16384 elements: SmolLM2's 576x576 and 192x576 projections are refused.
:func:`nf4_block_sizes` picks, per weight, the largest scaler block size (and only if needed the
largest block size) that divides it, and :func:`quantize_nf4` quantizes with them; the NF4 tensor
itself records both (``NF4Tensor.block_size``, ``.scaler_block_size``), so dequantization, a
state-dict load (:func:`copy_nf4_`, as torchao's ``copy_``, re-quantizes a plain tensor with the
target's sizes) and a copy (:func:`clone_nf4`) keep them.

squash quantizes with its own functions and never replaces torchao's: :func:`to_nf4_exact` is
torchao's ``NF4Tensor.from_tensor`` step for step, except that the nearest level is found by
:func:`nearest_nf4_level` (two bracketing levels, not a ``(numel, 16)`` distance table); the codes
are equal (tests/modules/test_nf4_quantize.py). Everything of squash that makes an NF4 tensor
calls these; torchao's ``to_nf4``, ``copy_`` and ``clone`` stay torchao's (and torchtune's).
"""

import copy
from typing import Optional, Tuple

import torch

from squash.nf4._torchao import (
    NF4Tensor,
    SubclassTensorArgs,
    get_block_absmax,
    linear_nf4,
    to_nf4,
)

__all__ = [
    "NF4Tensor",
    "check_nf4_shape",
    "clone_nf4",
    "copy_nf4_",
    "deepcopy_module",
    "linear_nf4",
    "nearest_nf4_level",
    "nf4_block_sizes",
    "nf4_bytes",
    "quantize_nf4",
    "quantize_on_load",
    "to_nf4",
    "to_nf4_exact",
]

DEFAULT_BLOCK_SIZE = 64  # torchao's (and QLoRA's) defaults
DEFAULT_SCALER_BLOCK_SIZE = 256
# torchao's 16 NF4 levels (``NF4Tensor.from_tensor``), made in the weight's dtype as torchao does
NF4_LEVELS = (-1.0000, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0000,
              0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0000)  # fmt: skip
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
    return to_nf4_exact(weight, block_size, scaler_block_size)


def nearest_nf4_level(value: torch.Tensor, nf4: torch.Tensor) -> torch.Tensor:
    """torchao's ``NF4Tensor.quantize_tensor_nearest`` (the index of the nearest of the 16 NF4
    levels, the first on a tie), without its ``(numel, 16)`` distance table.

    The levels are sorted and ``|x - level|`` rounds monotonically in the level, so the nearest
    level is one of the two that bracket ``x``: ``bucketize`` on the midpoints finds one, and the
    same distances torchao compares decide between it and its neighbours (the lower index on a
    tie, as torchao's ``min``). NaN or inf (an all-zero block scaled 0/0, an inf weight) gets
    torchao's own answer. The result equals torchao's exactly (tests/modules/test_nf4_quantize.py).

    Args:
        value (torch.Tensor): ``(numel,)`` values scaled by their block's absmax.
        nf4 (torch.Tensor): ``(16,)`` the NF4 levels, ascending, of ``value``'s dtype.

    Returns:
        torch.Tensor: ``(numel,)`` int64 indices into ``nf4``.
    """
    mid = (nf4[1:] + nf4[:-1]) / 2
    i = torch.bucketize(value, mid)  # mid[i-1] < value <= mid[i]
    lower = (i - 1).clamp(min=0)
    upper = (i + 1).clamp(max=nf4.numel() - 1)
    d_i = (value - nf4[i]).abs()
    d_lower = (value - nf4[lower]).abs()
    d_upper = (value - nf4[upper]).abs()
    best = torch.where(d_upper < d_i, upper, i)
    d_best = torch.minimum(d_upper, d_i)
    best = torch.where(d_lower <= d_best, lower, best)
    odd = ~torch.isfinite(value)
    if value.device.type != "meta" and bool(odd.any()):
        best[odd] = NF4Tensor.quantize_tensor_nearest(value[odd], nf4)
    return best


@torch.no_grad()
def to_nf4_exact(weight: torch.Tensor, block_size: int = 64, scaler_block_size: int = 256):
    """torchao's ``to_nf4(weight, block_size, scaler_block_size)``, equal bit for bit, with the
    nearest levels found by :func:`nearest_nf4_level`.

    The steps are ``NF4Tensor.from_tensor``'s: the levels in ``weight``'s dtype, torchao's own
    double quantization of the block scalers, each element scaled by its block's absmax and
    coded to its nearest level, two codes a byte (the first in the high nibble). No block sizes
    are chosen or checked here (:func:`quantize_nf4` does both).

    Returns:
        NF4Tensor: with ``weight``'s shape, strides, dtype, device and ``requires_grad``.
    """
    if weight.dim() > 2 or weight.numel() % block_size:
        raise ValueError(f"cannot quantize a weight of shape {tuple(weight.shape)} to NF4 in "
                         f"blocks of {block_size}")  # fmt: skip
    nf4 = torch.tensor(NF4_LEVELS, device=weight.device, dtype=weight.dtype)
    flat = weight.flatten()
    n_blocks = weight.numel() // block_size
    scalers, factor, mean = NF4Tensor.double_quantize_scalers(flat, block_size, scaler_block_size)
    absmax = get_block_absmax(flat, block_size)
    scaled = flat.view(n_blocks, block_size) / absmax.unsqueeze(-1).expand(n_blocks, block_size)
    codes = nearest_nf4_level(scaled.flatten(), nf4).to(torch.uint8)
    data = (codes[::2] << 4 | codes[1::2]).to(torch.uint8)
    meta = SubclassTensorArgs(weight.size(), weight.stride(), weight.storage_offset(),
                              weight.dtype, weight.device, weight.requires_grad)  # fmt: skip
    return NF4Tensor(meta, block_size, n_blocks, scaler_block_size, scalers, factor, mean, data,
                     nf4)  # fmt: skip


def clone_nf4(weight: NF4Tensor) -> NF4Tensor:
    """A copy of ``weight`` with its own block sizes and quantized values (torchao's and
    torchtune's ``clone`` re-quantize the dequantized weight with the default sizes, which fails
    on, or changes, a weight quantized with other sizes): it dequantizes to exactly ``weight``'s
    values."""
    names, ctx = weight.__tensor_flatten__()
    inner = {n: getattr(weight, n).clone() for n in names}
    return NF4Tensor.__tensor_unflatten__(inner, ctx, weight.shape, weight.stride())


def deepcopy_module(module: torch.nn.Module, memo: dict) -> torch.nn.Module:
    """``copy.deepcopy(module, memo)`` with ``module``'s own NF4 parameters copied by
    :func:`clone_nf4` (as they are, block sizes included) instead of by NF4's ``clone``: the
    ``__deepcopy__`` of squash's NF4 modules. Everything else is copied as ``copy.deepcopy``
    copies a module (its state, ``__setstate__`` on a new instance)."""
    for param in module.parameters(recurse=False):
        if isinstance(param, NF4Tensor) and id(param) not in memo:
            memo[id(param)] = torch.nn.Parameter(clone_nf4(param),
                                                 requires_grad=param.requires_grad)  # fmt: skip
    new = type(module).__new__(type(module))
    memo[id(module)] = new
    new.__setstate__(copy.deepcopy(dict(vars(module)), memo))
    return new


@torch.no_grad()
def copy_nf4_(target: NF4Tensor, value: torch.Tensor) -> NF4Tensor:
    """``target.copy_(value)`` as torchao's NF4 ``copy_`` computes it, quantizing with
    :func:`to_nf4_exact`: a plain ``value`` is quantized in its own dtype on ``target``'s device
    with ``target``'s block sizes, an NF4 ``value`` of other block sizes is dequantized and
    re-quantized, and the quantized parts are copied into ``target``'s (cast to its dtypes).

    Returns:
        NF4Tensor: ``target``.
    """
    if isinstance(value, NF4Tensor):
        if (value.block_size, value.scaler_block_size, value.n_blocks) == (
                target.block_size, target.scaler_block_size, target.n_blocks):  # fmt: skip
            target.copy_(value)  # torchao's base case: the parts themselves
            return target
        value = value.get_original_weight()
    target.copy_(to_nf4_exact(value.to(target.device), target.block_size,
                              target.scaler_block_size))  # fmt: skip
    return target


def quantize_on_load(module: torch.nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """A ``load_state_dict`` pre-hook (``module.register_load_state_dict_pre_hook``): each
    plain tensor ``state_dict`` holds for an NF4 parameter of ``module`` (not its children) is
    replaced, in the copy of the state dict the load works on, by its NF4 as torchao's ``copy_``
    would make it (:func:`to_nf4_exact`, ``value`` in its own dtype on the parameter's device,
    the parameter's block sizes), so the load copies the quantized parts. A parameter on the
    meta device (an ``assign=True`` load) gets the NF4 on ``value``'s device."""
    for name, param in module.named_parameters(recurse=False):
        key = prefix + name
        value = state_dict.get(key)
        if (isinstance(param, NF4Tensor) and type(value) in (torch.Tensor, torch.nn.Parameter)
                and tuple(value.shape) == tuple(param.shape)):  # fmt: skip
            device = value.device if param.is_meta else param.device
            state_dict[key] = to_nf4_exact(value.detach().to(device), param.block_size,
                                           param.scaler_block_size)  # fmt: skip


def nf4_bytes(weight: NF4Tensor) -> int:
    """Bytes an NF4 tensor holds: its packed 4-bit codes, int8 block scalers, per-scaler-block
    factors, the scaler mean and the 16-entry code book (each at its own dtype)."""
    names = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")
    return sum(getattr(weight, n).numel() * getattr(weight, n).element_size() for n in names)
