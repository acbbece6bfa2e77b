"""``FFILinear``: a bias-free linear layer whose weight is stored in the Fixed Fan-In format.

The logical weight ``W`` is ``(out_features, in_features)`` with exactly ``fan_in`` non-zeros in
every row, held as a trainable ``values`` parameter ``(out_features, fan_in)`` and an integer
``indices`` buffer of the same shape (see :mod:`squash.sparsity.ffi`). The forward pass is
``torch.ops.squash.ffi_linear``; its registered autograd gives gradients to the input and to
``values``, never to ``indices``.
"""

import math
from typing import Optional

import torch
from torch import nn

from squash.ops import ffi_linear
from squash.sparsity.ffi import (
    fan_in_for,
    ffi_to_dense,
    index_dtype,
    prune_to_ffi,
    random_ffi_indices,
    validate_ffi,
)


class FFILinear(nn.Module):
    """Sparse bias-free linear: ``y[..., o] = sum_j values[o, j] * x[..., indices[o, j]]``.

    The module computes in the dtype of ``values``: an input of another floating dtype is cast to
    it (a no-op in torchtune's single-dtype training; with fp32 adapters over bf16 activations it
    keeps the op's contract that ``x`` and ``values`` share a dtype), and the output has that dtype.

    Default initialisation (no ``indices`` given): a uniformly random FFI pattern, and values drawn
    as ``nn.Linear`` draws its weight but over the fan-in ``k`` instead of ``in_features``
    (Kaiming-uniform with ``a=sqrt(5)``, i.e. ``U(-1/sqrt(k), 1/sqrt(k))``), so each output has
    the variance of a dense layer with ``k`` inputs.

    ``forward`` is the op call. What a mask update records during a backward (the dense weight
    gradient, or growth candidates) is installed on the module from outside, by
    :mod:`squash.training.masks`: the module itself knows nothing of training.

    Args:
        in_features (int): input width.
        out_features (int): output width.
        fan_in (int): non-zeros per row ``k``, ``1 <= k <= in_features``.
        dtype (Optional[torch.dtype]): dtype of ``values``; default: the default dtype.
        device (Optional[torch.device]): where the tensors live.
        generator (Optional[torch.Generator]): CPU generator for the random pattern and values.
        indices (Optional[torch.Tensor]): a given pattern ``(out_features, fan_in)``; validated.

    Raises:
        ValueError: if ``fan_in`` is out of range or ``indices`` breaks the FFI contract.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        fan_in: int,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device] = None,
        generator: Optional[torch.Generator] = None,
        indices: Optional[torch.Tensor] = None,
    ):
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise ValueError(
                f"FFILinear needs in_features, out_features >= 1, got {in_features}, {out_features}"
            )
        if not 1 <= fan_in <= in_features:
            raise ValueError(f"fan_in must be in [1, in_features={in_features}], got {fan_in}")
        self.in_features = in_features
        self.out_features = out_features
        self.fan_in = fan_in
        self.values = nn.Parameter(torch.empty(out_features, fan_in, dtype=dtype, device=device))
        self.register_buffer(
            "indices",
            torch.empty(out_features, fan_in, dtype=index_dtype(in_features), device=device),
        )
        if indices is None:
            self.reset_parameters(generator=generator)
        else:
            validate_ffi(None, indices, in_features, where="FFILinear construction")
            if tuple(indices.shape) != (out_features, fan_in):
                raise ValueError(
                    f"FFI indices shape {tuple(indices.shape)} does not match "
                    f"(out_features, fan_in) = {(out_features, fan_in)} (FFILinear construction)"
                )
            with torch.no_grad():
                self.indices.copy_(indices)
            self.reset_values(generator=generator)

    @classmethod
    def from_dense(cls, weight: torch.Tensor, sparsity: float) -> "FFILinear":
        """Prune a dense ``(out_features, in_features)`` weight to FFI by magnitude.

        Each row keeps its ``k = fan_in_for(in_features, sparsity)`` largest ``|w|`` (ties go to
        the lower column); the module takes ``weight``'s dtype and device.
        """
        values, indices = prune_to_ffi(weight, sparsity=sparsity)
        module = cls(
            weight.shape[1],
            weight.shape[0],
            fan_in_for(weight.shape[1], sparsity),
            dtype=weight.dtype,
            device=weight.device,
            indices=indices,
        )
        with torch.no_grad():
            module.values.copy_(values)
        return module

    @property
    def sparsity(self) -> float:
        """Fraction of zeros of the logical dense weight."""
        return 1.0 - self.fan_in / self.in_features

    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        """Draw a uniformly random pattern and Kaiming-uniform values over the fan-in.

        On the meta device there is no data to fill, and nothing is drawn.
        """
        if self.indices.is_meta:
            return
        with torch.no_grad(), torch.device("cpu"):  # the generator is a CPU generator
            pattern = random_ffi_indices(
                self.out_features, self.in_features, self.fan_in, generator=generator
            )
        with torch.no_grad():
            self.indices.copy_(pattern)
        self.reset_values(generator=generator)

    def reset_values(self, generator: Optional[torch.Generator] = None) -> None:
        """Kaiming-uniform values over the fan-in ``k``, as ``nn.Linear`` over ``in_features``."""
        if self.values.is_meta:
            return
        kaiming_uniform_(self.values, self.fan_in, generator=generator)

    def to_dense(self) -> torch.Tensor:
        """The logical dense weight ``(out_features, in_features)`` in ``values``' dtype."""
        return ffi_to_dense(self.values, self.indices, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """
        Args:
            x (torch.Tensor): ``(..., in_features)``.

        Returns:
            torch.Tensor: ``(..., out_features)`` in ``values``' dtype.

        Raises:
            ValueError: if ``x`` is not ``in_features`` wide.
        """
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"FFILinear: input {tuple(x.shape)} must end in in_features = {self.in_features}"
            )
        x = x.to(self.values.dtype)
        return ffi_linear(x, self.values, self.indices, in_features=self.in_features)

    # ---- checkpoints ---------------------------------------------------------------------------
    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        key = prefix + "indices"
        if key in state_dict:
            where = f"checkpoint load of {key}"
            values = state_dict.get(prefix + "values")
            validate_ffi(values, state_dict[key], self.in_features, where=where)
            shape = tuple(state_dict[key].shape)
            if shape != (self.out_features, self.fan_in):
                raise ValueError(
                    f"FFI indices shape {shape} does not match this module's "
                    f"(out_features, fan_in) = {(self.out_features, self.fan_in)}; was the "
                    f"checkpoint made with another sparsity? ({where})"
                )
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"fan_in={self.fan_in}, sparsity={self.sparsity:.3f}"
        )


def kaiming_uniform_(
    tensor: torch.Tensor, fan_in: int, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """Fill ``tensor`` in place from ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``.

    This is ``nn.init.kaiming_uniform_(tensor, a=sqrt(5))`` (``nn.Linear``'s and LoRA-A's init)
    with an explicit ``fan_in``. The draw is made in float32 on the CPU (``generator`` is a CPU
    generator), so it is reproducible across devices and dtypes, then copied into ``tensor``.
    """
    bound = 1.0 / math.sqrt(fan_in)
    with torch.no_grad(), torch.device("cpu"):
        draw = torch.empty(tensor.shape, dtype=torch.float32)
        draw.uniform_(-bound, bound, generator=generator)
        tensor.copy_(draw)
    return tensor
