"""What leaves a run, in the formats people run models in:

- :mod:`~squash.export.adapters`: what a checkpoint holds of the model: the squash adapter, the
  PEFT adapter and the merged weights, all from one full state dict (every recipe's save);
- :mod:`~squash.export.gguf` (with :mod:`~squash.export.gguf_general`): GGUF for llama.cpp,
  Ollama, LM Studio. A squash checkpoint's model (merged, or its adapter merged into its base)
  is exported by :func:`squash.merge.export_checkpoint`, which reads it and calls these.

Below :mod:`squash.models` and :mod:`squash.training`: this package imports neither. The GGUF
names below load the ``gguf`` package on first use, so the recipes' saves (which import
:mod:`~squash.export.adapters` alone) do not need it.
"""

import importlib
from typing import Any

_GGUF_NAMES = (
    "GGUF_DTYPES",
    "SUPPORTED_ARCHITECTURES",
    "UnsupportedModelError",
    "export_gguf",
    "parse_export_config",
    "write_gguf",
)

__all__ = list(_GGUF_NAMES)


def __getattr__(name: str) -> Any:
    if name in _GGUF_NAMES:
        return getattr(importlib.import_module("squash.export.gguf"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
