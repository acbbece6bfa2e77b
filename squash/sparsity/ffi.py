"""The Fixed Fan-In (FFI) sparse format.

A logical dense matrix ``W`` of shape ``(out_features, in_features)`` is stored with exactly ``k``
non-zeros in every row (``k`` is the fan-in):

- ``values``: ``(out_features, k)`` floating point.
- ``indices``: ``(out_features, k)`` integer column ids, each row strictly increasing, all in
  ``[0, in_features)``; ``torch.int16`` when ``in_features <= 32767``, else ``torch.int32``.
"""

from typing import Optional

import torch

INT16_MAX_IN_FEATURES = 32767


def fan_in_for(in_features: int, sparsity: float) -> int:
    """Fan-in ``k = max(1, round((1 - sparsity) * in_features))``.

    Args:
        in_features (int): width of the dense rows.
        sparsity (float): fraction of zeros in ``[0, 1)``.

    Returns:
        int: non-zeros kept in every row.

    Raises:
        ValueError: if ``in_features < 1`` or ``sparsity`` is outside ``[0, 1)``.
    """
    if in_features < 1:
        raise ValueError(f"in_features must be >= 1, got {in_features}")
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    return max(1, min(in_features, round((1.0 - sparsity) * in_features)))


def index_dtype(in_features: int) -> torch.dtype:
    """The index dtype for rows of width ``in_features``: int16 when it fits, else int32."""
    return torch.int16 if in_features <= INT16_MAX_IN_FEATURES else torch.int32


def prune_to_ffi(
    weight: torch.Tensor, *, sparsity: Optional[float] = None, fan_in: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prune a dense matrix to FFI by magnitude: the ``k`` largest ``|w|`` of each row survive.

    Exactly one of ``sparsity`` and ``fan_in`` is given. Ties are broken towards lower columns.

    Args:
        weight (torch.Tensor): dense ``(out_features, in_features)``.
        sparsity (Optional[float]): fraction of zeros, see :func:`fan_in_for`.
        fan_in (Optional[int]): non-zeros per row, ``1 <= fan_in <= in_features``.

    Returns:
        tuple[torch.Tensor, torch.Tensor]: ``values`` ``(out, k)`` in ``weight.dtype`` and sorted
        ``indices`` ``(out, k)`` in :func:`index_dtype`.

    Raises:
        ValueError: if ``weight`` is not 2-D or the fan-in arguments are wrong.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (out_features, in_features), got {tuple(weight.shape)}")
    k = _resolve_fan_in(weight.shape[1], sparsity, fan_in)
    # Stable descending sort of |w| keeps the lowest column among equal magnitudes.
    order = torch.sort(weight.detach().abs().float(), dim=1, descending=True, stable=True).indices
    idx = torch.sort(order[:, :k], dim=1).values
    values = torch.gather(weight.detach(), 1, idx)
    return values, idx.to(index_dtype(weight.shape[1]))


def random_ffi_indices(
    out_features: int,
    in_features: int,
    fan_in: int,
    *,
    generator: Optional[torch.Generator] = None,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """A uniformly random FFI pattern: ``fan_in`` distinct sorted columns per row.

    Args:
        out_features (int): rows.
        in_features (int): columns.
        fan_in (int): non-zeros per row, ``1 <= fan_in <= in_features``.
        generator (Optional[torch.Generator]): CPU generator for reproducible patterns.
        device (Optional[torch.device]): where the result lives.

    Returns:
        torch.Tensor: ``(out_features, fan_in)`` indices in :func:`index_dtype`.
    """
    k = _resolve_fan_in(in_features, None, fan_in)
    keys = torch.rand(out_features, in_features, generator=generator)
    idx = torch.sort(torch.topk(keys, k, dim=1).indices, dim=1).values
    return idx.to(device=device, dtype=index_dtype(in_features))


def ffi_to_dense(values: torch.Tensor, indices: torch.Tensor, in_features: int) -> torch.Tensor:
    """Scatter FFI ``values`` to the dense ``(out_features, in_features)`` matrix."""
    dense = values.new_zeros(values.shape[0], in_features)
    return dense.scatter(1, indices.long(), values)


def validate_ffi(
    values: Optional[torch.Tensor], indices: torch.Tensor, in_features: int, where: str = ""
) -> None:
    """Check the FFI contract; raise ``ValueError`` naming the rule that broke.

    Args:
        values (Optional[torch.Tensor]): ``(out_features, k)`` floating point, or None to check
            only the indices.
        indices (torch.Tensor): ``(out_features, k)`` int16/int32.
        in_features (int): width of the logical dense matrix.
        where (str): context for the message, e.g. ``"checkpoint load of layers.0.lora_a"``.

    Raises:
        ValueError: shape, dtype, range or sorted/unique rule broken.
    """
    at = f" ({where})" if where else ""
    if not isinstance(indices, torch.Tensor) or indices.dim() != 2:
        shape = tuple(indices.shape) if isinstance(indices, torch.Tensor) else type(indices)
        raise ValueError(f"FFI indices must be a 2-D tensor (out_features, k), got {shape}{at}")
    out_features, k = indices.shape
    if indices.dtype not in (torch.int16, torch.int32):
        raise ValueError(f"FFI indices must be int16 or int32, got {indices.dtype}{at}")
    if indices.dtype == torch.int16 and in_features > INT16_MAX_IN_FEATURES:
        raise ValueError(f"int16 FFI indices cannot address in_features={in_features}{at}")
    if not 1 <= k <= in_features:
        raise ValueError(f"FFI fan-in must be in [1, in_features={in_features}], got {k}{at}")
    if values is not None:
        if tuple(values.shape) != (out_features, k):
            raise ValueError(
                f"FFI values shape {tuple(values.shape)} does not match indices shape "
                f"{(out_features, k)}{at}"
            )
        if not values.is_floating_point():
            raise ValueError(f"FFI values must be floating point, got {values.dtype}{at}")
    if indices.numel() == 0:
        return
    idx = indices.detach()
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= in_features:
        bad = ((idx < 0) | (idx >= in_features)).nonzero()[0].tolist()
        raise ValueError(
            f"FFI index out of range [0, {in_features}): indices[{bad[0]}, {bad[1]}] = "
            f"{int(idx[bad[0], bad[1]])}{at}"
        )
    if k > 1:
        steps = idx[:, 1:].int() - idx[:, :-1].int()
        if bool((steps <= 0).any()):
            row, col = (steps <= 0).nonzero()[0].tolist()
            rule = "duplicated" if int(steps[row, col]) == 0 else "not sorted"
            raise ValueError(
                f"FFI indices must be strictly increasing in each row: row {row} is {rule} at "
                f"positions {col}, {col + 1}{at}"
            )


def _resolve_fan_in(in_features: int, sparsity: Optional[float], fan_in: Optional[int]) -> int:
    if (sparsity is None) == (fan_in is None):
        raise ValueError("give exactly one of sparsity and fan_in")
    if fan_in is None:
        return fan_in_for(in_features, sparsity)
    if not 1 <= fan_in <= in_features:
        raise ValueError(f"fan_in must be in [1, in_features={in_features}], got {fan_in}")
    return int(fan_in)
