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

:func:`use_squash_nf4_` turns the torchtune modules of a built model into these, in place.
"""

import torch
from torch import nn
from torchtune.modules.low_precision import FrozenNF4Linear
from torchtune.modules.peft import LoRALinear

from squash.nf4.base_outliers import init_base_outliers_, module_outliers
from squash.nf4.extensions import install_torchao_extensions
from squash.nf4.outliers import outlier_linear


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
    """Make every torchtune ``LoRALinear`` with an NF4 base an :class:`NF4LoRALinear`, and every
    ``FrozenNF4Linear`` an :class:`NF4Linear`, in place.

    Only the class of each module changes (``module.__class__``): the module objects, their
    parameters, hooks and train/eval mode stay, so references to them (an optimizer's, FSDP's)
    remain valid. Other modules, subclasses of these included, are left as they are.

    Args:
        model (nn.Module): any module tree.

    Returns:
        nn.Module: ``model``.
    """
    install_torchao_extensions()
    for module in model.modules():
        if type(module) is LoRALinear and module._quantize_base:
            module.__class__ = NF4LoRALinear
        elif type(module) is FrozenNF4Linear:
            module.__class__ = NF4Linear
    return model


