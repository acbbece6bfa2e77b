"""squash builders for torchtune's own model families, each model built once in its final shape.

As torchtune's component builders choose ``adapter_cls`` (``DoRALinear if use_dora else
LoRALinear``), :func:`linear` chooses what each projection is when it is constructed: a
:class:`~squash.modules.SparseLoRALinear` (adapted, with a ``sparsity``), torchtune's
``LoRALinear`` (adapted, ``sparsity=None``; with an NF4 base squash's
:class:`~squash.nf4.NF4LoRALinear`), a frozen :class:`~squash.nf4.NF4Linear`, or an
``nn.Linear``; NF4 bases use block sizes chosen per weight (:func:`~squash.nf4.nf4_block_sizes`,
torchao's defaults where they divide it). :func:`squash_llama3_2` (Llama 3.2 and SmolLM2) and
:func:`squash_qwen2` (Qwen 2.5) are torchtune's ``lora_llama3_2`` and ``lora_qwen2`` with that
choice: the same modules, state-dict keys and hooks, built in one pass (no model surgery, no
``__class__`` swaps, each adapter drawn once). ``quantize_base=True`` by default, as in
torchtune's ``qlora_*`` builders. ``init="svd"`` factors each base the model holds when built;
the recipes (:func:`squash.assembly.model_setup.assemble_adapter_model`) factor the checkpoint's
weights instead.

The named builders are plain functions with explicit signatures and literal sizes.

Llama 3.2 1B/3B and Qwen 2.5 0.5B/1.5B tie the output projection to the token embeddings, so
``apply_lora_to_output=True`` raises for them, as torchtune does. A tied output is computed as one
2-D matmul (:class:`~squash.modules.FlatTiedLinear`: the same values, without the per-chunk
weight copies that torchtune's chunked output costs on the CPU in bf16).
"""

from functools import partial
from typing import Callable, List, Mapping, Optional

import torch
from torch import nn
from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE
from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
from torchtune.modules import (
    FeedForward,
    MultiHeadAttention,
    RMSNorm,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)
from torchtune.modules.common_utils import reparametrize_as_dtype_state_dict_post_hook
from torchtune.modules.peft import LORA_ATTN_MODULES, LoRALinear

from squash._checks import INITS, SPARSE_FACTORS, check_choice, check_sparsity
from squash.nf4.base_outliers import check_base_outliers, outliers_state_dict_post_hook
from squash.modules import FlatTiedLinear, flatten_tied_output, sparse_lora_linear, swap_lora_linear
from squash.nf4 import (
    NF4Linear,
    NF4LoRALinear,
    nf4_block_sizes,
    use_squash_nf4_,
)


def linear(
    in_dim: int,
    out_dim: int,
    *,
    adapt: bool,
    use_bias: bool = False,
    quantize_base: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    sparsity: Optional[float] = 0.9,
    sparse_factor: str = "a",
    init: str = "lora",
    base_outliers: Optional[Mapping] = None,
    name: str = "linear",
) -> nn.Module:
    """One projection of a decoder layer, constructed as what it stays.

    Args:
        in_dim (int): input width.
        out_dim (int): output width.
        adapt (bool): give it a LoRA adapter.
        use_bias (bool): a (frozen) base bias. Default: False
        quantize_base (bool): an NF4 base (block sizes chosen for its shape). Default: False
        lora_rank (int): adapter rank. Default: 8
        lora_alpha (float): scaling numerator. Default: 16
        lora_dropout (float): adapter input dropout. Default: 0.0
        sparsity (Optional[float]): FFI sparsity of the adapter's sparse factor(s); None for
            torchtune's dense ``LoRALinear``. Default: 0.9
        sparse_factor (str): ``"a"``, ``"b"`` or ``"both"``. Default: ``"a"``
        init (str): ``"lora"`` or ``"svd"`` (sparse adapters only). Default: ``"lora"``
        base_outliers (Optional[Mapping]): with ``quantize_base``, a corrected NF4 base
            (:mod:`squash.nf4.base_outliers`). Default: None (plain NF4)
        name (str): what the projection is, for error messages.

    Returns:
        nn.Module: ``SparseLoRALinear``, ``LoRALinear``/``NF4LoRALinear``, ``NF4Linear`` or
        ``nn.Linear``.

    Raises:
        ValueError: an NF4 base no block size divides, or a frozen NF4 base with a bias.
    """
    sizes, outliers = {}, {}
    if quantize_base:
        block, scaler = nf4_block_sizes(name, (out_dim, in_dim))
        sizes = dict(block_size=block, scaler_block_size=scaler)
        outliers = dict(base_outliers=base_outliers)
    elif base_outliers is not None:
        raise ValueError(f"{name}: base_outliers needs quantize_base=True")
    if adapt and sparsity is not None:
        return sparse_lora_linear(
            in_dim, out_dim, lora_rank, lora_alpha, sparsity=sparsity,
            sparse_factor=sparse_factor, dropout=lora_dropout, use_bias=use_bias,
            quantize_base=quantize_base, init=init, **outliers, **sizes,
        )  # fmt: skip
    if adapt:
        lora_cls = NF4LoRALinear if quantize_base else LoRALinear
        return lora_cls(
            in_dim, out_dim, rank=lora_rank, alpha=lora_alpha, dropout=lora_dropout,
            use_bias=use_bias, quantize_base=quantize_base, **outliers, **sizes,
        )  # fmt: skip
    if quantize_base:
        if use_bias:
            raise ValueError(f"{name}: a frozen NF4 linear takes no bias")
        return NF4Linear(in_dim, out_dim, bias=False, **outliers, **sizes)
    return nn.Linear(in_dim, out_dim, bias=use_bias)


def _check_adapter_args(sparsity, sparse_factor, init, base_outliers=None,
                        quantize_base=True) -> None:  # fmt: skip
    check_sparsity("sparsity", sparsity, allow_none=True)
    check_choice("sparse_factor", sparse_factor, SPARSE_FACTORS)
    check_choice("init", init, INITS)
    if sparsity is None and init != "lora":
        raise ValueError(f"init={init!r} needs sparse adapters: give a sparsity")
    check_base_outliers(base_outliers, quantize_base)


def _outliers_state_dict_hook(model: nn.Module, base_outliers) -> None:
    """With ``base_outliers``, state dicts hold each corrected base as ``dequant(NF4) + S``
    (registered after the QLoRA hook, which dequantizes)."""
    if base_outliers is not None:
        model._register_state_dict_hook(outliers_state_dict_post_hook)


def _qlora_state_dict_hook(model: nn.Module, dtype: Optional[torch.dtype]) -> None:
    """As torchtune's QLoRA builders: state dicts hold the NF4 bases dequantized (in ``dtype``;
    None: the model's, from its embeddings), offloaded to the CPU on the fly."""
    kwargs = {"dtype": dtype} if dtype is not None else {"dtype": model.tok_embeddings.weight.dtype}
    model._register_state_dict_hook(
        partial(reparametrize_as_dtype_state_dict_post_hook, offload_to_cpu=True, **kwargs)
    )


def squash_llama3_2(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    max_seq_len: int,
    intermediate_dim: int,
    attn_dropout: float = 0.0,
    norm_eps: float = 1e-5,
    rope_base: int = 500_000,
    scale_factor: int = 32,
    tie_word_embeddings: bool = True,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    quantize_base: bool = True,
    sparsity: Optional[float] = 0.9,
    sparse_factor: str = "a",
    init: str = "lora",
    state_dict_dtype: Optional[torch.dtype] = torch.bfloat16,
    base_outliers: Optional[Mapping] = None,
) -> TransformerDecoder:
    """torchtune's ``lora_llama3_2`` (Llama 3.2, SmolLM2) with each projection built by
    :func:`linear`: sparse adapters (or torchtune's ``LoRALinear`` with ``sparsity=None``) on NF4
    bases whose block sizes fit each shape, the frozen projections NF4 too, one RoPE shared by
    the layers, and a tied output computed by :class:`~squash.modules.FlatTiedLinear`.

    Args: as torchtune's ``lora_llama3_2`` (sizes, ``lora_*``, ``quantize_base``), plus
        ``sparsity``, ``sparse_factor`` and ``init`` (see :func:`linear`) and
        ``state_dict_dtype``, the dtype a QLoRA state dict holds the bases in (torchtune's
        bf16 default; None for the model's dtype), and ``base_outliers`` (a corrected NF4
        base for every projection, see :func:`linear`).

    Returns:
        TransformerDecoder: the model.

    Raises:
        ValueError: ``apply_lora_to_output`` (the output is tied or left dense, as in
            torchtune), bad sparsity arguments, or an NF4 shape no block size divides.
    """
    _check_adapter_args(sparsity, sparse_factor, init, base_outliers, quantize_base)
    if apply_lora_to_output:
        raise ValueError(
            "apply_lora_to_output is currently not supporting in llama3.2 1b and 3b,"
            "as the projection layer weights are tied to the embeddings"
        )
    head_dim = embed_dim // num_heads
    lin = partial(
        linear, quantize_base=quantize_base, lora_rank=lora_rank, lora_alpha=lora_alpha,
        lora_dropout=lora_dropout, sparsity=sparsity, sparse_factor=sparse_factor, init=init,
        base_outliers=base_outliers,
    )  # fmt: skip
    rope = Llama3ScaledRoPE(
        dim=head_dim, max_seq_len=max_seq_len, base=rope_base, scale_factor=scale_factor
    )
    attn_shapes = {
        "q_proj": (embed_dim, num_heads * head_dim),
        "k_proj": (embed_dim, num_kv_heads * head_dim),
        "v_proj": (embed_dim, num_kv_heads * head_dim),
        "output_proj": (embed_dim, embed_dim),
    }
    layers = nn.ModuleList()
    for _ in range(num_layers):
        proj = {
            n: lin(i, o, adapt=n in lora_attn_modules, name=f"layers.*.attn.{n}")
            for n, (i, o) in attn_shapes.items()
        }
        attn = MultiHeadAttention(
            embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, **proj, pos_embeddings=rope, max_seq_len=max_seq_len,
            attn_dropout=attn_dropout,
        )  # fmt: skip
        mlp = FeedForward(
            gate_proj=lin(embed_dim, intermediate_dim, adapt=apply_lora_to_mlp, name="layers.*.mlp.w1"),
            down_proj=lin(intermediate_dim, embed_dim, adapt=apply_lora_to_mlp, name="layers.*.mlp.w2"),
            up_proj=lin(embed_dim, intermediate_dim, adapt=apply_lora_to_mlp, name="layers.*.mlp.w3"),
        )  # fmt: skip
        layers.append(
            TransformerSelfAttentionLayer(
                attn=attn, mlp=mlp, sa_norm=RMSNorm(dim=embed_dim, eps=norm_eps),
                mlp_norm=RMSNorm(dim=embed_dim, eps=norm_eps),
            )  # fmt: skip
        )
    tok_embeddings = nn.Embedding(vocab_size, embed_dim)
    if tie_word_embeddings:
        output = FlatTiedLinear(tok_embeddings)
    else:
        output = nn.Linear(embed_dim, vocab_size, bias=False)
    model = TransformerDecoder(
        tok_embeddings=tok_embeddings, layers=layers, max_seq_len=max_seq_len,
        num_heads=num_heads, head_dim=head_dim, norm=RMSNorm(embed_dim, eps=norm_eps),
        output=output,
    )  # fmt: skip
    if quantize_base:
        _qlora_state_dict_hook(model, state_dict_dtype)
        _outliers_state_dict_hook(model, base_outliers)
    return model


def squash_qwen2(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    attn_dropout: float = 0.0,
    norm_eps: float = 1e-5,
    rope_base: float = 1_000_000.0,
    tie_word_embeddings: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    quantize_base: bool = True,
    sparsity: Optional[float] = 0.9,
    sparse_factor: str = "a",
    init: str = "lora",
    base_outliers: Optional[Mapping] = None,
) -> TransformerDecoder:
    """torchtune's ``lora_qwen2`` (Qwen 2.5) with each adapted projection built by
    :func:`linear`: q/k/v with a dense frozen bias, a RoPE per layer, the projections left
    without an adapter dense (as torchtune's), the QLoRA state dict in the model's dtype.

    Args: as torchtune's ``lora_qwen2``, plus ``sparsity``, ``sparse_factor``, ``init`` and
        ``base_outliers`` (for the quantized, adapted projections).

    Returns:
        TransformerDecoder: the model.

    Raises:
        ValueError: ``apply_lora_to_output`` with tied embeddings, bad sparsity arguments.
    """
    _check_adapter_args(sparsity, sparse_factor, init, base_outliers, quantize_base)
    head_dim = embed_dim // num_heads
    lora = dict(
        lora_rank=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
        sparsity=sparsity, sparse_factor=sparse_factor, init=init,
    )  # fmt: skip

    def lin(i, o, adapt, name, use_bias=False):
        # torchtune's Qwen 2 quantizes adapted bases only
        nf4 = quantize_base and adapt
        return linear(i, o, adapt=adapt, use_bias=use_bias, quantize_base=nf4, name=name,
                      base_outliers=base_outliers if nf4 else None, **lora)  # fmt: skip

    layers = nn.ModuleList()
    for _ in range(num_layers):
        attn = MultiHeadAttention(
            embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            q_proj=lin(embed_dim, num_heads * head_dim, "q_proj" in lora_attn_modules,
                       "layers.*.attn.q_proj", use_bias=True),
            k_proj=lin(embed_dim, num_kv_heads * head_dim, "k_proj" in lora_attn_modules,
                       "layers.*.attn.k_proj", use_bias=True),
            v_proj=lin(embed_dim, num_kv_heads * head_dim, "v_proj" in lora_attn_modules,
                       "layers.*.attn.v_proj", use_bias=True),
            output_proj=lin(embed_dim, embed_dim, "output_proj" in lora_attn_modules,
                            "layers.*.attn.output_proj"),
            pos_embeddings=Qwen2RotaryPositionalEmbeddings(
                dim=head_dim, max_seq_len=max_seq_len, base=rope_base
            ),
            kv_cache=None, max_seq_len=max_seq_len, attn_dropout=attn_dropout,
        )  # fmt: skip
        mlp = FeedForward(
            gate_proj=lin(embed_dim, intermediate_dim, apply_lora_to_mlp, "layers.*.mlp.w1"),
            down_proj=lin(intermediate_dim, embed_dim, apply_lora_to_mlp, "layers.*.mlp.w2"),
            up_proj=lin(embed_dim, intermediate_dim, apply_lora_to_mlp, "layers.*.mlp.w3"),
        )
        layers.append(
            TransformerSelfAttentionLayer(
                attn=attn, mlp=mlp, sa_norm=RMSNorm(dim=embed_dim, eps=norm_eps),
                mlp_norm=RMSNorm(dim=embed_dim, eps=norm_eps),
            )  # fmt: skip
        )
    tok_embeddings = nn.Embedding(vocab_size, embed_dim)
    if tie_word_embeddings:
        if apply_lora_to_output:
            raise ValueError(
                "apply_lora_to_output is incompatible with tie_word_embeddings,"
                " as there would be no output to apply lora to!"
            )
        output = FlatTiedLinear(tok_embeddings)
    else:
        # torchtune's Qwen 2 output adapter has a dense base
        output = linear(embed_dim, vocab_size, adapt=apply_lora_to_output, name="output", **lora)
    model = TransformerDecoder(
        tok_embeddings=tok_embeddings, layers=layers, max_seq_len=max_seq_len,
        num_heads=num_heads, head_dim=head_dim, norm=RMSNorm(embed_dim, eps=norm_eps),
        output=output,
    )  # fmt: skip
    if quantize_base:
        _qlora_state_dict_hook(model, None)
        _outliers_state_dict_hook(model, base_outliers)
    return model


def squash_model(
    builder: Callable[..., nn.Module],
    *,
    sparsity: float = 0.9,
    sparse_factor: str = "a",
    init: str = "lora",
    generator: Optional[torch.Generator] = None,
    **lora_kwargs,
) -> nn.Module:
    """Sparse adapters for any torchtune-style LoRA builder: build ``builder(**lora_kwargs)`` and
    swap each ``LoRALinear`` for a ``SparseLoRALinear`` (:func:`~squash.modules.swap_lora_linear`).

    For a family squash has no one-pass builder for; squash's own builders
    (:func:`squash_llama3_2`, :func:`squash_qwen2`) do not use it.

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


LLAMA3_2_1B = dict(
    vocab_size=128_256, num_layers=16, num_heads=32, num_kv_heads=8, embed_dim=2048,
    max_seq_len=131072, intermediate_dim=8192, attn_dropout=0.0, norm_eps=1e-5,
    rope_base=500_000, scale_factor=32,
)  # fmt: skip
LLAMA3_2_3B = {**LLAMA3_2_1B, "num_layers": 28, "num_heads": 24, "embed_dim": 3072}
QWEN2_5_0_5B = dict(
    vocab_size=151936, num_layers=24, num_heads=14, num_kv_heads=2, embed_dim=896,
    intermediate_dim=4864, max_seq_len=32768, attn_dropout=0.0, norm_eps=1e-6,
    rope_base=1000000.0, tie_word_embeddings=True,
)  # fmt: skip
QWEN2_5_1_5B_INSTRUCT = {
    **QWEN2_5_0_5B, "num_layers": 28, "num_heads": 12, "embed_dim": 1536,
    "intermediate_dim": 8960,
}  # fmt: skip
QWEN2_5_1_5B_BASE = {**QWEN2_5_1_5B_INSTRUCT, "max_seq_len": 131072}


LLAMA3_2_SIZES = {"1b": LLAMA3_2_1B, "3b": LLAMA3_2_3B}
QWEN2_5_SIZES = {"0_5b": QWEN2_5_0_5B, "1_5b_base": QWEN2_5_1_5B_BASE,
                 "1_5b_instruct": QWEN2_5_1_5B_INSTRUCT}  # fmt: skip


def squash_llama3_2_sized(
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
    tie_word_embeddings: bool = True,
    base_outliers: Optional[Mapping] = None,
) -> TransformerDecoder:
    """Llama 3.2 of ``size`` (``"1b"`` or ``"3b"``) with FFI-sparse LoRA adapters on an NF4
    base (see torchtune's ``lora_llama3_2_1b``); ``squash_llama3_2_1b`` and ``_3b`` are this
    function with the size bound.

    Args:
        size (str): a key of :data:`LLAMA3_2_SIZES`.
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
        init (str): ``"lora"`` or ``"svd"``, see :func:`linear`. Default: ``"lora"``
        tie_word_embeddings (bool): tie output projection and embeddings. Default: True
        base_outliers (Optional[Mapping]): a corrected NF4 base ``{fraction, criterion}``
            (config ``model.base_outliers``, see :mod:`squash.nf4.base_outliers`). Default: None

    Returns:
        TransformerDecoder: the model.
    """
    args = dict(locals())
    return squash_llama3_2(**LLAMA3_2_SIZES[args.pop("size")], **args)


def squash_qwen2_5_sized(
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
) -> TransformerDecoder:
    """Qwen 2.5 of ``size`` (a key of :data:`QWEN2_5_SIZES`) with FFI-sparse LoRA adapters on
    an NF4 base; the other arguments as in :func:`squash_llama3_2_sized` (no
    ``tie_word_embeddings``: always tied). The q/k/v projections keep their biases (dense,
    frozen)."""
    args = dict(locals())
    return squash_qwen2(**QWEN2_5_SIZES[args.pop("size")], **args)


def _sized(builder, size: str, doc: str) -> partial:
    """``builder`` with its first argument, the size, bound, and its own docstring (a sized
    builder: ``squash_llama3_2_1b``, ``lora_opt_350m``, ...)."""
    sized = partial(builder, size)
    sized.__doc__ = doc
    return sized


squash_llama3_2_1b = _sized(squash_llama3_2_sized, "1b", """Llama 3.2 1B with FFI-sparse LoRA
adapters on an NF4 base; arguments as in :func:`squash_llama3_2_sized`.""")
squash_llama3_2_3b = _sized(squash_llama3_2_sized, "3b", """Llama 3.2 3B with FFI-sparse LoRA
adapters on an NF4 base; arguments as in :func:`squash_llama3_2_sized`.""")
squash_qwen2_5_0_5b = _sized(squash_qwen2_5_sized, "0_5b", """Qwen 2.5 0.5B (base or instruct)
with FFI-sparse LoRA adapters on an NF4 base; arguments as in :func:`squash_qwen2_5_sized`.""")
squash_qwen2_5_1_5b_base = _sized(squash_qwen2_5_sized, "1_5b_base", """Qwen 2.5 1.5B base with
FFI-sparse LoRA adapters on an NF4 base; arguments as in :func:`squash_qwen2_5_sized`.""")
squash_qwen2_5_1_5b_instruct = _sized(squash_qwen2_5_sized, "1_5b_instruct", """Qwen 2.5 1.5B
instruct with FFI-sparse LoRA adapters on an NF4 base; arguments as in
:func:`squash_qwen2_5_sized`.""")

# torchtune's 1.5B base and instruct builders differ only in max_seq_len (131072 vs 32768, the
# size of the RoPE cache); the weights load into either. The short name is the instruct one.
squash_qwen2_5_1_5b = squash_qwen2_5_1_5b_instruct
