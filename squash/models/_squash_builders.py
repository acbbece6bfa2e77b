"""squash builders for torchtune's own model families.

torchtune's component builders cannot take an adapter class, so each of these builds torchtune's
(Q)LoRA model and swaps every ``LoRALinear`` for a :class:`~squash.modules.SparseLoRALinear`
with the same rank, alpha, dropout and base (:func:`~squash.modules.swap_lora_linear`); an NF4
projection left without an adapter is computed with squash's NF4 kernel
(:func:`~squash.modules.use_squash_nf4_`).
``quantize_base=True`` by default, as in torchtune's ``qlora_*`` builders. ``init="svd"`` factors
each base the model holds when built; after loading a checkpoint, call
:func:`~squash.modules.svd_initialize` with its unquantized weights.

The named builders are plain functions with explicit signatures whose bodies pass every argument
by name to :func:`squash_model` (``locals()`` at the top of a function holds exactly its
arguments, so none can be dropped).

Llama 3.2 1B/3B and Qwen 2.5 0.5B/1.5B tie the output projection to the token embeddings
(torchtune's ``TiedLinear``), so torchtune raises on ``apply_lora_to_output=True`` for them; the
argument is passed through unchanged. A tied output is computed as one 2-D matmul
(:class:`~squash.modules.FlatTiedLinear`: the same values, without the per-chunk weight copies
that torchtune's chunked output costs on the CPU in bf16).
"""

from typing import Callable, List, Optional

import torch
from torch import nn
from torchtune.models.llama3_2 import lora_llama3_2_1b, lora_llama3_2_3b
from torchtune.models.qwen2_5 import (
    lora_qwen2_5_0_5b,
    lora_qwen2_5_1_5b_base,
    lora_qwen2_5_1_5b_instruct,
)
from torchtune.modules import TransformerDecoder
from torchtune.modules.peft import LORA_ATTN_MODULES

from squash._checks import INITS, SPARSE_FACTORS, check_choice, check_sparsity
from squash.modules import flatten_tied_output, swap_lora_linear, use_squash_nf4_


def squash_model(
    builder: Callable[..., nn.Module],
    *,
    sparsity: float = 0.9,
    sparse_factor: str = "a",
    init: str = "lora",
    generator: Optional[torch.Generator] = None,
    **lora_kwargs,
) -> nn.Module:
    """Build a torchtune LoRA model with ``builder(**lora_kwargs)`` and swap in sparse adapters.

    Args:
        builder (Callable[..., nn.Module]): a torchtune-style LoRA builder (``lora_llama3_2_1b``,
            ``lora_llama3_2``, ...).
        sparsity (float): fraction of zeros of each sparse factor. Default: 0.9
        sparse_factor (str): ``"a"``, ``"b"`` or ``"both"``. Default: ``"a"``
        init (str): ``"lora"`` or ``"svd"`` (factors each base as built). Default: ``"lora"``
        generator (Optional[torch.Generator]): CPU generator for FFI patterns and values.
        **lora_kwargs: the builder's arguments (``lora_attn_modules``, ``lora_rank``, ...).

    Returns:
        nn.Module: the model with ``SparseLoRALinear`` adapters.

    Raises:
        ValueError: naming a bad ``sparsity``, ``sparse_factor`` or ``init`` (checked before the
            model is built), or as ``swap_lora_linear``.
    """
    check_sparsity("sparsity", sparsity)
    check_choice("sparse_factor", sparse_factor, SPARSE_FACTORS)
    check_choice("init", init, INITS)
    model = flatten_tied_output(builder(**lora_kwargs))
    model = swap_lora_linear(
        model, sparsity=sparsity, sparse_factor=sparse_factor, init=init, generator=generator
    )
    return use_squash_nf4_(model)  # projections left without an adapter


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
    init: str = "lora",
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
        init (str): ``"lora"`` or ``"svd"``, see :func:`squash_model`. Default: ``"lora"``
        tie_word_embeddings (bool): tie output projection and embeddings. Default: True

    Returns:
        TransformerDecoder: the model.
    """
    return squash_model(lora_llama3_2_1b, **locals())


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
    init: str = "lora",
    tie_word_embeddings: bool = True,
) -> TransformerDecoder:
    """Llama 3.2 3B with FFI-sparse LoRA adapters on an NF4 base (see ``lora_llama3_2_3b``).

    Arguments as in :func:`squash_llama3_2_1b`.
    """
    return squash_model(lora_llama3_2_3b, **locals())


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
    init: str = "lora",
) -> TransformerDecoder:
    """Qwen 2.5 0.5B (base or instruct) with FFI-sparse LoRA adapters on an NF4 base.

    Arguments as in :func:`squash_llama3_2_1b` (no ``tie_word_embeddings``: always tied). The
    q/k/v projections keep their biases (dense, frozen).
    """
    return squash_model(lora_qwen2_5_0_5b, **locals())


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
    init: str = "lora",
) -> TransformerDecoder:
    """Qwen 2.5 1.5B base with FFI-sparse LoRA adapters on an NF4 base.

    Arguments as in :func:`squash_qwen2_5_0_5b`.
    """
    return squash_model(lora_qwen2_5_1_5b_base, **locals())


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
    init: str = "lora",
) -> TransformerDecoder:
    """Qwen 2.5 1.5B instruct with FFI-sparse LoRA adapters on an NF4 base.

    Arguments as in :func:`squash_qwen2_5_0_5b`.
    """
    return squash_model(lora_qwen2_5_1_5b_instruct, **locals())


# torchtune's 1.5B base and instruct builders differ only in max_seq_len (131072 vs 32768, the
# size of the RoPE cache); the weights load into either. The short name is the instruct one.
squash_qwen2_5_1_5b = squash_qwen2_5_1_5b_instruct
