"""Model builders: squash_* builders for torchtune's own families, each model built once in its
final shape (component builders :func:`squash_llama3_2`, :func:`squash_qwen2` and the projection
builder :func:`linear`); OPT lives in ``models.opt``, SmolLM2 in ``models.smollm2``, whose squash
builder is re-exported here."""

from squash.models._squash_builders import (
    linear,
    squash_llama3_2,
    squash_llama3_2_1b,
    squash_llama3_2_3b,
    squash_model,
    squash_qwen2_5_0_5b,
    squash_qwen2_5_1_5b,
    squash_qwen2_5_1_5b_base,
    squash_qwen2_5_1_5b_instruct,
    squash_qwen2,
)
from squash.models.smollm2 import squash_smollm2_135m

__all__ = [
    "linear",
    "squash_llama3_2",
    "squash_llama3_2_1b",
    "squash_llama3_2_3b",
    "squash_model",
    "squash_qwen2_5_0_5b",
    "squash_qwen2_5_1_5b",
    "squash_qwen2_5_1_5b_base",
    "squash_qwen2",
    "squash_qwen2_5_1_5b_instruct",
    "squash_smollm2_135m",
]
