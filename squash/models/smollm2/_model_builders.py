"""SmolLM2-135M(-Instruct) on torchtune's own Llama 3.2 component builders.

SmolLM2 is a Llama: hidden 576, 30 layers, 9 query heads and 3 key/value heads of 64, SwiGLU MLP
of 1536, vocabulary 49152, RMSNorm eps 1e-5, RoPE base 100000 without Llama 3's frequency scaling
(``scale_factor=1`` makes torchtune's ``Llama3ScaledRoPE`` plain RoPE), and the output projection
tied to the token embeddings (torchtune's ``TiedLinear``, computed as one 2-D matmul by
:class:`~squash.modules.FlatTiedLinear`). torchtune's ``llama3_2`` and
``lora_llama3_2`` component builders take exactly these sizes, so the models here are those
builders with SmolLM2's numbers, not a copy of them.

QLoRA: torchtune's ``quantize_base=True`` quantizes with torchao's default NF4 block sizes, which
refuse the 576x576 and 192x576 projections; the adapted models here are built in one pass by
:func:`squash.models.squash_llama3_2` (torchtune's ``lora_llama3_2`` with each projection
constructed as what it stays: NF4 bases with block sizes chosen for their shape,
``SparseLoRALinear`` or torchtune's ``LoRALinear`` adapters).
"""

from functools import partial
from typing import List, Mapping, Optional

from torchtune.models.llama3_2._component_builders import llama3_2
from torchtune.modules import TransformerDecoder
from torchtune.modules.peft import LORA_ATTN_MODULES

from squash.models._squash_builders import squash_llama3_2
from squash.modules import flatten_tied_output

# SmolLM2-135M's sizes, as in its config.json (and the GGUF's metadata).
SMOLLM2_135M = dict(
    vocab_size=49_152,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    embed_dim=576,
    max_seq_len=8192,
    intermediate_dim=1536,
    rope_base=100_000,
    norm_eps=1e-5,
    scale_factor=1,  # plain RoPE: SmolLM2 has no Llama 3 frequency scaling
    tie_word_embeddings=True,
)

# Every linear SmolLM2's decoder layers have: what `lora_attn_modules=ALL_ATTN_MODULES` plus
# `apply_lora_to_mlp=True` adapt (q, k, v, output; w1, w2, w3).
ALL_ATTN_MODULES = ["q_proj", "k_proj", "v_proj", "output_proj"]


def smollm2_135m() -> TransformerDecoder:
    """SmolLM2-135M (base or instruct: same architecture) as torchtune's ``llama3_2`` decoder.

    Returns:
        TransformerDecoder: the model, tied embeddings, ``max_seq_len`` 8192.
    """
    return flatten_tied_output(llama3_2(**SMOLLM2_135M))


def lora_smollm2_135m(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    quantize_base: bool = False,
    base_outliers: Optional[Mapping] = None,
) -> TransformerDecoder:
    """SmolLM2-135M with torchtune's LoRA adapters (``lora_llama3_2``).

    Args:
        lora_attn_modules (List[LORA_ATTN_MODULES]): attention projections to adapt, from
            ``{"q_proj", "k_proj", "v_proj", "output_proj"}``.
        apply_lora_to_mlp (bool): adapt the MLP's ``w1``, ``w2``, ``w3`` too. Default: False
        apply_lora_to_output (bool): unsupported: the output projection is tied to the
            embeddings (torchtune raises).
        lora_rank (int): adapter rank. Default: 8
        lora_alpha (float): scaling numerator, ``scaling = alpha / rank``. Default: 16
        lora_dropout (float): adapter input dropout. Default: 0.0
        quantize_base (bool): NF4 base weights (QLoRA), block sizes chosen per weight.
            Default: False
        base_outliers (Optional[Mapping]): with ``quantize_base``, a corrected NF4 base
            (config ``model.base_outliers``, see :mod:`squash.nf4.base_outliers`). Default: None

    Returns:
        TransformerDecoder: the model.
    """
    return squash_llama3_2(
        lora_attn_modules=lora_attn_modules,
        apply_lora_to_mlp=apply_lora_to_mlp,
        apply_lora_to_output=apply_lora_to_output,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        quantize_base=quantize_base,
        base_outliers=base_outliers,
        sparsity=None,  # torchtune's LoRALinear (NF4LoRALinear on an NF4 base)
        state_dict_dtype=None,  # the model's (torchtune's bf16 would round an fp32 run's merge)
        **SMOLLM2_135M,
    )


qlora_smollm2_135m = partial(lora_smollm2_135m, quantize_base=True)
qlora_smollm2_135m.__doc__ = """
SmolLM2-135M with QLoRA: :func:`lora_smollm2_135m` with ``quantize_base=True`` (NF4 bases, block
sizes chosen per weight: (64, 216) for the 576x576 and 192x576 projections, torchao's (64, 256)
for the MLP's).
"""


def squash_smollm2_135m(
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
) -> TransformerDecoder:
    """SmolLM2-135M with FFI-sparse LoRA adapters on an NF4 base (see :func:`lora_smollm2_135m`).

    Built in one pass by :func:`squash.models.squash_llama3_2`: each adapted projection a
    ``SparseLoRALinear`` on an NF4 base with block sizes chosen for its shape.

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
        init (str): ``"lora"`` or ``"svd"``, see :func:`squash.models.linear`.
            Default: ``"lora"``
        base_outliers (Optional[Mapping]): a corrected NF4 base (see
            :func:`lora_smollm2_135m`). Default: None

    Returns:
        TransformerDecoder: the model.
    """
    return squash_llama3_2(**locals(), state_dict_dtype=None, **SMOLLM2_135M)
