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

from typing import Any, Callable, NamedTuple, Optional, Tuple

import torch

from squash.nf4.quantize import NF4Tensor, quantize_nf4
from squash.nf4.outliers import quantize_blocks
from squash.nf4.ops import nf4_dequantize

__all__ = ["LoftQ", "loftq", "loftq_factors"]


def _low_rank(res: torch.Tensor, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """PEFT's ``_low_rank_decomposition``: ``(B, A)`` with ``B A`` the best rank-``rank``
    approximation of ``res``, the singular values split evenly (``sqrt`` on each side)."""
    u, s, vh = torch.linalg.svd(res, full_matrices=False)
    root = torch.sqrt(torch.diag(s))
    return u @ root[:, :rank], root[:rank, :] @ vh


class LoftQ(NamedTuple):
    """What :func:`loftq` returns."""

    base: Optional[NF4Tensor]
    """NF4 of :attr:`quantized` (None with a ``quantize`` callable)."""
    factors: Any
    """What ``low_rank`` returned at the last iteration."""
    quantized: torch.Tensor
    """The float32 tensor the last iteration quantized (``W`` itself after one iteration, then
    ``W - s B A`` of the one before): load it into an NF4 base of the same block sizes and the
    module holds :attr:`base`."""


@torch.no_grad()
def loftq(
    weight: torch.Tensor,
    iterations: int,
    low_rank: Callable[[torch.Tensor], Tuple[Any, torch.Tensor]],
    *,
    dtype: Optional[torch.dtype] = None,
    block_size: Optional[int] = None,
    scaler_block_size: Optional[int] = None,
    quantize: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    name: str = "weight",
) -> LoftQ:
    """LoftQ's alternation with any low-rank step: ``low_rank(W - dequant)`` returns the factors
    (in whatever form the caller keeps them) and their product ``s B A`` as a float32 tensor;
    the next iteration quantizes ``W - s B A``. :func:`loftq_factors` is PEFT's dense step;
    squash's sparse adapters step with their SVD initialisation
    (:func:`squash.assembly.adapter_init.loftq_initial_state`).

    Args:
        weight (torch.Tensor): ``(out, in)`` floating; computed in float32.
        iterations (int): alternations, >= 1.
        low_rank (Callable): ``error -> (factors, product)``.
        dtype (Optional[torch.dtype]): round what is quantized to this dtype first, as a model
            of that dtype rounds a weight it loads (default: float32, no rounding).
        block_size (Optional[int]): NF4 block size (default: squash's for the shape).
        scaler_block_size (Optional[int]): with ``block_size``, the scaler block size (a
            module's NF4 records both); without it, the largest at most 256 that fits.
        quantize (Optional[Callable]): ``res -> dequantized res`` instead of torchao NF4.
        name (str): the weight's name, for errors.

    Raises:
        ValueError: naming ``weight`` or ``iterations``.
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a 2-D floating tensor (out, in), got {weight!r:.60}")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be an int >= 1, got {iterations!r}")
    w = weight.detach().float()
    res = w.clone()
    base, factors = None, None
    for _ in range(iterations):
        if dtype is not None:
            res = res.to(dtype).float()
        quantized = res
        if quantize is None:
            held = res if dtype is None else res.to(dtype)
            if scaler_block_size is None:
                base = quantize_blocks(held, name, block_size)
            else:
                base = quantize_nf4(held, name, block_size, scaler_block_size)
            deq = nf4_dequantize(base).float()
        else:
            deq = quantize(res)
        factors, product = low_rank(w - deq)
        res = w - product
    return LoftQ(base, factors, quantized)


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
    """LoftQ: alternate NF4 quantization of ``W - B A`` and the SVD of ``W - dequant``
    (:func:`loftq` with PEFT's dense low-rank step).

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
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale!r}")

    def step(error):
        b, a = _low_rank(error, rank)
        return (b, a), torch.mm(b, a)

    result = loftq(weight, iterations, step, block_size=block_size, quantize=quantize, name=name)
    b, a = result.factors
    root = scale**0.5
    return result.base, a / root, b / root
