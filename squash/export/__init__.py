"""What leaves a run, in the formats people run models in:

- :mod:`~squash.export.adapters`: what a checkpoint holds of the model: the squash adapter, the
  PEFT adapter and the merged weights, all from one full state dict (every recipe's save);
- :mod:`~squash.export.gguf` (with :mod:`~squash.export.gguf_general`): GGUF for llama.cpp,
  Ollama, LM Studio. A squash checkpoint's model (merged, or its adapter merged into its base)
  is exported by :func:`squash.merge.export_checkpoint`, which reads it and calls these.

- :mod:`~squash.export.hf_files`: reading a Hugging Face model directory, and
  :mod:`~squash.export.formats`: the recipes' ``export`` block; neither needs ``gguf``.

Below :mod:`squash.models` and the packages that read a config (:mod:`squash.config`,
:mod:`squash.training`, :mod:`squash.runs`, :mod:`squash.assembly`): it imports none of them.
The GGUF names below load the ``gguf`` package on first use, so a recipe (its saves, its
``export`` block, :mod:`squash.merge`) loads it only when it writes a GGUF file.
"""

import importlib
from typing import Any

_GGUF_NAMES = ("SUPPORTED_ARCHITECTURES", "UnsupportedModelError", "export_gguf", "write_gguf")
# without the gguf package: the export block and the GGUF dtypes it accepts
_PLAIN_NAMES = {"GGUF_DTYPES": "hf_files", "parse_export_config": "formats"}

__all__ = sorted(_GGUF_NAMES + tuple(_PLAIN_NAMES))


def __getattr__(name: str) -> Any:
    if name in _GGUF_NAMES:
        return getattr(importlib.import_module("squash.export.gguf"), name)
    if name in _PLAIN_NAMES:
        return getattr(importlib.import_module(f"squash.export.{_PLAIN_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
