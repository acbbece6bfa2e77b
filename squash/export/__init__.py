"""Exports of a finished checkpoint to the formats people run models in (GGUF for llama.cpp,
Ollama, LM Studio). A squash checkpoint's model (merged, or its adapter merged into its base)
is exported by :func:`squash.merge.export_checkpoint`, which reads it and calls these."""

from squash.export.gguf import (
    GGUF_DTYPES,
    SUPPORTED_ARCHITECTURES,
    UnsupportedModelError,
    export_gguf,
    parse_export_config,
    write_gguf,
)

__all__ = [
    "GGUF_DTYPES",
    "SUPPORTED_ARCHITECTURES",
    "UnsupportedModelError",
    "export_gguf",
    "parse_export_config",
    "write_gguf",
]
