"""Datasets squash builds at run time from files the standard library installs."""

from squash.datasets.unicode_names import (
    UnicodeNamesDataset,
    characters,
    unicode_name_messages,
    unicode_name_pairs,
    unicode_names_dataset,
)

__all__ = [
    "UnicodeNamesDataset",
    "characters",
    "unicode_name_messages",
    "unicode_name_pairs",
    "unicode_names_dataset",
]
