"""What training recipes share: mask updates (prune and regrow at constant fan-in, with the
optimizer state, and the cosine-decayed drop fraction) and adapter memory accounting.

The OPT checkpointer lives with the model, in :mod:`squash.models.opt`.
"""

from squash.training.mask_update import (
    cosine_drop_fraction,
    prune_and_regrow,
    record_dense_grads,
    record_grow_candidates,
    update_masks,
)
from squash.training.memory import (
    AdapterMemory,
    adapted_shapes,
    adapter_memory,
    lora_adapter_memory,
    max_rank_within,
)

__all__ = [
    "AdapterMemory",
    "adapted_shapes",
    "adapter_memory",
    "cosine_drop_fraction",
    "lora_adapter_memory",
    "max_rank_within",
    "prune_and_regrow",
    "record_dense_grads",
    "record_grow_candidates",
    "update_masks",
]
