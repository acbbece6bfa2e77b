"""``SparseLoRALinear``: torchtune's ``LoRALinear`` with one or both factors in FFI format.

``y = base(x) + (alpha / rank) * lora_b(lora_a(dropout(x)))`` where ``base`` is a frozen dense or
NF4 (QLoRA) linear layer and ``lora_a`` (``in_dim -> rank``) / ``lora_b`` (``rank -> out_dim``) are
each an :class:`~squash.modules.FFILinear` or a bias-free ``nn.Linear``, as built by
:func:`lora_factor`.
"""

import math
from typing import Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from squash._checks import (
    INITS,
    SPARSE_FACTORS,
    check_choice,
    check_int,
    check_real,
    check_sparsity,
)
from squash.modules.adapter import SparseAdapterModule, merge_lora
from squash.modules.ffi_linear import FFILinear, kaiming_uniform_
from squash.nf4 import NF4Tensor, check_nf4_shape, nf4_block_sizes, quantize_nf4
from squash.nf4.base_outliers import init_base_outliers_, module_outliers
from squash.nf4.outliers import corrected_base, outlier_linear
from squash.nf4.quantize import copy_nf4_, deepcopy_module, quantize_on_load
from squash.sparsity.ffi import fan_in_for, prune_to_ffi

def lora_factor(
    in_features: int,
    out_features: int,
    sparsity: Optional[float],
    *,
    dtype: Optional[torch.dtype] = None,
    device: Optional[torch.device] = None,
    generator: Optional[torch.Generator] = None,
) -> nn.Module:
    """One LoRA factor: an :class:`FFILinear` at ``sparsity``, or a dense bias-free ``nn.Linear``.

    Args:
        in_features (int): input width.
        out_features (int): output width.
        sparsity (Optional[float]): fraction of zeros in ``[0, 1)``; None for a dense factor.
        dtype (Optional[torch.dtype]): parameter dtype.
        device (Optional[torch.device]): parameter device.
        generator (Optional[torch.Generator]): CPU generator for the FFI pattern and values.

    Returns:
        nn.Module: ``FFILinear(in_features, out_features, k)`` or ``nn.Linear(..., bias=False)``.
    """
    if sparsity is None:
        return nn.Linear(in_features, out_features, bias=False, dtype=dtype, device=device)
    k = fan_in_for(in_features, sparsity)
    return FFILinear(in_features, out_features, k, dtype=dtype, device=device, generator=generator)


class SparseLoRALinear(nn.Module, SparseAdapterModule):
    """LoRA linear layer whose adapter factors may be Fixed Fan-In sparse.

    Behaves like :class:`torchtune.modules.peft.LoRALinear` (same base state-dict keys ``weight``
    and ``bias``, ``disabled`` flag, dropout before ``lora_a``, ``scaling = alpha / rank``, an NF4
    base computed by squash's NF4 kernel); one or both of ``lora_a`` (``in_dim -> rank``) and
    ``lora_b`` (``rank -> out_dim``) are :class:`FFILinear`. The module is given its frozen base
    and its two factors as they are to be used; :func:`sparse_lora_linear` builds them from
    sizes, a sparsity and an initialisation (what squash's builders call).

    Args:
        weight (nn.Parameter): the frozen base ``(out_dim, in_dim)``, dense or NF4 (QLoRA).
        bias (Optional[nn.Parameter]): the frozen base bias ``(out_dim,)``, or None.
        lora_a (nn.Module): ``in_dim -> rank``: an :class:`FFILinear` or a bias-free
            ``nn.Linear`` (:func:`lora_factor`).
        lora_b (nn.Module): ``rank -> out_dim``, likewise; at least one factor is FFI.
        alpha (float): LoRA scaling numerator; ``scaling = alpha / rank``.
        dropout (float): dropout probability on the adapter input. Default: 0.0
        base_outliers (Optional[Mapping]): with an NF4 base, a corrected base ``NF4(W - S) + S``
            (``{"fraction", "criterion"}``, see :mod:`squash.nf4.base_outliers`; ``S`` is set
            when the base is loaded). Default: None (plain NF4).

    Raises:
        ValueError: naming what does not fit: factor widths against the base or each other, two
            dense factors, a biased factor, ``alpha``, ``dropout``, or ``base_outliers`` on a
            dense base.
    """

    def __init__(
        self,
        weight: nn.Parameter,
        bias: Optional[nn.Parameter],
        lora_a: nn.Module,
        lora_b: nn.Module,
        alpha: float,
        dropout: float = 0.0,
        *,
        base_outliers: Optional[Mapping] = None,
    ):
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"weight must be (out_dim, in_dim), got shape {tuple(weight.shape)}")
        out_dim, in_dim = weight.shape
        for name, factor in (("lora_a", lora_a), ("lora_b", lora_b)):
            plain = isinstance(factor, FFILinear) or (
                isinstance(factor, nn.Linear) and factor.bias is None)  # fmt: skip
            if not plain:
                raise ValueError(f"{name} must be an FFILinear or a bias-free nn.Linear, "
                                 f"got {factor}")  # fmt: skip
        rank = lora_a.out_features
        widths = (lora_a.in_features, lora_b.out_features, lora_b.in_features)
        if widths != (in_dim, out_dim, rank):
            raise ValueError(
                f"factors lora_a {lora_a.in_features} -> {lora_a.out_features} and lora_b "
                f"{lora_b.in_features} -> {lora_b.out_features} do not fit a base of (out_dim, "
                f"in_dim) = {(out_dim, in_dim)}: expected in_dim -> rank -> out_dim"
            )
        sparse = (isinstance(lora_a, FFILinear), isinstance(lora_b, FFILinear))
        if not any(sparse):
            raise ValueError("both factors are dense: use torchtune's LoRALinear")
        if bias is not None and tuple(bias.shape) != (out_dim,):
            raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({out_dim},)")
        self.in_dim, self.out_dim, self.rank = in_dim, out_dim, rank
        self.alpha = check_real("alpha", alpha)
        dropout = check_real("dropout", dropout, low=0.0, high=1.0, high_inclusive=False)
        self.sparse_factor = {v: k for k, v in SPARSE_FACTORS.items()}[sparse]
        self.use_bias = bias is not None
        self._quantize_base = isinstance(weight, NF4Tensor)
        self.disabled = False
        if base_outliers is not None and not self._quantize_base:
            raise ValueError("base_outliers needs an NF4 base (quantize_base=True) to correct")
        init_base_outliers_(self, base_outliers)
        if self._quantize_base:  # a plain weight loaded into the base: quantized by squash
            self.register_load_state_dict_pre_hook(quantize_on_load)
        self.register_parameter("weight", _as_parameter(weight))
        self.register_parameter("bias", None if bias is None else _as_parameter(bias))
        self.dropout = nn.Dropout(p=dropout) if dropout > 0.0 else nn.Identity()
        self.lora_a, self.lora_b = lora_a, lora_b

    @property
    def scaling(self) -> float:
        """``alpha / rank``."""
        return self.alpha / self.rank

    def __deepcopy__(self, memo):  # an NF4 base copied as it is (its own block sizes)
        return deepcopy_module(self, memo)

    # ---- torchtune's AdapterModule interface and meta-device initialisation ---------------------
    def adapter_params(self) -> List[str]:
        """Names of the trainable adapter parameters (``lora_a.values`` or ``lora_a.weight``, ...).

        These are what torchtune's ``get_adapter_params`` and ``set_trainable_params`` select;
        ``get_adapter_params`` requires every name to be an ``nn.Parameter``, so the FFI indices
        (buffers) are named by :meth:`adapter_buffers`. An adapter checkpoint holds both;
        torchtune's ``get_adapter_state_dict`` keeps them all (every key contains ``lora``).
        """
        return [
            f"{name}.{'values' if isinstance(factor, FFILinear) else 'weight'}"
            for name, factor in (("lora_a", self.lora_a), ("lora_b", self.lora_b))
        ]

    def adapter_buffers(self) -> List[str]:
        """Names of the FFI index buffers an adapter checkpoint must hold besides the parameters."""
        return [
            f"{name}.indices"
            for name, factor in (("lora_a", self.lora_a), ("lora_b", self.lora_b))
            if isinstance(factor, FFILinear)
        ]

    def to_empty(
        self, *, device: Optional[Union[str, torch.device, int]], recurse: bool = True
    ) -> "SparseLoRALinear":
        """Materialise the adapter factors (not the base) on ``device``, as ``LoRALinear`` does."""
        self.lora_a.to_empty(device=device, recurse=recurse)
        self.lora_b.to_empty(device=device, recurse=recurse)
        return self

    def initialize_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        """LoRA initialisation: fresh FFI patterns, A Kaiming-uniform over its fan-in, B zero."""
        initialize_lora_factors_(self.lora_a, self.lora_b, generator)

    # ---- SVD initialisation -------------------------------------------------------------------
    @torch.no_grad()
    def initialize_from_pretrained(self, weight: torch.Tensor) -> None:
        """Principal-component initialisation from a pretrained weight, in place: the factors
        of :func:`svd_factors`, and the base becomes its residual ``W - s * B_dense @ A_dense``
        (re-quantized to NF4 when ``quantize_base``; the bias is kept), so the module's output
        equals ``x W^T`` up to the base's quantization error, which is smaller than that of
        ``NF4(W)`` when ``W`` has a decaying spectrum. Computed in float64 and rounded once to the
        factors' and the base's dtypes, so two processes with different thread counts or ISAs
        land on the same float32 values (and the same NF4 codes) as a resume and an export
        recompute them.

        Args:
            weight (torch.Tensor): dense ``(out_dim, in_dim)`` pretrained weight (or an NF4 tensor,
                dequantized first, which adds a second quantization error).

        Raises:
            ValueError: wrong shape, ``rank > min(in_dim, out_dim)``, or a corrected base whose
                outliers are already split (from the old weight: assemble the model with
                ``init: svd`` instead, which splits the residual).
        """
        if module_outliers(self) is not None:
            raise ValueError("initialize_from_pretrained: this base's outliers (base_outliers) "
                             "were split from the old weight; use init: svd in the assembly")
        if tuple(weight.shape) != (self.out_dim, self.in_dim):
            raise ValueError(
                f"pretrained weight shape {tuple(weight.shape)} != (out_dim, in_dim) = "
                f"{(self.out_dim, self.in_dim)}"
            )
        _svd_init_(self.weight, self.lora_a, self.lora_b, self.scaling, weight)

    # ---- forward and export -------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """
        Args:
            x (torch.Tensor): ``(..., in_dim)``.

        Returns:
            torch.Tensor: ``(..., out_dim)``.
        """
        if self._quantize_base:
            # torchao's linear_nf4 with squash's dequantize, plus the outliers' FFI product
            out = outlier_linear(x, self.weight, module_outliers(self))
            if self.use_bias:
                out = out + self.bias
        else:
            out = F.linear(x, self.weight, self.bias)
        if self.disabled:
            return out
        # scaling * B(A x) = B(scaling * A x): scaling the rank-wide hidden costs one pass over
        # (..., rank) instead of one over (..., out_dim) in the forward and again in the backward.
        return out + self.lora_b(self.lora_a(self.dropout(x)) * self.scaling)

    @torch.no_grad()
    def dense_factors(self) -> tuple:
        """``(A, B)`` as dense ``(rank, in_dim)`` and ``(out_dim, rank)`` tensors (for export)."""
        return _dense_factor(self.lora_a).detach(), _dense_factor(self.lora_b).detach()

    @torch.no_grad()
    def merged_weight(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Dense ``W + scaling * B_dense @ A_dense`` (``(out_dim, in_dim)``), NF4 dequantized
        (a corrected base: ``dequant(NF4) + S``).

        Computed in float32 and returned in ``dtype`` (default: the adapter's dtype).
        """
        a, b = self.dense_factors()
        out = module_outliers(self)
        base = _dequantize(self.weight) if out is None else corrected_base(self.weight, out)
        return merge_lora(base, a, b, self.scaling).to(dtype or a.dtype)

    def extra_repr(self) -> str:
        base = "nf4" if self._quantize_base else "dense"
        return (
            f"in_dim={self.in_dim}, out_dim={self.out_dim}, rank={self.rank}, alpha={self.alpha}, "
            f"sparse_factor={self.sparse_factor!r}, base={base}, use_bias={self.use_bias}"
        )

    # ---- model surgery --------------------------------------------------------------------------
    @classmethod
    def from_lora_linear(
        cls,
        lora: nn.Module,
        *,
        sparsity: float = 0.9,
        sparse_factor: str = "a",
        init: str = "lora",
        generator: Optional[torch.Generator] = None,
    ) -> "SparseLoRALinear":
        """A ``SparseLoRALinear`` that shares ``lora``'s base ``weight``/``bias`` parameters.

        Built by :func:`sparse_lora_linear` with ``lora``'s base: keeps rank, alpha, dropout
        probability, bias, the dense or NF4 base (the same ``nn.Parameter`` objects, so loaded
        weights and any references stay valid), the ``disabled`` flag and train/eval mode. The
        adapter factors are initialised afresh per ``init`` (``"svd"`` factors the current base,
        dequantizing NF4), in the dtype and on the device of ``lora.lora_a.weight``.

        Args:
            lora (nn.Module): a torchtune ``LoRALinear``.
            sparsity (float): fraction of zeros of each sparse factor.
            sparse_factor (str): ``"a"``, ``"b"`` or ``"both"``.
            init (str): ``"lora"`` or ``"svd"``.
            generator (Optional[torch.Generator]): CPU generator for FFI patterns and values.

        Returns:
            SparseLoRALinear: the replacement module.

        Raises:
            ValueError: as :func:`sparse_lora_linear`.
        """
        ref = lora.lora_a.weight
        new = sparse_lora_linear(
            lora.in_dim,
            lora.out_dim,
            lora.rank,
            lora.alpha,
            sparsity=sparsity,
            sparse_factor=sparse_factor,
            dropout=lora.dropout.p if isinstance(lora.dropout, nn.Dropout) else 0.0,
            use_bias=lora.use_bias,
            quantize_base=lora._quantize_base,
            init=init,
            dtype=ref.dtype,
            device=ref.device,
            generator=generator,
            weight=lora.weight,
            bias=lora.bias,
        )
        new.disabled = lora.disabled
        return new.train(lora.training)


def sparse_lora_linear(
    in_dim: int,
    out_dim: int,
    rank: int,
    alpha: float,
    sparsity: float = 0.9,
    sparse_factor: str = "a",
    dropout: float = 0.0,
    use_bias: bool = False,
    quantize_base: bool = False,
    init: str = "lora",
    *,
    dtype: Optional[torch.dtype] = None,
    device: Optional[torch.device] = None,
    generator: Optional[torch.Generator] = None,
    weight: Optional[nn.Parameter] = None,
    bias: Optional[nn.Parameter] = None,
    base_outliers: Optional[Mapping] = None,
    **quantization_kwargs,
) -> SparseLoRALinear:
    """A :class:`SparseLoRALinear` built from sizes, as torchtune's ``LoRALinear`` builds itself:
    its base drawn as ``nn.Linear`` draws it (or the given one), its factors by
    :func:`lora_factor`, initialised, and its base quantized to NF4 when ``quantize_base``.

    Initialisation:

    - ``"lora"``: A Kaiming-uniform over its fan-in (``in_dim``, or ``k`` when sparse, with a
      random pattern), B zero (when sparse: a random pattern with zero values), so the output
      equals the base output at step 0.
    - ``"svd"``: :func:`svd_factors` of the base weight (nothing on the meta device), the base
      becoming the residual. For a real checkpoint, the assembly
      (:func:`squash.assembly.model_setup.assemble_adapter_model`) factors the loaded weights.

    Args:
        in_dim (int): input width.
        out_dim (int): output width.
        rank (int): adapter rank ``r >= 1``.
        alpha (float): LoRA scaling numerator; ``scaling = alpha / rank``.
        sparsity (float): fraction of zeros of each sparse factor, in ``[0, 1)``. Default: 0.9
        sparse_factor (str): ``"a"``, ``"b"`` or ``"both"``. Default: ``"a"``
        dropout (float): dropout probability on the adapter input. Default: 0.0
        use_bias (bool): whether the base layer has a bias. Default: False
        quantize_base (bool): store the base weight as an NF4 tensor (QLoRA). Default: False
        init (str): ``"lora"`` or ``"svd"``. Default: ``"lora"``
        dtype (Optional[torch.dtype]): dtype of the base (before NF4) and adapter parameters.
        device (Optional[torch.device]): where the module lives.
        generator (Optional[torch.Generator]): CPU generator for FFI patterns and FFI values.
        weight (Optional[nn.Parameter]): an existing base weight ``(out_dim, in_dim)`` to use
            (the very same parameter, dense or NF4) instead of drawing one; a dense one is
            quantized when ``quantize_base``. Default: None
        bias (Optional[nn.Parameter]): the existing base bias ``(out_dim,)``, given with
            ``weight`` exactly when ``use_bias``.
        base_outliers (Optional[Mapping]): with ``quantize_base``, a corrected base (see
            :class:`SparseLoRALinear`). Default: None
        **quantization_kwargs: ``to_nf4`` arguments (``block_size``, ``scaler_block_size``); only
            with ``quantize_base``. Without them the sizes are chosen for the weight's shape
            (:func:`~squash.nf4.nf4_block_sizes`: torchao's defaults where they divide it), and
            the NF4 weight records them.

    Returns:
        SparseLoRALinear: the module.

    Raises:
        ValueError: naming a bad argument (sizes, ``rank``, ``alpha``, ``sparsity``,
            ``sparse_factor``, ``init``, ``dropout``), quantization arguments without
            ``quantize_base``, a given base of the wrong shape or kind, or an NF4 base whose
            size no block size divides, or the given block sizes do not divide (naming the shape
            and the block sizes).
    """
    in_dim = check_int("in_dim", in_dim)
    out_dim = check_int("out_dim", out_dim)
    rank = check_int("rank", rank)
    alpha = check_real("alpha", alpha)
    sparsity = check_sparsity("sparsity", sparsity)
    check_choice("sparse_factor", sparse_factor, SPARSE_FACTORS)
    check_choice("init", init, INITS)
    check_real("dropout", dropout, low=0.0, high=1.0, high_inclusive=False)
    for name, flag in (("use_bias", use_bias), ("quantize_base", quantize_base)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be a bool, got {flag!r}")
    if not quantize_base and any(quantization_kwargs.values()):
        raise ValueError(
            f"quantize_base is False, but got quantization arguments {quantization_kwargs}"
        )
    if base_outliers is not None and not quantize_base:
        raise ValueError("base_outliers needs quantize_base=True (an NF4 base to correct)")
    where = f"SparseLoRALinear(in_dim={in_dim}, out_dim={out_dim})"
    weight, bias = _base(where, in_dim, out_dim, use_bias, quantize_base, weight, bias, dtype,
                         device, quantization_kwargs)  # fmt: skip
    sparse_a, sparse_b = SPARSE_FACTORS[sparse_factor]
    factory = dict(dtype=dtype, device=device, generator=generator)
    lora_a = lora_factor(in_dim, rank, sparsity if sparse_a else None, **factory)
    lora_b = lora_factor(rank, out_dim, sparsity if sparse_b else None, **factory)
    _init_lora_values_(lora_a, lora_b, generator)  # the FFI factors drew their patterns already
    if init == "svd" and not weight.is_meta:  # on meta there is nothing to factor yet
        _svd_init_(weight, lora_a, lora_b, alpha / rank, weight)
    if quantize_base and not isinstance(weight, NF4Tensor):
        weight = nn.Parameter(quantize_nf4(weight.detach(), where, **quantization_kwargs),
                              requires_grad=False)  # fmt: skip
    return SparseLoRALinear(weight, bias, lora_a, lora_b, alpha, dropout,
                            base_outliers=base_outliers)  # fmt: skip


def _base(where, in_dim, out_dim, use_bias, quantize_base, weight, bias, dtype, device,
          quantization_kwargs) -> tuple:  # fmt: skip
    """The base ``(weight, bias)``: the given ones, checked, or freshly drawn."""
    if quantize_base and not isinstance(weight, NF4Tensor):
        given = {k: v for k, v in quantization_kwargs.items() if v}
        if given:  # name the shape before torchao fails on it with a bare assertion
            check_nf4_shape(where, (out_dim, in_dim), **given)
        else:
            nf4_block_sizes(where, (out_dim, in_dim))
    if weight is None:
        if bias is not None:
            raise ValueError("bias was given without weight: give both or neither")
        # Drawn as nn.Linear draws it (as LoRALinear does) and created frozen.
        linear = nn.Linear(in_dim, out_dim, bias=use_bias, dtype=dtype, device=device)
        weight = nn.Parameter(linear.weight.detach(), requires_grad=False)
        if use_bias:
            bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
        return weight, bias
    if tuple(weight.shape) != (out_dim, in_dim):
        raise ValueError(
            f"weight has shape {tuple(weight.shape)}, expected (out_dim, in_dim) = "
            f"{(out_dim, in_dim)}"
        )
    if isinstance(weight, NF4Tensor) and not quantize_base:
        raise ValueError("weight is an NF4 tensor but quantize_base is False")
    if (bias is not None) != use_bias:
        raise ValueError(f"use_bias is {use_bias} but bias is {type(bias).__name__}")
    if bias is not None and tuple(bias.shape) != (out_dim,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({out_dim},)")
    return _as_parameter(weight), None if bias is None else _as_parameter(bias)


@torch.no_grad()
def svd_factors(
    weight: torch.Tensor,
    *,
    rank: int,
    scaling: float,
    fan_in_a: Optional[int] = None,
    fan_in_b: Optional[int] = None,
) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
    """The SVD initialisation of one adapter (``init: svd``), the one place it is computed.

    With ``W = U S V^T`` and ``s = scaling``: ``B = U_r sqrt(S_r) / sqrt(s)`` and
    ``A = sqrt(S_r) V_r^T / sqrt(s)``, so ``s * B @ A`` is the best rank-``r`` approximation of
    ``W``. A sparse factor (one with a fan-in) is pruned to FFI by magnitude
    (:func:`~squash.sparsity.prune_to_ffi`); when the other factor is dense it is refitted
    by least squares to the pruned one (``min ||W - s * B @ A_ffi||``), which only lowers the
    residual. Computed in float64 on ``weight``'s device.

    Args:
        weight (torch.Tensor): dense ``(out_dim, in_dim)`` pretrained weight (an NF4 tensor is
            dequantized first).
        rank (int): adapter rank, at most ``min(out_dim, in_dim)``.
        scaling (float): ``alpha / rank``.
        fan_in_a (Optional[int]): the non-zeros a row of an FFI ``A`` keeps; None: dense ``A``.
        fan_in_b (Optional[int]): likewise for ``B``.

    Returns:
        Tuple[Dict[str, torch.Tensor], torch.Tensor]: the factors keyed as the module's state
        dict (``lora_a.values`` and ``lora_a.indices`` for an FFI factor, ``lora_a.weight`` for
        a dense one; float64 values, int64 indices) and the float64 residual
        ``W - s * B_dense @ A_dense`` that becomes the base.

    Raises:
        ValueError: ``rank > min(out_dim, in_dim)``.
    """
    w = _dequantize(weight).to(torch.float64)  # (out, in)
    out_dim, in_dim = w.shape
    if rank > min(in_dim, out_dim):
        raise ValueError(f"svd init needs rank <= min(in_dim, out_dim), got rank={rank}")
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    root = s[:rank].sqrt() / math.sqrt(scaling)
    b = u[:, :rank] * root  # (out, r)
    a = root[:, None] * vh[:rank]  # (r, in)
    sparse_a, sparse_b = fan_in_a is not None, fan_in_b is not None
    state = {}
    for name, fan_in, dense in (("lora_a", fan_in_a, a), ("lora_b", fan_in_b, b)):
        if fan_in is not None:
            values, indices = prune_to_ffi(dense, fan_in=fan_in)
            state[f"{name}.values"], state[f"{name}.indices"] = values, indices
            pruned = torch.zeros_like(dense).scatter_(1, indices.long(), values)
            a, b = (pruned, b) if name == "lora_a" else (a, pruned)
    if sparse_a and not sparse_b:  # refit B to the pruned A: (A^T) X = W^T, B = X^T / s
        b = torch.linalg.lstsq(a.T, w.T).solution.T / scaling
        state["lora_b.weight"] = b
    elif sparse_b and not sparse_a:  # refit A to the pruned B: B X = W, A = X / s
        a = torch.linalg.lstsq(b, w).solution / scaling
        state["lora_a.weight"] = a
    return state, w - scaling * (b @ a)


@torch.no_grad()
def _svd_init_(base: torch.Tensor, lora_a: nn.Module, lora_b: nn.Module, scaling: float,
               pretrained: torch.Tensor) -> None:  # fmt: skip
    """:func:`svd_factors` of ``pretrained`` into the factors, its residual into ``base`` (an
    NF4 base quantizes it in place), each rounded once to the dtype it is held in."""
    state, residual = svd_factors(
        _dequantize(pretrained).to(_trainable(lora_a).device), rank=lora_a.out_features,
        scaling=scaling, fan_in_a=_fan_in(lora_a), fan_in_b=_fan_in(lora_b),
    )  # fmt: skip
    factors = {"lora_a": lora_a, "lora_b": lora_b}
    for key, value in state.items():
        factor, name = key.split(".")
        getattr(factors[factor], name).copy_(value)
    residual = residual.float().to(base.dtype)
    if isinstance(base, NF4Tensor):
        copy_nf4_(base, residual)  # as torchao's copy_, squash's quantization
    else:
        base.copy_(residual)


def initialize_lora_factors_(
    lora_a: nn.Module, lora_b: nn.Module, generator: Optional[torch.Generator] = None
) -> None:
    """LoRA initialisation of a pair of factors (as :func:`lora_factor` builds them), in place:
    fresh FFI patterns, A Kaiming-uniform over its fan-in, B zero (nothing drawn on meta)."""
    for factor in (lora_a, lora_b):
        if isinstance(factor, FFILinear):
            factor.reset_parameters(generator=generator)
    _init_lora_values_(lora_a, lora_b, generator)


def _init_lora_values_(lora_a, lora_b, generator) -> None:
    if isinstance(lora_a, FFILinear):
        lora_a.reset_values(generator=generator)
    elif not lora_a.weight.is_meta:
        kaiming_uniform_(lora_a.weight, lora_a.in_features, generator=generator)
    with torch.no_grad():
        _trainable(lora_b).zero_()


def _as_parameter(tensor: torch.Tensor) -> nn.Parameter:
    """A given base tensor as a parameter: the same object if it is one, else a frozen one."""
    return tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=False)


def _fan_in(factor: nn.Module) -> Optional[int]:
    """The fan-in of an FFI factor, None for a dense one."""
    return factor.fan_in if isinstance(factor, FFILinear) else None


def _trainable(factor: nn.Module) -> torch.Tensor:
    """The trainable tensor of a factor: ``values`` of an FFILinear, else ``weight``."""
    return factor.values if isinstance(factor, FFILinear) else factor.weight


def _dense_factor(factor: nn.Module) -> torch.Tensor:
    return factor.to_dense() if isinstance(factor, FFILinear) else factor.weight


def _dequantize(weight: torch.Tensor) -> torch.Tensor:
    """A plain dense tensor: NF4 tensors are dequantized to their original dtype."""
    if isinstance(weight, NF4Tensor):
        return weight.get_original_weight()
    return weight.detach()
