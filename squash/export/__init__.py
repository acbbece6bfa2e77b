"""Exports of a finished checkpoint to the formats people run models in (GGUF for llama.cpp,
Ollama, LM Studio)."""

from squash.export.gguf import (
    GGUF_DTYPES,
    SUPPORTED_ARCHITECTURES,
    UnsupportedModelError,
    export_checkpoint,
    export_gguf,
    parse_export_config,
)

__all__ = [
    "GGUF_DTYPES",
    "SUPPORTED_ARCHITECTURES",
    "UnsupportedModelError",
    "export_checkpoint",
    "export_gguf",
    "parse_export_config",
]
