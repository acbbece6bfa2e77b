"""Model builders: squash_* wrappers for torchtune's own families (OPT lives in ``models.opt``,
SmolLM2 in ``models.smollm2``, whose squash builder is re-exported here)."""

from squash.models._squash_builders import (
    squash_llama3_2_1b,
    squash_llama3_2_3b,
    squash_model,
    squash_qwen2_5_0_5b,
    squash_qwen2_5_1_5b,
    squash_qwen2_5_1_5b_base,
    squash_qwen2_5_1_5b_instruct,
)
from squash.models.smollm2 import squash_smollm2_135m

__all__ = [
    "squash_llama3_2_1b",
    "squash_llama3_2_3b",
    "squash_model",
    "squash_qwen2_5_0_5b",
    "squash_qwen2_5_1_5b",
    "squash_qwen2_5_1_5b_base",
    "squash_qwen2_5_1_5b_instruct",
    "squash_smollm2_135m",
]
