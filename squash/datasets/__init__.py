"""Datasets squash builds at run time from files the standard library installs."""

from squash.datasets.pydoc_text import (
    PydocTextDataset,
    pydoc_documents,
    pydoc_text,
    pydoc_text_dataset,
    pydoc_topics,
)
from squash.datasets.unicode_names import (
    UnicodeNamesDataset,
    characters,
    unicode_name_messages,
    unicode_name_pairs,
    unicode_names_dataset,
)

__all__ = [
    "PydocTextDataset",
    "UnicodeNamesDataset",
    "characters",
    "pydoc_documents",
    "pydoc_text",
    "pydoc_text_dataset",
    "pydoc_topics",
    "unicode_name_messages",
    "unicode_name_pairs",
    "unicode_names_dataset",
]
