"""squash's extensions to torchao's NF4 tensor, installed by an explicit call, never on import.

:func:`install_torchao_extensions` (idempotent; the builders and quantize functions that need it
call it) does two things to torchao's ``NF4Tensor``:

- ``clone``: torchtune's ``_register_nf4_dispatch_ops`` makes ``clone`` re-quantize the
  dequantized weight with torchao's default block sizes, which fails on, or silently changes, a
  weight quantized with other sizes (:func:`squash.nf4.nf4_block_sizes`). squash's ``clone``
  copies the quantized parts themselves, block sizes included: the copy dequantizes to exactly
  the original's values. It is registered after torchtune's (imported first), so it wins.
- ``quantize_tensor_nearest``: :func:`quantize_tensor_nearest`, the same indices as torchao's
  without its ``(numel, 16)`` distance table.

Importing squash changes neither (tests/test_import.py).
"""

import torch

from squash.nf4._torchao import NF4Tensor, implements

_TORCHAO_NEAREST = NF4Tensor.quantize_tensor_nearest
_installed = False


def clone(func, *args, **kwargs):
    """An NF4 tensor's clone with its own block sizes and quantized values."""
    original = args[0][0]
    names, ctx = original.__tensor_flatten__()
    inner = {n: getattr(original, n).clone() for n in names}
    return NF4Tensor.__tensor_unflatten__(inner, ctx, original.shape, original.stride())


def quantize_tensor_nearest(value: torch.Tensor, nf4: torch.Tensor) -> torch.Tensor:
    """torchao's ``NF4Tensor.quantize_tensor_nearest`` (the index of the nearest of the 16 NF4
    levels, the first on a tie), without its ``(numel, 16)`` distance table.

    The levels are sorted and ``|x - level|`` rounds monotonically in the level, so the nearest
    level is one of the two that bracket ``x``: ``bucketize`` on the midpoints finds one, and the
    same float32 distances torchao compares decide between it and its neighbours (the lower
    index on a tie, as torchao's ``min``). NaN or inf (an all-zero block scaled 0/0, an inf weight) gets
    torchao's own answer. Called by ``to_nf4`` and by NF4's ``copy_``, which re-quantizes a loaded weight; the
    result equals torchao's exactly (tests/modules/test_nf4_quantize.py).

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
        best[odd] = _TORCHAO_NEAREST(value[odd], nf4)
    return best


def install_torchao_extensions() -> None:
    """Install squash's NF4 ``clone`` and ``quantize_tensor_nearest`` into torchao's
    ``NF4Tensor`` (once; later calls do nothing).

    Called by everything that builds or quantizes an NF4 base (:func:`squash.nf4.quantize_nf4`,
    :func:`squash.nf4.quantize_base_`, :func:`squash.nf4.use_squash_nf4_`, the model builders),
    so a user of those needs no call of their own.
    """
    global _installed
    if _installed:
        return
    # torchtune registers its own clone on import of this module: import it first so that
    # squash's registration is the last.
    from torchtune.modules.low_precision import _register_nf4_dispatch_ops  # noqa: F401

    implements([torch.ops.aten.clone.default])(clone)
    NF4Tensor.quantize_tensor_nearest = staticmethod(quantize_tensor_nearest)
    _installed = True
