"""Training utilities: memory accounting (checkpointers and export live here too)."""

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
    "lora_adapter_memory",
    "max_rank_within",
]
