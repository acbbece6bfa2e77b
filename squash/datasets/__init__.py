"""Datasets squash builds at run time from files the standard library installs."""

from squash.datasets.iso_dates import IsoDatesDataset, iso_date_pairs, iso_dates_dataset
from squash.datasets.pydoc_text import (
    PydocTextDataset,
    encipher,
    letter_cipher,
    pydoc_documents,
    pydoc_text,
    pydoc_text_dataset,
    pydoc_topics,
)
from squash.datasets.python_code import (
    PythonCodeDataset,
    python_code_dataset,
    python_code_files,
    python_code_text,
)
from squash.datasets.python_docs import (
    PythonDocsDataset,
    python_doc_items,
    python_doc_splits,
    python_docs_dataset,
)
from squash.datasets.unicode_names import (
    UnicodeNamesDataset,
    characters,
    unicode_name_messages,
    unicode_name_pairs,
    unicode_names_dataset,
)

__all__ = [
    "IsoDatesDataset",
    "PydocTextDataset",
    "PythonCodeDataset",
    "PythonDocsDataset",
    "UnicodeNamesDataset",
    "characters",
    "encipher",
    "iso_date_pairs",
    "iso_dates_dataset",
    "letter_cipher",
    "pydoc_documents",
    "pydoc_text",
    "pydoc_text_dataset",
    "pydoc_topics",
    "python_code_dataset",
    "python_code_files",
    "python_code_text",
    "python_doc_items",
    "python_doc_splits",
    "python_docs_dataset",
    "unicode_name_messages",
    "unicode_name_pairs",
    "unicode_names_dataset",
]
