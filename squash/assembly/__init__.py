"""Config -> model: the one assembly path every use takes (train, resume, evaluate, teacher,
chat, export, merge), so a checkpoint is rebuilt exactly as it was trained.

- :mod:`~squash.assembly.model_setup`: the adapted model (and a frozen one) from the config's
  ``model`` block, built once on the meta device with its final classes, sharded or not, and
  loaded once from one full state dict (the base or its SVD residual, plus the adapter);
- :mod:`~squash.assembly.adapter_init`: the initial adapter (LoRA, SVD, LoftQ) as full
  tensors, the same on one device and on N;
- :mod:`~squash.assembly.calibration`: the corrected 4-bit base (``model.base_outliers``):
  calibration and the split of each loaded base weight;
- :mod:`~squash.assembly.fsdp`: what the assembly needs of FSDP2 beyond torchtune's helpers
  (sharding, the broadcast of replicated tensors, loading a full state dict into a sharded
  model).

Above :mod:`squash.config`, :mod:`squash.runs` (a resumed adapter is read through
:mod:`squash.runs.checkpoint`) and :mod:`squash.training` (the mask schedule and the memory
summary a model is built with); below the recipes, :mod:`squash.merge` and :mod:`squash.chat`.
"""
