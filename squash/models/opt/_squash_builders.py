"""OPT with FFI-sparse LoRA adapters (:class:`~squash.modules.SparseLoRALinear`).

Each builder builds the (Q)LoRA OPT of :mod:`._component_builders` / :mod:`._model_builders`
and swaps every ``LoRALinear`` for a ``SparseLoRALinear`` with the same rank, alpha, dropout and
base, through :func:`squash.models.squash_model`. ``quantize_base=True`` by default: squash is QLoRA.
"""

from typing import List

from torchtune.modules.peft import LORA_ATTN_MODULES

from squash.models._squash_builders import squash_model
from squash.models.opt import _model_builders
from squash.models.opt._component_builders import lora_opt
from squash.models.opt._decoder import OPTDecoder


def squash_opt(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    *,
    sparsity: float = 0.9,
    sparse_factor: str = "a",
    **kwargs,
) -> OPTDecoder:
    """OPT of any size with sparse LoRA adapters: :func:`lora_opt`'s arguments plus sparsity.

    Args:
        lora_attn_modules (List[LORA_ATTN_MODULES]): attention projections to adapt.
        apply_lora_to_mlp (bool): adapt fc1 and fc2 too. Default: False
        apply_lora_to_output (bool): must be False (the output is tied to the embedding).
        sparsity (float): fraction of zeros of each sparse factor. Default: 0.9
        sparse_factor (str): ``"a"``, ``"b"`` or ``"both"``. Default: ``"a"``
        **kwargs: sizes and LoRA arguments of :func:`lora_opt` (``lora_rank``, ``lora_alpha``, ...).

    Returns:
        OPTDecoder: the model, its adapted linears ``SparseLoRALinear``.
    """
    return squash_model(
        lora_opt,
        sparsity=sparsity,
        sparse_factor=sparse_factor,
        lora_attn_modules=lora_attn_modules,
        apply_lora_to_mlp=apply_lora_to_mlp,
        apply_lora_to_output=apply_lora_to_output,
        **kwargs,
    )


def _squash_sized(lora_builder):
    def builder(
        lora_attn_modules: List[LORA_ATTN_MODULES],
        apply_lora_to_mlp: bool = False,
        apply_lora_to_output: bool = False,
        lora_rank: int = 8,
        lora_alpha: float = 16,
        lora_dropout: float = 0.0,
        quantize_base: bool = True,
        sparsity: float = 0.9,
        sparse_factor: str = "a",
    ) -> OPTDecoder:
        return squash_model(
            lora_builder,
            sparsity=sparsity,
            sparse_factor=sparse_factor,
            lora_attn_modules=lora_attn_modules,
            apply_lora_to_mlp=apply_lora_to_mlp,
            apply_lora_to_output=apply_lora_to_output,
            lora_rank=lora_rank,
            lora_alpha=lora_alpha,
            lora_dropout=lora_dropout,
            quantize_base=quantize_base,
        )

    size = lora_builder.__name__.removeprefix("lora_opt_")
    builder.__name__ = builder.__qualname__ = f"squash_opt_{size}"
    builder.__doc__ = f"""OPT-{size} with FFI-sparse LoRA adapters on an NF4 base.

    Args:
        lora_attn_modules (List[LORA_ATTN_MODULES]): attention projections to adapt, from
            ``{{"q_proj", "k_proj", "v_proj", "output_proj"}}``.
        apply_lora_to_mlp (bool): adapt fc1 and fc2 too. Default: False
        apply_lora_to_output (bool): must be False (the output is tied to the embedding).
        lora_rank (int): adapter rank. Default: 8
        lora_alpha (float): scaling numerator, ``scaling = alpha / rank``. Default: 16
        lora_dropout (float): adapter input dropout. Default: 0.0
        quantize_base (bool): NF4 base weights (QLoRA). Default: True
        sparsity (float): fraction of zeros of each sparse factor. Default: 0.9
        sparse_factor (str): ``"a"``, ``"b"`` or ``"both"``. Default: ``"a"``

    Returns:
        OPTDecoder: OPT-{size} whose adapted linears are ``SparseLoRALinear``.
    """
    return builder


squash_opt_125m = _squash_sized(_model_builders.lora_opt_125m)
squash_opt_350m = _squash_sized(_model_builders.lora_opt_350m)
squash_opt_1_3b = _squash_sized(_model_builders.lora_opt_1_3b)
squash_opt_2_7b = _squash_sized(_model_builders.lora_opt_2_7b)
squash_opt_6_7b = _squash_sized(_model_builders.lora_opt_6_7b)
squash_opt_tiny = _squash_sized(_model_builders.lora_opt_tiny)
