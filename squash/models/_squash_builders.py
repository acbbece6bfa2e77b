"""squash builders for torchtune's own model families.

Each builds torchtune's (Q)LoRA model and swaps every ``LoRALinear`` for a
:class:`~squash.modules.SparseLoRALinear` with the same rank, alpha, dropout and base
(:func:`~squash.modules.swap_lora_linear`). ``quantize_base=True`` by default, as in torchtune's
``qlora_*`` builders. Adapter factors get the standard LoRA init; for the SVD init call
:func:`~squash.modules.svd_initialize` after the checkpoint is loaded (at build time the weights
are random).

Llama 3.2 1B/3B and Qwen 2.5 0.5B/1.5B tie the output projection to the token embeddings
(torchtune's ``TiedLinear``), so torchtune raises on ``apply_lora_to_output=True`` for them; the
argument is passed through unchanged.
"""

from typing import Callable, List

from torch import nn
from torchtune.models.llama3_2 import lora_llama3_2_1b, lora_llama3_2_3b
from torchtune.models.qwen2_5 import (
    lora_qwen2_5_0_5b,
    lora_qwen2_5_1_5b_base,
    lora_qwen2_5_1_5b_instruct,
)
from torchtune.modules import TransformerDecoder
from torchtune.modules.peft import LORA_ATTN_MODULES

from squash.modules import swap_lora_linear


def squash_model(
    builder: Callable[..., nn.Module],
    *,
    sparsity: float = 0.9,
    sparse_factor: str = "a",
    **lora_kwargs,
) -> nn.Module:
    """Build a torchtune LoRA model with ``builder(**lora_kwargs)`` and swap in sparse adapters.

    Args:
        builder (Callable[..., nn.Module]): a torchtune-style LoRA builder (``lora_llama3_2_1b``,
            ``lora_llama3_2``, ``squash.models.opt.lora_opt_350m``, ...).
        sparsity (float): fraction of zeros of each sparse factor. Default: 0.9
        sparse_factor (str): ``"a"``, ``"b"`` or ``"both"``. Default: ``"a"``
        **lora_kwargs: the builder's arguments (``lora_attn_modules``, ``lora_rank``, ...).

    Returns:
        nn.Module: the model with ``SparseLoRALinear`` adapters.
    """
    model = builder(**lora_kwargs)
    return swap_lora_linear(model, sparsity=sparsity, sparse_factor=sparse_factor)


def squash_llama3_2_1b(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    quantize_base: bool = True,
    sparsity: float = 0.9,
    sparse_factor: str = "a",
    tie_word_embeddings: bool = True,
) -> TransformerDecoder:
    """Llama 3.2 1B with FFI-sparse LoRA adapters on an NF4 base (see ``lora_llama3_2_1b``).

    Args:
        lora_attn_modules (List[LORA_ATTN_MODULES]): attention projections to adapt, from
            ``{"q_proj", "k_proj", "v_proj", "output_proj"}``.
        apply_lora_to_mlp (bool): adapt the MLP linears too. Default: False
        apply_lora_to_output (bool): unsupported with tied embeddings (torchtune raises).
        lora_rank (int): adapter rank. Default: 8
        lora_alpha (float): scaling numerator, ``scaling = alpha / rank``. Default: 16
        lora_dropout (float): adapter input dropout. Default: 0.0
        quantize_base (bool): NF4 base weights (QLoRA). Default: True
        sparsity (float): fraction of zeros of each sparse factor. Default: 0.9
        sparse_factor (str): ``"a"``, ``"b"`` or ``"both"``. Default: ``"a"``
        tie_word_embeddings (bool): tie output projection and embeddings. Default: True

    Returns:
        TransformerDecoder: the model.
    """
    return squash_model(
        lora_llama3_2_1b,
        sparsity=sparsity,
        sparse_factor=sparse_factor,
        lora_attn_modules=lora_attn_modules,
        apply_lora_to_mlp=apply_lora_to_mlp,
        apply_lora_to_output=apply_lora_to_output,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        quantize_base=quantize_base,
        tie_word_embeddings=tie_word_embeddings,
    )


def squash_llama3_2_3b(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    quantize_base: bool = True,
    sparsity: float = 0.9,
    sparse_factor: str = "a",
    tie_word_embeddings: bool = True,
) -> TransformerDecoder:
    """Llama 3.2 3B with FFI-sparse LoRA adapters on an NF4 base (see ``lora_llama3_2_3b``).

    Arguments as in :func:`squash_llama3_2_1b`.
    """
    return squash_model(
        lora_llama3_2_3b,
        sparsity=sparsity,
        sparse_factor=sparse_factor,
        lora_attn_modules=lora_attn_modules,
        apply_lora_to_mlp=apply_lora_to_mlp,
        apply_lora_to_output=apply_lora_to_output,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        quantize_base=quantize_base,
        tie_word_embeddings=tie_word_embeddings,
    )


def _squash_qwen2_5(
    builder: Callable[..., TransformerDecoder],
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool,
    apply_lora_to_output: bool,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float,
    quantize_base: bool,
    sparsity: float,
    sparse_factor: str,
) -> TransformerDecoder:
    return squash_model(
        builder,
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


def squash_qwen2_5_0_5b(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    quantize_base: bool = True,
    sparsity: float = 0.9,
    sparse_factor: str = "a",
) -> TransformerDecoder:
    """Qwen 2.5 0.5B (base or instruct) with FFI-sparse LoRA adapters on an NF4 base.

    Arguments as in :func:`squash_llama3_2_1b` (no ``tie_word_embeddings``: always tied). The
    q/k/v projections keep their biases (dense, frozen).
    """
    return _squash_qwen2_5(
        lora_qwen2_5_0_5b, lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output,
        lora_rank, lora_alpha, lora_dropout, quantize_base, sparsity, sparse_factor,
    )  # fmt: skip


def squash_qwen2_5_1_5b_base(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    quantize_base: bool = True,
    sparsity: float = 0.9,
    sparse_factor: str = "a",
) -> TransformerDecoder:
    """Qwen 2.5 1.5B base with FFI-sparse LoRA adapters on an NF4 base.

    Arguments as in :func:`squash_qwen2_5_0_5b`.
    """
    return _squash_qwen2_5(
        lora_qwen2_5_1_5b_base, lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output,
        lora_rank, lora_alpha, lora_dropout, quantize_base, sparsity, sparse_factor,
    )  # fmt: skip


def squash_qwen2_5_1_5b_instruct(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    quantize_base: bool = True,
    sparsity: float = 0.9,
    sparse_factor: str = "a",
) -> TransformerDecoder:
    """Qwen 2.5 1.5B instruct with FFI-sparse LoRA adapters on an NF4 base.

    Arguments as in :func:`squash_qwen2_5_0_5b`.
    """
    return _squash_qwen2_5(
        lora_qwen2_5_1_5b_instruct, lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output,
        lora_rank, lora_alpha, lora_dropout, quantize_base, sparsity, sparse_factor,
    )  # fmt: skip


# torchtune's 1.5B base and instruct builders differ only in max_seq_len (131072 vs 32768, the
# size of the RoPE cache); the weights load into either. The short name is the instruct one.
squash_qwen2_5_1_5b = squash_qwen2_5_1_5b_instruct
