"""What training recipes share, one module per job; the recipes call these, never copy them:

- :mod:`~squash.training.model_setup`: the adapted model (and a frozen one) from the config;
- :mod:`~squash.training.data`: the resumable data loader and the steps an epoch makes;
- :mod:`~squash.training.steps`: the optimizer step, the lr schedule, profiler and logged stats,
  and the mask update around a step;
- :mod:`~squash.training.masks`: when masks move and by how much, and prune and regrow at
  constant fan-in;
- :mod:`~squash.training.checkpoint`: atomic checkpoint directories, naming, pruning, reading;
- :mod:`~squash.training.resume`: the recipe state, finding it and restoring it;
- :mod:`~squash.training.distributed`: what FSDP2 needs beyond torchtune's helpers;
- :mod:`~squash.training.memory`: adapter memory accounting.

The OPT checkpointer lives with the model, in :mod:`squash.models.opt`; what a checkpoint
exports of the model (squash adapter, PEFT adapter, merged weights) lives below training, in
:mod:`squash.export.adapters`.
"""

from squash.training.masks import (
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
