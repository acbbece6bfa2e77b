"""The training step and what surrounds it, one module per job; the recipes call these, never
copy them.

- :mod:`~squash.training.steps`: the optimizer step, the lr schedule, profiler and logged stats,
  and the mask update around a step;
- :mod:`~squash.training.masks`: when masks move and by how much, prune and regrow at constant
  fan-in, and what a backward records for it;
- :mod:`~squash.training.distributed`: the same mask update on a model sharded with FSDP2, the
  check that every rank holds the same FFI indices, per-rank state gathered for a checkpoint;
- :mod:`~squash.training.data`: the resumable data loader, the records it names when one cannot
  be used, and the steps an epoch makes;
- :mod:`~squash.training.heldout`: the held-out evaluation before and after training;
- :mod:`~squash.training.memory`: adapter memory accounting;
- :mod:`~squash.training.placement`: the device and dtype a run uses (``auto`` resolved on the
  host, with the reason the recipes log);
- :mod:`~squash.training.plot`: the picture of a run (``training.png``), drawn from its logs;
- :mod:`~squash.training.progress`: the run's progress bar and the lines it ends with.

The rooms beside this one: :mod:`squash.config` (the config's keys and values, checked),
:mod:`squash.runs` (what a run owns on disk: its lock, checkpoints, ``checkpoint.json``,
resume) and :mod:`squash.assembly` (config -> model, which uses the mask schedule and the memory
accounting here). What a checkpoint exports of the model (squash adapter, PEFT adapter, merged
weights) lives below, in :mod:`squash.export.adapters`; the OPT checkpointer lives with the
model, in :mod:`squash.models.opt`.
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
