"""What a run owns on disk, one module per job; every recipe, ``squash_eval``, the merge and
``squash export``/``chat`` read and write a run's directory through these.

- :mod:`~squash.runs.entry`: what a recipe's entry point does around a run (config and
  checkpoint errors as one line, the metric logger opened last and closed without an empty
  file);
- :mod:`~squash.runs.run_lock`: the run's claim on its ``output_dir`` (never a directory it
  reads, one live run at a time, the lock record checkpoints copy);
- :mod:`~squash.runs.checkpoint`: atomic checkpoint directories, naming, pruning, reading, and
  finding the newest one;
- :mod:`~squash.runs.manifest`: ``checkpoint.json``, the hashes and counters every reader
  verifies;
- :mod:`~squash.runs.resume`: the recipe state, finding it and checking it against the
  resuming run (config, input files, optimizer state), and restoring it.

These import :mod:`squash.config` (errors naming the key) and :mod:`squash.export` (what a
checkpoint holds of the model); the model assembly reads a checkpoint's adapter through
:mod:`~squash.runs.checkpoint`.
"""
