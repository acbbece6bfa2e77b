"""Model builders for the OPT family (facebook/opt-*) and a tiny test model.

The sizes are those of the published HF configs (``hidden_size``, ``num_hidden_layers``,
``num_attention_heads``, ``ffn_dim``, ``word_embed_proj_dim``, ``do_layer_norm_before``,
``max_position_embeddings``). ``opt_tiny`` matches ``assets/tiny_opt/config.json``, which
``scripts/make_tiny_opt.py`` writes.

Each adapter builder is one plain function with an explicit signature (:func:`lora_opt_sized`)
whose body passes every one of its arguments by name to the component builder (``locals()`` at
the top of a function holds exactly its arguments, so no argument can be dropped or shifted on
the way), with the size bound by ``functools.partial``; variants that only change a default
(``qlora_*``) are partials of those, each with a docstring, as in torchtune.
"""

from functools import partial
from typing import List, Mapping, Optional

from torchtune.modules.peft import LORA_ATTN_MODULES

from squash.models._squash_builders import _sized
from squash.models.opt._component_builders import lora_opt, opt
from squash.models.opt._decoder import OPTDecoder

_OPT_SIZES = {
    "125m": dict(vocab_size=50_272, num_layers=12, num_heads=12, embed_dim=768,
                 intermediate_dim=3072, max_seq_len=2048, word_embed_proj_dim=768, pre_norm=True),
    "350m": dict(vocab_size=50_272, num_layers=24, num_heads=16, embed_dim=1024,
                 intermediate_dim=4096, max_seq_len=2048, word_embed_proj_dim=512, pre_norm=False),
    "1_3b": dict(vocab_size=50_272, num_layers=24, num_heads=32, embed_dim=2048,
                 intermediate_dim=8192, max_seq_len=2048, word_embed_proj_dim=2048, pre_norm=True),
    "2_7b": dict(vocab_size=50_272, num_layers=32, num_heads=32, embed_dim=2560,
                 intermediate_dim=10240, max_seq_len=2048, word_embed_proj_dim=2560, pre_norm=True),
    "6_7b": dict(vocab_size=50_272, num_layers=32, num_heads=32, embed_dim=4096,
                 intermediate_dim=16384, max_seq_len=2048, word_embed_proj_dim=4096, pre_norm=True),
    # assets/tiny_opt: post-norm with project_in/out like 350m; every linear is a multiple of
    # 16384 elements, so QLoRA (NF4) works on it.
    "tiny": dict(vocab_size=1024, num_layers=2, num_heads=4, embed_dim=128,
                 intermediate_dim=256, max_seq_len=256, word_embed_proj_dim=64, pre_norm=False),
}  # fmt: skip


def opt_125m() -> OPTDecoder:
    """OPT-125m (pre-norm, 12 layers, hidden 768)."""
    return opt(**_OPT_SIZES["125m"])


def opt_350m() -> OPTDecoder:
    """OPT-350m (post-norm, 24 layers, hidden 1024, token embeddings of width 512)."""
    return opt(**_OPT_SIZES["350m"])


def opt_1_3b() -> OPTDecoder:
    """OPT-1.3b (pre-norm, 24 layers, hidden 2048)."""
    return opt(**_OPT_SIZES["1_3b"])


def opt_2_7b() -> OPTDecoder:
    """OPT-2.7b (pre-norm, 32 layers, hidden 2560)."""
    return opt(**_OPT_SIZES["2_7b"])


def opt_6_7b() -> OPTDecoder:
    """OPT-6.7b (pre-norm, 32 layers, hidden 4096)."""
    return opt(**_OPT_SIZES["6_7b"])


def opt_tiny() -> OPTDecoder:
    """The tiny random-init OPT shipped in ``assets/tiny_opt`` (post-norm, 2 layers, hidden 128,
    token embeddings of width 64, vocabulary 1024, 256 positions)."""
    return opt(**_OPT_SIZES["tiny"])


def lora_opt_sized(
    size: str,
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
    base_outliers: Optional[Mapping] = None,
) -> OPTDecoder:
    """OPT of ``size`` (a key of the published sizes: ``125m``, ``350m``, ``1_3b``, ``2_7b``,
    ``6_7b``, ``tiny``) with LoRA adapters; the other arguments as for :func:`lora_opt`. The
    sized builders (``lora_opt_350m``, ...) are this function with ``size`` bound."""
    args = dict(locals())
    return lora_opt(**_OPT_SIZES[args.pop("size")], **args)


lora_opt_125m = _sized(lora_opt_sized, "125m", """Builder for OPT-125m with LoRA adapters; arguments as
for :func:`lora_opt`.""")
lora_opt_350m = _sized(lora_opt_sized, "350m", """Builder for OPT-350m with LoRA adapters; arguments as
for :func:`lora_opt`.""")
lora_opt_1_3b = _sized(lora_opt_sized, "1_3b", """Builder for OPT-1.3b with LoRA adapters; arguments as
for :func:`lora_opt`.""")
lora_opt_2_7b = _sized(lora_opt_sized, "2_7b", """Builder for OPT-2.7b with LoRA adapters; arguments as
for :func:`lora_opt`.""")
lora_opt_6_7b = _sized(lora_opt_sized, "6_7b", """Builder for OPT-6.7b with LoRA adapters; arguments as
for :func:`lora_opt`.""")
lora_opt_tiny = _sized(lora_opt_sized, "tiny", """Builder for the tiny OPT with LoRA adapters; arguments as
for :func:`lora_opt`.""")

qlora_opt_125m = partial(lora_opt_125m, quantize_base=True)
qlora_opt_125m.__doc__ = """Builder for OPT-125m with QLoRA: LoRA adapters on NF4 base weights.
Please see `lora_opt_125m` for full API arguments."""

qlora_opt_350m = partial(lora_opt_350m, quantize_base=True)
qlora_opt_350m.__doc__ = """Builder for OPT-350m with QLoRA: LoRA adapters on NF4 base weights.
Please see `lora_opt_350m` for full API arguments."""

qlora_opt_1_3b = partial(lora_opt_1_3b, quantize_base=True)
qlora_opt_1_3b.__doc__ = """Builder for OPT-1.3b with QLoRA: LoRA adapters on NF4 base weights.
Please see `lora_opt_1_3b` for full API arguments."""

qlora_opt_2_7b = partial(lora_opt_2_7b, quantize_base=True)
qlora_opt_2_7b.__doc__ = """Builder for OPT-2.7b with QLoRA: LoRA adapters on NF4 base weights.
Please see `lora_opt_2_7b` for full API arguments."""

qlora_opt_6_7b = partial(lora_opt_6_7b, quantize_base=True)
qlora_opt_6_7b.__doc__ = """Builder for OPT-6.7b with QLoRA: LoRA adapters on NF4 base weights.
Please see `lora_opt_6_7b` for full API arguments."""

qlora_opt_tiny = partial(lora_opt_tiny, quantize_base=True)
qlora_opt_tiny.__doc__ = """Builder for the tiny OPT with QLoRA: LoRA adapters on NF4 base weights.
Please see `lora_opt_tiny` for full API arguments."""
