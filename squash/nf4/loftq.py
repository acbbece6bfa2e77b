"""LoftQ initialization (Li et al., 2023) on torchao's NF4: the adapter factors spent on the
quantization residual, alternating with re-quantization.

The published algorithm, as PEFT's ``peft.utils.loftq_utils.loftq_init`` runs it::

    res = W
    repeat iterations times:
        Q   = dequant(NF4(res))
        U, S, Vh = svd(W - Q)              # full_matrices=False
        B   = U[:, :r] diag(sqrt(S[:r]))   # PEFT's L, (out, r)
        A   = diag(sqrt(S[:r])) Vh[:r]     # PEFT's R, (r, in)
        res = W - B A
    return NF4(res of the last quantization), A, B

so ``W ~= Q + B A`` with the last ``Q``. PEFT stores ``A`` and ``B`` as they are, ignoring the
LoRA scale ``alpha / r``; :func:`loftq_factors` divides both by ``sqrt(scale)`` so that
``Q + scale * B A`` is the same matrix (``scale = 1`` is PEFT's choice).

``quantize`` replaces NF4 (a function ``res -> dequantized res``): the tests pass PEFT's
``NFQuantizer`` through it to compare with PEFT's own loop, whose quantizer differs from
torchao's NF4 (one float32 absmax per block of 64 without double quantization, and its own
normal-float table).
"""

from typing import Callable, Optional, Tuple

import torch

from squash.nf4.quantize import NF4Tensor
from squash.nf4.outliers import quantize_blocks
from squash.nf4.ops import nf4_dequantize

__all__ = ["loftq_factors"]


def _low_rank(res: torch.Tensor, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """PEFT's ``_low_rank_decomposition``: ``(B, A)`` with ``B A`` the best rank-``rank``
    approximation of ``res``, the singular values split evenly (``sqrt`` on each side)."""
    u, s, vh = torch.linalg.svd(res, full_matrices=False)
    root = torch.sqrt(torch.diag(s))
    return u @ root[:, :rank], root[:rank, :] @ vh


@torch.no_grad()
def loftq_factors(
    weight: torch.Tensor,
    rank: int,
    iterations: int = 1,
    *,
    scale: float = 1.0,
    block_size: Optional[int] = None,
    quantize: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    name: str = "weight",
) -> Tuple[Optional[NF4Tensor], torch.Tensor, torch.Tensor]:
    """LoftQ: alternate NF4 quantization of ``W - B A`` and the SVD of ``W - dequant``.

    Computed in float32 (as PEFT), the factors returned in float32.

    Args:
        weight (torch.Tensor): ``(out, in)`` floating.
        rank (int): adapter rank ``r``, ``1 <= r <= min(out, in)``.
        iterations (int): alternations, >= 1 (PEFT's ``loftq_iter``, default 1).
        scale (float): the adapter's scale ``alpha / r``; ``Q + scale * B A ~= W``.
        block_size (Optional[int]): NF4 block size (default: squash's for the shape).
        quantize (Optional[Callable]): ``res -> dequantized res`` instead of torchao NF4; the
            base returned is then None.
        name (str): the weight's name, for errors.

    Returns:
        Tuple[Optional[NF4Tensor], torch.Tensor, torch.Tensor]: the NF4 base (of the last
        ``res``), ``A`` ``(r, in)`` and ``B`` ``(out, r)``.

    Raises:
        ValueError: naming ``weight``, ``rank``, ``iterations`` or ``scale``.
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a 2-D floating tensor (out, in), got {weight!r:.60}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= min(weight.shape):
        raise ValueError(f"rank must be an int in [1, {min(weight.shape)}], got {rank!r}")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be an int >= 1, got {iterations!r}")
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale!r}")
    w = weight.detach().float()
    res = w.clone()
    base = None
    for _ in range(iterations):
        if quantize is None:
            base = quantize_blocks(res, name, block_size)
            deq = nf4_dequantize(base)
        else:
            deq = quantize(res)
        b, a = _low_rank(w - deq, rank)
        res = w - torch.mm(b, a)
    root = scale**0.5
    return base, a / root, b / root
