"""Memory accounting for adapter training: what the trainable part of a model costs.

Counted per adapter: the trainable parameters, their gradients (same dtype), the AdamW state and
the FFI index buffers. PyTorch's ``AdamW`` keeps ``exp_avg`` and ``exp_avg_sq`` in the parameter's
dtype (bf16 params, bf16 moments; ``moment_dtype`` overrides it for optimizers that keep fp32
moments), plus ``max_exp_avg_sq`` with ``amsgrad``, plus a float32 scalar ``step`` per parameter
tensor. The frozen base (NF4 or dense), activations and the allocator's slack are not counted.

``mask_update_bytes`` is the extra, transient memory of a mask-update step: the dense-gradient
probe of every FFI factor and its gradient, ``2 * out * in`` elements in the parameter dtype
(the dense product's temporaries come on top while it runs). It is not part of ``total_bytes``.

Two entry points: :func:`adapter_memory` measures a built model; :func:`lora_adapter_memory`
computes the same numbers from layer shapes, so large models need not be built.
:func:`max_rank_within` answers "which rank fits in this many bytes".
"""

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
from torch import nn
from torchtune.modules.peft import get_adapter_params

from squash.modules import FFILinear, get_adapter_buffers
from squash.sparsity.ffi import fan_in_for, index_dtype

STEP_BYTES = 4  # AdamW's float32 scalar ``step`` per parameter tensor


@dataclass(frozen=True)
class AdapterMemory:
    """Bytes of the trainable adapter state.

    Attributes:
        trainable_params (int): number of trainable adapter elements.
        param_bytes (int): the adapter parameters.
        grad_bytes (int): their gradients.
        optimizer_bytes (int): AdamW moments and ``step`` scalars.
        index_bytes (int): FFI index buffers (no gradient, no optimizer state).
        mask_update_bytes (int): transient extra of a mask-update step (not in the total).
    """

    trainable_params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    index_bytes: int
    mask_update_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """Parameters + gradients + optimizer state + indices."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.index_bytes


def _moments(amsgrad: bool) -> int:
    return 3 if amsgrad else 2


def adapter_memory(
    model: nn.Module, *, moment_dtype: Optional[torch.dtype] = None, amsgrad: bool = False
) -> AdapterMemory:
    """Measure the adapter training state of a built model.

    Adapter parameters are those torchtune's ``get_adapter_params`` selects (``LoRALinear`` and
    ``SparseLoRALinear`` alike); indices are the FFI buffers of ``get_adapter_buffers``.

    Args:
        model (nn.Module): a model with adapters.
        moment_dtype (Optional[torch.dtype]): dtype of the AdamW moments; default: each
            parameter's dtype (PyTorch's AdamW).
        amsgrad (bool): count AdamW's third moment ``max_exp_avg_sq``. Default: False

    Returns:
        AdapterMemory: the byte counts.
    """
    params = get_adapter_params(model)
    numel = sum(p.numel() for p in params.values())
    param_bytes = sum(p.numel() * p.element_size() for p in params.values())
    moment_bytes = sum(p.numel() * _element_size(moment_dtype or p.dtype) for p in params.values())
    probe = sum(
        2 * m.out_features * m.in_features * m.values.element_size()
        for m in model.modules()
        if isinstance(m, FFILinear)
    )
    return AdapterMemory(
        trainable_params=numel,
        param_bytes=param_bytes,
        grad_bytes=param_bytes,
        optimizer_bytes=_moments(amsgrad) * moment_bytes + STEP_BYTES * len(params),
        index_bytes=sum(b.numel() * b.element_size() for b in get_adapter_buffers(model).values()),
        mask_update_bytes=probe,
    )


def adapted_shapes(model: nn.Module) -> list:
    """``(in_dim, out_dim)`` of every LoRA-adapted linear (torchtune's or squash's) in ``model``."""
    return [
        (m.in_dim, m.out_dim)
        for m in model.modules()
        if callable(getattr(m, "adapter_params", None)) and hasattr(m, "lora_a")
    ]


def lora_adapter_memory(
    shapes: Sequence[Tuple[int, int]],
    rank: int,
    *,
    sparsity: Optional[float] = None,
    sparse_factor: str = "a",
    dtype: torch.dtype = torch.bfloat16,
    moment_dtype: Optional[torch.dtype] = None,
    amsgrad: bool = False,
) -> AdapterMemory:
    """The adapter training state of LoRA (``sparsity=None``) or squash adapters, from shapes.

    Args:
        shapes (Sequence[Tuple[int, int]]): ``(in_dim, out_dim)`` of each adapted linear.
        rank (int): adapter rank.
        sparsity (Optional[float]): fraction of zeros of the sparse factor(s); None for LoRA.
        sparse_factor (str): ``"a"``, ``"b"`` or ``"both"``. Default: ``"a"``
        dtype (torch.dtype): adapter parameter dtype. Default: bfloat16
        moment_dtype (Optional[torch.dtype]): AdamW moment dtype; default: ``dtype``.
        amsgrad (bool): count AdamW's third moment. Default: False

    Returns:
        AdapterMemory: the byte counts (what :func:`adapter_memory` reports for such a model).
    """
    sparse_a = sparsity is not None and sparse_factor in ("a", "both")
    sparse_b = sparsity is not None and sparse_factor in ("b", "both")
    elems = idx_bytes = probe = tensors = 0
    for in_dim, out_dim in shapes:
        # (rows, width, sparse) of A: in_dim -> rank and B: rank -> out_dim
        for rows, width, sparse in ((rank, in_dim, sparse_a), (out_dim, rank, sparse_b)):
            tensors += 1
            if sparse:
                n = rows * fan_in_for(width, sparsity)
                idx_bytes += n * _element_size(index_dtype(width))
                probe += 2 * rows * width * _element_size(dtype)
            else:
                n = rows * width
            elems += n
    p = _element_size(dtype)
    m = _element_size(moment_dtype or dtype)
    return AdapterMemory(
        trainable_params=elems,
        param_bytes=elems * p,
        grad_bytes=elems * p,
        optimizer_bytes=_moments(amsgrad) * elems * m + STEP_BYTES * tensors,
        index_bytes=idx_bytes,
        mask_update_bytes=probe,
    )


def max_rank_within(
    budget_bytes: int,
    shapes: Sequence[Tuple[int, int]],
    *,
    sparsity: Optional[float] = None,
    sparse_factor: str = "a",
    dtype: torch.dtype = torch.bfloat16,
    moment_dtype: Optional[torch.dtype] = None,
    max_rank: Optional[int] = None,
) -> int:
    """The largest rank whose adapter state (``total_bytes``) fits in ``budget_bytes``.

    E.g. ``max_rank_within(lora_adapter_memory(shapes, 8).total_bytes, shapes, sparsity=0.9)``
    is the squash rank that costs what LoRA rank 8 costs; with ``sparsity=None`` it answers the
    reverse question (which dense rank a squash budget buys).

    Args:
        budget_bytes (int): the byte budget.
        shapes (Sequence[Tuple[int, int]]): ``(in_dim, out_dim)`` of each adapted linear.
        sparsity (Optional[float]): as in :func:`lora_adapter_memory`.
        sparse_factor (str): as in :func:`lora_adapter_memory`.
        dtype (torch.dtype): adapter parameter dtype. Default: bfloat16
        moment_dtype (Optional[torch.dtype]): AdamW moment dtype; default: ``dtype``.
        max_rank (Optional[int]): search limit; default: the largest ``min(in_dim, out_dim)``.

    Returns:
        int: the rank, 0 when even rank 1 does not fit.
    """
    limit = max_rank or max(min(i, o) for i, o in shapes)

    def cost(rank: int) -> int:
        return lora_adapter_memory(
            shapes, rank, sparsity=sparsity, sparse_factor=sparse_factor, dtype=dtype,
            moment_dtype=moment_dtype,
        ).total_bytes  # fmt: skip

    lo, hi = 0, limit  # cost is non-decreasing in rank: binary search the last fitting rank
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(mid) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
