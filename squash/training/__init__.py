"""What training recipes share, one module per job; the recipes call these, never copy them.

Setting up a run:

- :mod:`~squash.training.model_setup`: the adapted model (and a frozen one) from the config,
  with :mod:`~squash.training.adapter_init` (the initial adapter) and
  :mod:`~squash.training.calibration` (the corrected 4-bit base);
- :mod:`~squash.training.data`: the resumable data loader and the steps an epoch makes.

Training:

- :mod:`~squash.training.steps`: the optimizer step, the lr schedule, profiler and logged stats,
  and the mask update around a step;
- :mod:`~squash.training.masks`: when masks move and by how much, and prune and regrow at
  constant fan-in;
- :mod:`~squash.training.heldout`: the held-out evaluation before and after training;
- :mod:`~squash.training.memory`: adapter memory accounting;
- :mod:`~squash.training.distributed`: what FSDP2 needs beyond torchtune's helpers.

The config's keys and values are checked in :mod:`squash.config`; what a run owns on disk
(its lock, checkpoints, ``checkpoint.json``, resume, the entry point's error handling) is
:mod:`squash.runs`.

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
