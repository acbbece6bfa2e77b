"""SmolLM2-135M(-Instruct) for torchtune: builders on torchtune's Llama 3.2 components, the
ChatML tokenizer, and ``squash download smollm2-135m-instruct`` (:mod:`._download`).

Weights load with torchtune's ``FullModelHFCheckpointer`` (``model_type: LLAMA3_2``): the
checkpoint has no ``lm_head`` key (tied embeddings), which torchtune's Llama key map handles.
"""

from squash.models.smollm2._model_builders import (
    lora_smollm2_135m,
    qlora_smollm2_135m,
    smollm2_135m,
    squash_smollm2_135m,
)
from squash.models.smollm2._tokenizer import SmolLM2Tokenizer, smollm2_tokenizer

__all__ = [
    "SmolLM2Tokenizer",
    "lora_smollm2_135m",
    "qlora_smollm2_135m",
    "smollm2_135m",
    "smollm2_tokenizer",
    "squash_smollm2_135m",
]
