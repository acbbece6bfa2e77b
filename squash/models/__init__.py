"""Model builders: squash_* builders for torchtune's own families, each model built once in its
final shape (component builders :func:`squash_llama3_2`, :func:`squash_qwen2` and the projection
builder :func:`linear`); OPT lives in ``models.opt``, SmolLM2 in ``models.smollm2``, whose squash
builder is re-exported here."""

from typing import Callable, Dict

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
    "adapter_builders",
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


def adapter_builders() -> Dict[str, Callable]:
    """The model builders a checkpoint may name, by their public dotted names: every ``lora_*``,
    ``qlora_*`` and ``squash_*`` builder that :mod:`squash.models`, :mod:`squash.models.opt` and
    :mod:`squash.models.smollm2` export, but :func:`squash_model` (it takes a callable). A reader
    of a checkpoint builds nothing else (see :func:`squash.merge.checked_model_block`)."""
    import squash.models as models
    import squash.models.opt as opt
    import squash.models.smollm2 as smollm2

    builders = {}
    for module in (models, opt, smollm2):
        for name in module.__all__:
            if name.startswith(("lora_", "qlora_", "squash_")) and name != "squash_model":
                builders[f"{module.__name__}.{name}"] = getattr(module, name)
    return builders
