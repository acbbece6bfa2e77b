"""torchtune's NF4 modules computed with squash's NF4 kernel.

:class:`NF4LoRALinear` is torchtune's ``LoRALinear`` and :class:`NF4Linear` torchtune's
``FrozenNF4Linear`` with one change: an NF4 base runs through :func:`squash.nf4.nf4_linear`
(squash's dequantization kernel) instead of torchao's ``linear_nf4``. Their results are equal bit
for bit (the kernel's dequantization equals torchao's exactly, and the products and sums are the
same, in the same order); only the time differs: on the CPU torchao dequantizes in many small
tensor operations, about a tenth of a SmolLM2 QLoRA step on 2 cores. They keep their parents'
parameters, state-dict keys and adapter interface, so torchtune's recipes, checkpointers and
utilities take them as their parents. ``SQUASH_NF4=torchao`` switches back to torchao's
``linear_nf4``.

:func:`use_squash_nf4_` replaces the torchtune modules of a built model by these;
:func:`quantize_base_` quantizes an unquantized model's frozen base linears into them. A plain
weight loaded into their NF4 base is quantized by squash (:func:`~squash.nf4.quantize_on_load`,
a public ``load_state_dict`` pre-hook; equal to torchao's ``copy_``).
"""

import torch
from torch import nn
from torchtune.modules.low_precision import FrozenNF4Linear
from torchtune.modules.peft import LoRALinear

from squash.nf4.base_outliers import init_base_outliers_, module_outliers
from squash.nf4.outliers import outlier_linear
from squash.nf4.quantize import (
    copy_nf4_,
    deepcopy_module,
    nf4_block_sizes,
    quantize_nf4,
    quantize_on_load,
)


class NF4LoRALinear(LoRALinear):
    """torchtune's :class:`~torchtune.modules.peft.LoRALinear` whose NF4 base (``quantize_base``)
    is computed by :func:`squash.nf4.nf4_linear`; everything else is ``LoRALinear``'s, and so are
    the constructor's arguments, plus ``base_outliers`` (keyword only, with ``quantize_base``):
    a corrected base ``NF4 + S`` (:mod:`squash.nf4.base_outliers`), None for plain NF4."""

    def __init__(self, *args, base_outliers=None, **kwargs):
        super().__init__(*args, **kwargs)
        if base_outliers is not None and not self._quantize_base:
            raise ValueError("base_outliers needs quantize_base=True (an NF4 base to correct)")
        init_base_outliers_(self, base_outliers)
        self.register_load_state_dict_pre_hook(quantize_on_load)

    def __deepcopy__(self, memo):  # the NF4 base copied as it is (its own block sizes)
        return deepcopy_module(self, memo)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """
        Args:
            x (torch.Tensor): ``(..., in_dim)``.

        Returns:
            torch.Tensor: ``(..., out_dim)``, as ``LoRALinear.forward`` computes it.
        """
        if not self._quantize_base:
            return super().forward(x)
        out = outlier_linear(x, self.weight, module_outliers(self))  # S None: nf4_linear
        if self.use_bias:
            out = out + self.bias
        if self.disabled:
            return out
        # LoRALinear's arithmetic, in its order (so the two agree bit for bit)
        lora_out = self.lora_a(self.dropout(x))
        lora_out = (self.alpha / self.rank) * self.lora_b(lora_out)
        return out + lora_out


class NF4Linear(FrozenNF4Linear):
    """torchtune's :class:`~torchtune.modules.low_precision.FrozenNF4Linear` (a frozen linear
    with an NF4 weight, a projection left without an adapter) computed by
    :func:`squash.nf4.nf4_linear`; the constructor's arguments are ``FrozenNF4Linear``'s, plus
    ``base_outliers`` (keyword only) as in :class:`NF4LoRALinear`."""

    def __init__(self, *args, base_outliers=None, **kwargs):
        super().__init__(*args, **kwargs)
        init_base_outliers_(self, base_outliers)
        self.register_load_state_dict_pre_hook(quantize_on_load)

    def __deepcopy__(self, memo):  # the NF4 base copied as it is (its own block sizes)
        return deepcopy_module(self, memo)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """
        Args:
            input (torch.Tensor): ``(..., in_dim)``.

        Returns:
            torch.Tensor: ``(..., out_dim)``.
        """
        out = outlier_linear(input, self.weight, module_outliers(self))
        if self.bias is not None:
            out = out + self.bias
        return out


def is_plain_lora(module: nn.Module) -> bool:
    """Whether ``module`` is a plain LoRA linear: torchtune's ``LoRALinear`` itself or
    :class:`NF4LoRALinear` (not DoRA, QAT LoRA or squash's sparse adapter)."""
    return type(module) in (LoRALinear, NF4LoRALinear)


def use_squash_nf4_(model: nn.Module) -> nn.Module:
    """Replace every torchtune ``LoRALinear`` with an NF4 base by an :class:`NF4LoRALinear`, and
    every ``FrozenNF4Linear`` by an :class:`NF4Linear` (for models built by torchtune's own QLoRA
    builders; squash's builders build these classes directly).

    Each replacement is a shallow copy of the old module in the subclass (``copy.copy``'s
    protocol: ``__setstate__`` of the old module's state): it holds the old module's
    parameters, submodules (the adapter factors, dropout), flags, hooks and train/eval mode,
    the same objects, so loaded weights and references to them (an optimizer's, a hook's handle)
    stay valid; the old module, which shares them, is no longer part of ``model``. Other
    modules, subclasses of these included, are left as they are.

    Args:
        model (nn.Module): any module tree (``model`` itself may be replaced).

    Returns:
        nn.Module: ``model``, or its replacement if it is such a module itself.
    """
    for name, module in list(model.named_modules()):
        if type(module) is LoRALinear and module._quantize_base:
            new = _shallow_copy_as(module, NF4LoRALinear)
        elif type(module) is FrozenNF4Linear:
            new = _shallow_copy_as(module, NF4Linear)
        else:
            continue
        if not name:
            return new
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    return model


def _shallow_copy_as(old: nn.Module, cls: type) -> nn.Module:
    """``old``'s state (parameters, submodules, hooks, flags: the same objects) in a ``cls``, a
    subclass adding only a plain NF4 setting, the load pre-hook and its forward."""
    new = cls.__new__(cls)
    new.__setstate__(dict(vars(old)))
    new.base_outliers = None  # plain NF4 (no outlier buffers: module_outliers gives None)
    new.register_load_state_dict_pre_hook(quantize_on_load)
    return new


@torch.no_grad()
def quantize_base_(model: torch.nn.Module) -> torch.nn.Module:
    """Quantize, in place, the frozen base linears of a torchtune model's ``layers`` to NF4,
    with block sizes chosen per weight (:func:`~squash.nf4.quantize.nf4_block_sizes`).

    What torchtune's QLoRA builders (``quantize_base=True``) quantize, for models whose shapes
    torchtune's default block sizes refuse: build the model with ``quantize_base=False``, then call
    this. The base of each ``LoRALinear`` becomes an NF4 parameter and the module an
    :class:`~squash.nf4.NF4LoRALinear` (torchtune's QLoRA ``LoRALinear`` computed with squash's
    NF4 kernel, equal bit for bit); each plain ``nn.Linear`` (a projection left without an
    adapter) becomes an :class:`~squash.nf4.NF4Linear` (torchtune's ``FrozenNF4Linear``, the
    same way) holding its weight. The adapter factors, embeddings and output projection are left
    as they are.

    Args:
        model (torch.nn.Module): a torchtune ``TransformerDecoder`` (anything with ``layers``).

    Returns:
        torch.nn.Module: ``model``.

    Raises:
        ValueError: naming the module whose shape no block size divides, or a biased linear.
    """
    for layer_name, layer in model.layers.named_modules(prefix="layers"):
        if hasattr(layer, "adapter_params"):  # an adapter's factors stay as they are
            continue
        for child_name, child in list(layer.named_children()):
            name = f"{layer_name}.{child_name}"
            if is_plain_lora(child):
                if not child._quantize_base:
                    child.weight = torch.nn.Parameter(
                        quantize_nf4(child.weight.detach(), name), requires_grad=False
                    )
                    child._quantize_base = True
            elif type(child) is torch.nn.Linear:
                if child.bias is not None:
                    raise ValueError(f"{name}: FrozenNF4Linear takes no bias")
                block, scaler = nf4_block_sizes(name, tuple(child.weight.shape))
                frozen = FrozenNF4Linear(
                    child.in_features,
                    child.out_features,
                    bias=False,
                    dtype=child.weight.dtype,
                    device=child.weight.device,
                    block_size=block,
                    scaler_block_size=scaler,
                )
                copy_nf4_(frozen.weight, child.weight)  # quantized with the same sizes
                setattr(layer, child_name, frozen)
    return use_squash_nf4_(model)
