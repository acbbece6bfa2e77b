"""Model builders: squash_* wrappers for torchtune's own families (OPT lives in ``models.opt``)."""

from squash.models._squash_builders import (
    squash_llama3_2_1b,
    squash_llama3_2_3b,
    squash_model,
    squash_qwen2_5_0_5b,
    squash_qwen2_5_1_5b,
    squash_qwen2_5_1_5b_base,
    squash_qwen2_5_1_5b_instruct,
)

__all__ = [
    "squash_llama3_2_1b",
    "squash_llama3_2_3b",
    "squash_model",
    "squash_qwen2_5_0_5b",
    "squash_qwen2_5_1_5b",
    "squash_qwen2_5_1_5b_base",
    "squash_qwen2_5_1_5b_instruct",
]
