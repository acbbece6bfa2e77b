"""OPT with FFI-sparse LoRA adapters (:class:`~squash.modules.SparseLoRALinear`) on an NF4 base.

:func:`squash_opt` is :func:`~squash.models.opt.lora_opt` with a default ``sparsity``, so the
component builder builds ``SparseLoRALinear`` adapters directly; the sized builders pass every
argument to it by name (see :mod:`._model_builders`), with ``quantize_base=True`` by default:
squash is QLoRA.
"""

from functools import partial
from typing import List, Mapping, Optional

from torchtune.modules.peft import LORA_ATTN_MODULES

from squash.models.opt._component_builders import lora_opt
from squash.models.opt._decoder import OPTDecoder
from squash.models._squash_builders import _sized
from squash.models.opt._model_builders import _OPT_SIZES

squash_opt = partial(lora_opt, sparsity=0.9)
squash_opt.__doc__ = """OPT of any size with sparse LoRA adapters: :func:`lora_opt` with
``sparsity=0.9`` by default (``sparse_factor``, ``init`` and the rest as there)."""


def squash_opt_sized(
    size: str,
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    quantize_base: bool = True,
    sparsity: float = 0.9,
    sparse_factor: str = "a",
    init: str = "lora",
    base_outliers: Optional[Mapping] = None,
) -> OPTDecoder:
    """OPT of ``size`` (a key of the published sizes, as for
    :func:`~squash.models.opt.lora_opt_sized`) with FFI-sparse LoRA adapters on an NF4 base;
    the other arguments as for :func:`lora_opt`. The sized builders (``squash_opt_350m``, ...)
    are this function with ``size`` bound."""
    args = dict(locals())
    return lora_opt(**_OPT_SIZES[args.pop("size")], **args)


squash_opt_125m = _sized(squash_opt_sized, "125m", """OPT-125m with FFI-sparse LoRA adapters on an NF4
base; arguments as for :func:`lora_opt`.""")
squash_opt_350m = _sized(squash_opt_sized, "350m", """OPT-350m with FFI-sparse LoRA adapters on an NF4
base; arguments as for :func:`lora_opt`.""")
squash_opt_1_3b = _sized(squash_opt_sized, "1_3b", """OPT-1.3b with FFI-sparse LoRA adapters on an NF4
base; arguments as for :func:`lora_opt`.""")
squash_opt_2_7b = _sized(squash_opt_sized, "2_7b", """OPT-2.7b with FFI-sparse LoRA adapters on an NF4
base; arguments as for :func:`lora_opt`.""")
squash_opt_6_7b = _sized(squash_opt_sized, "6_7b", """OPT-6.7b with FFI-sparse LoRA adapters on an NF4
base; arguments as for :func:`lora_opt`.""")
squash_opt_tiny = _sized(squash_opt_sized, "tiny", """The tiny OPT with FFI-sparse LoRA adapters on an NF4
base; arguments as for :func:`lora_opt`.""")
