"""Component builders for OPT and its LoRA/QLoRA variants.

As in torchtune, the building blocks (:class:`~torchtune.modules.MultiHeadAttention`,
:class:`~torchtune.modules.FeedForward`, :class:`~torchtune.modules.TransformerSelfAttentionLayer`)
receive their linear layers; these builders decide whether each one is an ``nn.Linear`` or an
adapter, and which adapter class: :class:`~torchtune.modules.peft.LoRALinear` (with an NF4
base, ``quantize_base``, squash's :class:`~squash.modules.NF4LoRALinear`: the same module computed
with squash's NF4 kernel), or squash's :class:`~squash.modules.SparseLoRALinear` when a
``sparsity`` is given (as torchtune picks ``DoRALinear`` or ``LoRALinear``). A model is built
once, in its final shape.

Weights are initialised as transformers initialises OPT (``OPTPreTrainedModel._init_weights``):
every linear weight and embedding from ``N(0, init_std)`` (``init_std`` is 0.02 in every OPT
config), every bias zero, LayerNorms at weight 1 and bias 0; so a model built without a
checkpoint starts near the uniform loss ``log(vocab_size)``. Adapter factors keep LoRA's init.

Module names, for the key table in ``_convert_weights.py`` (``N`` = layer index)::

    tok_embeddings            nn.Embedding(vocab_size, word_embed_proj_dim)
    pos_embeddings            OPTLearnedPositionalEmbedding(max_seq_len, embed_dim)
    project_in, project_out   nn.Linear without bias, only if word_embed_proj_dim != embed_dim
    layers.N.attn.{q,k,v,output}_proj   linear with bias
    layers.N.sa_norm          LayerNorm of the attention block (before it, or after for post-norm)
    layers.N.mlp.w1, mlp.w2   fc1 -> ReLU -> fc2, with bias
    layers.N.mlp_norm         LayerNorm of the MLP block
    norm                      final LayerNorm (pre-norm models only)
    output                    FlatTiedLinear(tok_embeddings) (torchtune's TiedLinear, 2-D)
"""

from functools import partial
from typing import List, Mapping, Optional

import torch
from torch import nn
from torchtune.modules import FeedForward, MultiHeadAttention
from torchtune.modules import TransformerSelfAttentionLayer
from torchtune.modules.common_utils import reparametrize_as_dtype_state_dict_post_hook
from torchtune.modules.peft import LORA_ATTN_MODULES, LoRALinear

from squash._checks import (
    INITS,
    SPARSE_FACTORS,
    check_choice,
    check_int,
    check_real,
    check_sparsity,
)
from squash.models.opt._decoder import (
    OPTDecoder,
    OPTLearnedPositionalEmbedding,
    OPTPostNormLayer,
)
from squash.modules import FlatTiedLinear, NF4LoRALinear, get_adapter_modules, sparse_lora_linear
from squash.nf4 import check_nf4_shape
from squash.nf4.base_outliers import check_base_outliers, outliers_state_dict_post_hook


def opt(
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    word_embed_proj_dim: Optional[int] = None,
    pre_norm: bool = True,
    attn_dropout: float = 0.0,
    norm_eps: float = 1e-5,
    init_std: float = 0.02,
) -> OPTDecoder:
    """Build an OPT decoder.

    Args:
        vocab_size (int): number of tokens in the vocabulary.
        num_layers (int): number of decoder layers.
        num_heads (int): number of attention heads.
        embed_dim (int): hidden size (HF ``hidden_size``).
        intermediate_dim (int): MLP hidden size (HF ``ffn_dim``).
        max_seq_len (int): number of learned positions (HF ``max_position_embeddings``).
        word_embed_proj_dim (Optional[int]): token-embedding width; when it differs from
            ``embed_dim``, ``project_in``/``project_out`` map between them. Default None
            (= ``embed_dim``).
        pre_norm (bool): True for pre-LayerNorm layers and a final LayerNorm (HF
            ``do_layer_norm_before=True``, e.g. OPT-125m); False for post-LayerNorm layers and
            no final LayerNorm (OPT-350m). Default True.
        attn_dropout (float): attention dropout probability. Default 0.0.
        norm_eps (float): LayerNorm epsilon. Default 1e-5.
        init_std (float): standard deviation of the normal init of linear weights and
            embeddings (HF ``init_std``). Default 0.02.

    Returns:
        OPTDecoder: the model, output projection tied to the token embedding.

    Raises:
        ValueError: naming a size that is not a positive integer or a bad dropout, epsilon or
            ``init_std``, or if ``embed_dim`` is not divisible by ``num_heads``.
    """
    _check_sizes(locals())
    layers = nn.ModuleList(
        [
            _opt_layer(
                attn=opt_self_attention(
                    embed_dim=embed_dim,
                    num_heads=num_heads,
                    max_seq_len=max_seq_len,
                    attn_dropout=attn_dropout,
                ),
                mlp=opt_mlp(dim=embed_dim, hidden_dim=intermediate_dim),
                embed_dim=embed_dim,
                pre_norm=pre_norm,
                norm_eps=norm_eps,
            )
            for _ in range(num_layers)
        ]
    )
    return _opt_decoder(
        layers,
        vocab_size=vocab_size,
        num_heads=num_heads,
        embed_dim=embed_dim,
        max_seq_len=max_seq_len,
        word_embed_proj_dim=word_embed_proj_dim,
        pre_norm=pre_norm,
        norm_eps=norm_eps,
        init_std=init_std,
    )


def opt_self_attention(
    *,
    embed_dim: int,
    num_heads: int,
    max_seq_len: int,
    attn_dropout: float = 0.0,
    q_proj: Optional[nn.Module] = None,
    k_proj: Optional[nn.Module] = None,
    v_proj: Optional[nn.Module] = None,
    output_proj: Optional[nn.Module] = None,
) -> MultiHeadAttention:
    """OPT self-attention: multi-head, biases on all four projections, no rotary embedding.

    Args:
        embed_dim (int): hidden size.
        num_heads (int): number of heads (OPT has no grouped-query attention).
        max_seq_len (int): maximum sequence length.
        attn_dropout (float): attention dropout probability. Default 0.0.
        q_proj (Optional[nn.Module]): query projection; default ``nn.Linear`` with bias.
        k_proj (Optional[nn.Module]): key projection; default ``nn.Linear`` with bias.
        v_proj (Optional[nn.Module]): value projection; default ``nn.Linear`` with bias.
        output_proj (Optional[nn.Module]): output projection; default ``nn.Linear`` with bias.

    Returns:
        MultiHeadAttention: the attention module.

    Raises:
        ValueError: if ``embed_dim`` is not divisible by ``num_heads``.
    """
    if embed_dim % num_heads != 0:
        raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")

    def linear():
        return nn.Linear(embed_dim, embed_dim, bias=True)

    return MultiHeadAttention(
        embed_dim=embed_dim,
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=embed_dim // num_heads,
        q_proj=q_proj if q_proj is not None else linear(),
        k_proj=k_proj if k_proj is not None else linear(),
        v_proj=v_proj if v_proj is not None else linear(),
        output_proj=output_proj if output_proj is not None else linear(),
        pos_embeddings=None,
        max_seq_len=max_seq_len,
        attn_dropout=attn_dropout,
    )


def opt_mlp(
    *,
    dim: int,
    hidden_dim: int,
    fc1: Optional[nn.Module] = None,
    fc2: Optional[nn.Module] = None,
) -> FeedForward:
    """OPT MLP: ``fc2(relu(fc1(x)))`` as a :class:`~torchtune.modules.FeedForward` (fc1 = ``w1``,
    fc2 = ``w2``, no ``w3``).

    Args:
        dim (int): input and output width.
        hidden_dim (int): hidden width.
        fc1 (Optional[nn.Module]): ``dim -> hidden_dim``; default ``nn.Linear`` with bias.
        fc2 (Optional[nn.Module]): ``hidden_dim -> dim``; default ``nn.Linear`` with bias.

    Returns:
        FeedForward: the MLP.
    """
    return FeedForward(
        gate_proj=fc1 if fc1 is not None else nn.Linear(dim, hidden_dim, bias=True),
        down_proj=fc2 if fc2 is not None else nn.Linear(hidden_dim, dim, bias=True),
        activation=nn.ReLU(),
    )


def lora_opt(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    word_embed_proj_dim: Optional[int] = None,
    pre_norm: bool = True,
    attn_dropout: float = 0.0,
    norm_eps: float = 1e-5,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
    sparsity: Optional[float] = None,
    sparse_factor: str = "a",
    init: str = "lora",
    init_std: float = 0.02,
    base_outliers: Optional[Mapping] = None,
) -> OPTDecoder:
    """Build an OPT decoder with LoRA adapters on a subset of its linear layers.

    The adapter class is chosen here: torchtune's :class:`~torchtune.modules.peft.LoRALinear`
    when ``sparsity`` is None, else squash's :class:`~squash.modules.SparseLoRALinear` with
    ``sparsity``, ``sparse_factor`` and ``init``. The base weights keep the names and shapes of
    :func:`opt`'s, so a base state dict loads into this model with ``strict=False`` and only
    adapter keys missing.

    Args:
        lora_attn_modules (List[LORA_ATTN_MODULES]): which attention projections get adapters,
            a non-empty subset of ``["q_proj", "k_proj", "v_proj", "output_proj"]``.
        apply_lora_to_mlp (bool): also adapt fc1 and fc2 (``mlp.w1``, ``mlp.w2``). Default False.
        apply_lora_to_output (bool): must be False: OPT's output projection is tied to the token
            embedding, so there is no separate layer to adapt. Default False.
        vocab_size (int): as for :func:`opt`.
        num_layers (int): as for :func:`opt`.
        num_heads (int): as for :func:`opt`.
        embed_dim (int): as for :func:`opt`.
        intermediate_dim (int): as for :func:`opt`.
        max_seq_len (int): as for :func:`opt`.
        word_embed_proj_dim (Optional[int]): as for :func:`opt`. Default None.
        pre_norm (bool): as for :func:`opt`. Default True.
        attn_dropout (float): as for :func:`opt`. Default 0.0.
        norm_eps (float): as for :func:`opt`. Default 1e-5.
        lora_rank (int): rank of each adapter.
        lora_alpha (float): adapter scaling factor (the update is scaled by ``alpha / rank``).
        lora_dropout (float): dropout on the adapter input. Default 0.0.
        use_dora (bool): must be False. torchtune 0.6.1's
            :class:`~torchtune.modules.peft.DoRALinear` rescales the base layer's bias along with
            its weight, unlike DoRA as published and as PEFT implements it, and its merged
            checkpoint keeps the bias unscaled; every OPT linear has a bias, so the trained,
            merged and PEFT-exported models would all differ. Default False.
        quantize_base (bool): store the adapted layers' base weights in NF4 (QLoRA); each such
            weight needs a number of elements divisible by 16384 (torchao's NF4 blocks).
            Default False.
        sparsity (Optional[float]): fraction of zeros of each FFI factor, in ``[0, 1)``; None
            for dense LoRA (``LoRALinear``). Default None.
        sparse_factor (str): with ``sparsity``: ``"a"``, ``"b"`` or ``"both"``. Default ``"a"``.
        init (str): with ``sparsity``: ``"lora"`` or ``"svd"``. ``"svd"`` factors each base
            weight the model holds when built (the from-scratch init); after loading a
            checkpoint, call :func:`~squash.modules.svd_initialize` with its unquantized
            weights to factor those instead. Default ``"lora"``.
        init_std (float): as for :func:`opt`. Default 0.02.
        base_outliers (Optional[Mapping]): with ``quantize_base``, a corrected NF4 base for
            each adapted layer (config ``model.base_outliers``, see
            :mod:`squash.nf4.base_outliers`). Default None.

    Returns:
        OPTDecoder: the model. With ``quantize_base``, its state dict holds the NF4 weights
        dequantized to the embedding's dtype, as torchtune's QLoRA models do.

    Raises:
        ValueError: if ``lora_attn_modules`` is empty or has unknown names, if
            ``apply_lora_to_output`` or ``use_dora`` is True, naming any other bad argument
            (``lora_rank``, ``lora_alpha``, ``lora_dropout``, ``sparsity``, ``sparse_factor``,
            ``init``, a size), or, with ``quantize_base``, naming an adapted layer whose size
            torchao's NF4 blocks do not divide.
    """
    known = ("q_proj", "k_proj", "v_proj", "output_proj")
    if not lora_attn_modules or any(m not in known for m in lora_attn_modules):
        raise ValueError(
            f"lora_attn_modules must be a non-empty subset of {list(known)}, "
            f"got {lora_attn_modules}"
        )
    if apply_lora_to_output:
        raise ValueError(
            "apply_lora_to_output is not supported for OPT: its output projection is tied to the "
            "token embedding, so there is no separate output layer to adapt"
        )
    if use_dora:
        raise ValueError(
            "use_dora is not supported for OPT: torchtune's DoRALinear rescales the bias of the "
            "base layer (every OPT linear has one), so training, the merged checkpoint and PEFT "
            "would disagree"
        )
    _check_sizes(locals())
    lora_rank = check_int("lora_rank", lora_rank)
    check_real("lora_alpha", lora_alpha)
    check_real("lora_dropout", lora_dropout, low=0.0, high=1.0, high_inclusive=False)
    check_sparsity("sparsity", sparsity, allow_none=True)
    check_choice("sparse_factor", sparse_factor, SPARSE_FACTORS)
    check_choice("init", init, INITS)
    if sparsity is None and init != "lora":
        raise ValueError(f"init={init!r} needs sparse adapters: give a sparsity")
    check_base_outliers(base_outliers, quantize_base)
    if quantize_base:  # name the layer before torchao fails on it with a bare assertion
        for name, shape in _adapted_shapes(
            lora_attn_modules, apply_lora_to_mlp, embed_dim, intermediate_dim
        ).items():
            check_nf4_shape(f"layers.*.{name} (quantize_base=True)", shape)

    def adapter(in_dim: int, out_dim: int) -> nn.Module:
        lora_args = dict(
            rank=lora_rank,
            alpha=lora_alpha,
            dropout=lora_dropout,
            use_bias=True,
            quantize_base=quantize_base,
        )
        if quantize_base:
            lora_args["base_outliers"] = base_outliers
        if sparsity is None:  # torchtune's LoRALinear draws its own base: give it OPT's init
            # (an NF4 base: NF4LoRALinear, LoRALinear computed with squash's NF4 kernel)
            lora_cls = NF4LoRALinear if quantize_base else LoRALinear
            return _init_base_(lora_cls(in_dim, out_dim, **lora_args), init_std)
        weight, bias = _opt_base(in_dim, out_dim, init_std)  # OPT's init, before any svd init
        return sparse_lora_linear(
            in_dim,
            out_dim,
            sparsity=sparsity,
            sparse_factor=sparse_factor,
            init=init,
            weight=weight,
            bias=bias,
            **lora_args,
        )

    def attn_proj(name: str) -> Optional[nn.Module]:
        return adapter(embed_dim, embed_dim) if name in lora_attn_modules else None

    layers = nn.ModuleList()
    for _ in range(num_layers):
        attn = opt_self_attention(
            embed_dim=embed_dim,
            num_heads=num_heads,
            max_seq_len=max_seq_len,
            attn_dropout=attn_dropout,
            q_proj=attn_proj("q_proj"),
            k_proj=attn_proj("k_proj"),
            v_proj=attn_proj("v_proj"),
            output_proj=attn_proj("output_proj"),
        )
        if apply_lora_to_mlp:
            mlp = opt_mlp(
                dim=embed_dim,
                hidden_dim=intermediate_dim,
                fc1=adapter(embed_dim, intermediate_dim),
                fc2=adapter(intermediate_dim, embed_dim),
            )
        else:
            mlp = opt_mlp(dim=embed_dim, hidden_dim=intermediate_dim)
        layers.append(
            _opt_layer(
                attn=attn, mlp=mlp, embed_dim=embed_dim, pre_norm=pre_norm, norm_eps=norm_eps
            )
        )

    model = _opt_decoder(
        layers,
        vocab_size=vocab_size,
        num_heads=num_heads,
        embed_dim=embed_dim,
        max_seq_len=max_seq_len,
        word_embed_proj_dim=word_embed_proj_dim,
        pre_norm=pre_norm,
        norm_eps=norm_eps,
        init_std=init_std,
    )
    if quantize_base:
        # As torchtune's QLoRA builders: state_dict() returns NF4 weights in the model's dtype
        # (offloaded to CPU), so checkpoints stay in a plain format.
        model._register_state_dict_hook(
            partial(
                reparametrize_as_dtype_state_dict_post_hook,
                dtype=model.tok_embeddings.weight.dtype,
                offload_to_cpu=True,
            )
        )
        if base_outliers is not None:  # after the hook above: the bases are dense there
            model._register_state_dict_hook(outliers_state_dict_post_hook)
    return model


def _opt_layer(
    *, attn: MultiHeadAttention, mlp: nn.Module, embed_dim: int, pre_norm: bool, norm_eps: float
) -> TransformerSelfAttentionLayer:
    layer_cls = TransformerSelfAttentionLayer if pre_norm else OPTPostNormLayer
    return layer_cls(
        attn=attn,
        mlp=mlp,
        sa_norm=nn.LayerNorm(embed_dim, eps=norm_eps),
        mlp_norm=nn.LayerNorm(embed_dim, eps=norm_eps),
    )


def _opt_decoder(
    layers: nn.ModuleList,
    *,
    vocab_size: int,
    num_heads: int,
    embed_dim: int,
    max_seq_len: int,
    word_embed_proj_dim: Optional[int],
    pre_norm: bool,
    norm_eps: float,
    init_std: float,
) -> OPTDecoder:
    word_dim = word_embed_proj_dim or embed_dim
    tok_embeddings = nn.Embedding(vocab_size, word_dim)
    projected = word_dim != embed_dim
    model = OPTDecoder(
        tok_embeddings=tok_embeddings,
        pos_embeddings=OPTLearnedPositionalEmbedding(max_seq_len, embed_dim),
        layers=layers,
        max_seq_len=max_seq_len,
        num_heads=num_heads,
        head_dim=embed_dim // num_heads,
        norm=nn.LayerNorm(embed_dim, eps=norm_eps) if pre_norm else None,
        output=FlatTiedLinear(tok_embeddings),
        project_in=nn.Linear(word_dim, embed_dim, bias=False) if projected else None,
        project_out=nn.Linear(embed_dim, word_dim, bias=False) if projected else None,
    )
    _init_non_adapter_weights_(model, init_std)
    return model


def _adapted_shapes(
    lora_attn_modules: List[str], apply_lora_to_mlp: bool, embed_dim: int, intermediate_dim: int
) -> dict:
    """``{module name in a layer: (out, in)}`` of the linears that get adapters."""
    shapes = {f"attn.{name}": (embed_dim, embed_dim) for name in lora_attn_modules}
    if apply_lora_to_mlp:
        shapes["mlp.w1"] = (intermediate_dim, embed_dim)
        shapes["mlp.w2"] = (embed_dim, intermediate_dim)
    return shapes


def _check_sizes(args: dict) -> None:
    """Check the size and float arguments shared by :func:`opt` and :func:`lora_opt`."""
    for name in ("vocab_size", "num_layers", "num_heads", "embed_dim", "intermediate_dim",
                 "max_seq_len"):  # fmt: skip
        check_int(name, args[name])
    if args["word_embed_proj_dim"] is not None:
        check_int("word_embed_proj_dim", args["word_embed_proj_dim"])
    if not isinstance(args["pre_norm"], bool):
        raise ValueError(f"pre_norm must be a bool, got {args['pre_norm']!r}")
    check_real("attn_dropout", args["attn_dropout"], low=0.0, high=1.0, high_inclusive=False)
    check_real("norm_eps", args["norm_eps"], low=0.0)
    check_real("init_std", args["init_std"], low=0.0)


def _opt_base(in_dim: int, out_dim: int, init_std: float) -> tuple:
    """A frozen base ``(weight, bias)`` for an adapter, initialised as OPT's linears."""
    weight = torch.empty(out_dim, in_dim).normal_(mean=0.0, std=init_std)
    bias = torch.zeros(out_dim)
    return nn.Parameter(weight, requires_grad=False), nn.Parameter(bias, requires_grad=False)


@torch.no_grad()
def _init_base_(module: nn.Module, init_std: float) -> nn.Module:
    """OPT's init of a linear's (or an adapter's base) ``weight`` and ``bias``, in place; an NF4
    weight is quantized from the fresh draw. Nothing is drawn on the meta device."""
    if module.weight.is_meta:
        return module
    draw = torch.empty(module.weight.shape, dtype=torch.float32, device=module.weight.device)
    module.weight.copy_(draw.normal_(mean=0.0, std=init_std).to(module.weight.dtype))
    if module.bias is not None:
        module.bias.zero_()
    return module


@torch.no_grad()
def _init_non_adapter_weights_(model: nn.Module, init_std: float) -> None:
    """OPT's init for every linear and embedding outside the adapters (whose bases were
    initialised when built, and whose factors keep LoRA's init)."""
    adapters = [f"{name}." for name in get_adapter_modules(model)]
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in adapters):
            continue
        if isinstance(module, nn.Linear):
            _init_base_(module, init_std)
        elif isinstance(module, (nn.Embedding, OPTLearnedPositionalEmbedding)):
            module.weight.normal_(mean=0.0, std=init_std)
