"""Memory accounting for adapter training: what the trainable part of a model costs.

Counted per adapter: the trainable parameters, their gradients (same dtype), the AdamW state and
the FFI index buffers. PyTorch's ``AdamW`` keeps ``exp_avg`` and ``exp_avg_sq`` in the parameter's
dtype (bf16 params, bf16 moments; ``moment_dtype`` overrides it for optimizers that keep fp32
moments), plus ``max_exp_avg_sq`` with ``amsgrad``, plus a float32 scalar ``step`` per parameter
tensor. The frozen base (NF4 or dense) is counted apart, by :func:`base_memory` (an NF4 weight at
its real size: packed 4-bit codes, int8 block scalers, per-scaler-block factors, whatever block
sizes it was quantized with; a corrected base's outliers ``S``, :func:`outlier_memory`);
activations and the allocator's slack are not counted.

``mask_update_bytes`` is the extra, transient memory of a mask-update step: the dense-gradient
probe of every FFI factor and its gradient, ``2 * out * in`` elements in the parameter dtype
(the dense product's temporaries come on top while it runs). It is not part of ``total_bytes``.

Two entry points: :func:`adapter_memory` measures a built model; :func:`lora_adapter_memory`
computes the same numbers from layer shapes, so large models need not be built.
:func:`max_rank_within` answers "which rank fits in this many bytes".
"""

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import nn
from torchtune.modules.peft import get_adapter_params

from squash._checks import SPARSE_FACTORS, check_choice, check_int, check_sparsity
from squash.modules import FFILinear, get_adapter_buffers, get_adapter_modules
from squash.nf4 import NF4Tensor, nf4_bytes
from squash.nf4.base_outliers import module_outliers, outlier_modules
from squash.nf4.outliers import outlier_fan_in
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

    Raises:
        ValueError: if ``moment_dtype`` is not a floating dtype or ``amsgrad`` not a bool.
    """
    _check_optimizer_args(moment_dtype, amsgrad)
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
    return [(m.in_dim, m.out_dim) for m in get_adapter_modules(model).values()]


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

    Raises:
        ValueError: naming a bad argument (empty or non-positive ``shapes``, ``rank < 1``,
            ``sparsity`` outside ``[0, 1)``, an unknown ``sparse_factor`` such as ``"A"``, a
            non-floating ``dtype``).
    """
    shapes = _check_shapes(shapes)
    rank = check_int("rank", rank)
    _check_sparse_args(sparsity, sparse_factor, dtype)
    _check_optimizer_args(moment_dtype, amsgrad)
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

    The cost grows strictly with the rank, so the search doubles an upper bound until it no longer
    fits and then bisects: the answer is the true largest rank, which for sparse factors may
    exceed every ``min(in_dim, out_dim)`` (an FFI factor's rows need not be independent).

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
        max_rank (Optional[int]): an explicit cap on the answer; default None: no cap.

    Returns:
        int: the rank (at most ``max_rank`` when given), 0 when even rank 1 does not fit.

    Raises:
        ValueError: naming a bad argument (as :func:`lora_adapter_memory`, and a negative
            ``budget_bytes`` or ``max_rank < 1``).
    """
    budget_bytes = check_int("budget_bytes", budget_bytes, minimum=0)
    shapes = _check_shapes(shapes)
    _check_sparse_args(sparsity, sparse_factor, dtype)
    _check_optimizer_args(moment_dtype, False)
    if max_rank is not None:
        max_rank = check_int("max_rank", max_rank)

    def cost(rank: int) -> int:
        return lora_adapter_memory(
            shapes, rank, sparsity=sparsity, sparse_factor=sparse_factor, dtype=dtype,
            moment_dtype=moment_dtype,
        ).total_bytes  # fmt: skip

    # Each rank adds at least one element per shape, so cost(rank) > rank and doubling ends.
    hi = 1
    while cost(hi) <= budget_bytes and (max_rank is None or hi < max_rank):
        hi *= 2
    if max_rank is not None:
        hi = min(hi, max_rank)
    lo = 0  # cost is increasing in rank: binary search the last fitting rank in [0, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(mid) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _check_shapes(shapes: Sequence[Tuple[int, int]]) -> list:
    try:
        shapes = [tuple(s) for s in shapes]
    except TypeError:
        raise ValueError(f"shapes must be a sequence of (in_dim, out_dim) pairs, got {shapes!r}")
    if not shapes:
        raise ValueError("shapes must name at least one (in_dim, out_dim) pair, got none")
    for i, shape in enumerate(shapes):
        if len(shape) != 2:
            raise ValueError(f"shapes[{i}] must be an (in_dim, out_dim) pair, got {shape!r}")
        check_int(f"shapes[{i}][0] (in_dim)", shape[0])
        check_int(f"shapes[{i}][1] (out_dim)", shape[1])
    return shapes


def _check_sparse_args(sparsity: Optional[float], sparse_factor: str, dtype: torch.dtype) -> None:
    check_sparsity("sparsity", sparsity, allow_none=True)
    check_choice("sparse_factor", sparse_factor, SPARSE_FACTORS)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")


def _check_optimizer_args(moment_dtype: Optional[torch.dtype], amsgrad: bool) -> None:
    if moment_dtype is not None and (
        not isinstance(moment_dtype, torch.dtype) or not moment_dtype.is_floating_point
    ):
        raise ValueError(
            f"moment_dtype must be a floating torch.dtype or None, got {moment_dtype!r}"
        )
    if not isinstance(amsgrad, bool):
        raise ValueError(f"amsgrad must be a bool, got {amsgrad!r}")


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def base_memory(model: nn.Module) -> int:
    """Bytes of a model's frozen part: every parameter and buffer that is not an adapter's.

    An NF4 weight counts the bytes it holds (:func:`squash.nf4.nf4_bytes`: for a
    ``(576, 576)`` float32 weight with block sizes (64, 216), 165888 bytes of codes + 5184 int8
    scalers + 24 float32 factors + the mean + the 16-entry code book), a dense tensor
    ``numel * element_size``; a tensor that two modules share (tied embeddings) counts once.
    A corrected base (``model.base_outliers``) counts its outlier matrix ``S`` too, values and
    indices (:func:`outlier_memory`), also before ``S`` is built (a model not yet loaded).

    Args:
        model (nn.Module): the model.

    Returns:
        int: the bytes.
    """
    adapter = {id(t) for t in get_adapter_params(model).values()}
    adapter |= {id(t) for t in get_adapter_buffers(model).values()}
    seen, total = set(), 0
    named = [*model.named_parameters(remove_duplicate=False)]
    named += [*model.named_buffers(remove_duplicate=False)]
    for _, t in named:
        if id(t) in adapter or id(t) in seen:
            continue
        seen.add(id(t))
        total += nf4_bytes(t) if isinstance(t, NF4Tensor) else t.numel() * t.element_size()
    # an S not built yet (it is filled on load) has no buffers to count: its bytes from shapes
    built = {n for n, m in outlier_modules(model).items() if module_outliers(m) is not None}
    return total + sum(b for n, b in outlier_memory(model).items() if n not in built)


def outlier_memory(model: nn.Module) -> Dict[str, int]:
    """``{module name: bytes}`` of the outlier matrix ``S`` of each corrected base of ``model``
    (``model.base_outliers``): its values and indices as the module holds them once loaded, or,
    before that, as it will (``(out, k)`` bfloat16 values and int16/int32 indices,
    ``k = round(fraction * in_features)``, :func:`squash.nf4.outliers.outlier_fan_in`).
    Empty for a plain NF4 model.
    """
    sizes = {}
    for name, module in outlier_modules(model).items():
        out = module_outliers(module)
        if out is not None:
            sizes[name] = sum(t.numel() * t.element_size() for t in out)
            continue
        rows, width = module.weight.shape
        k = outlier_fan_in(width, module.base_outliers["fraction"])
        per = _element_size(torch.bfloat16) + _element_size(index_dtype(width))
        sizes[name] = rows * k * per
    return sizes
