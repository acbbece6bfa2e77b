"""squash.datasets.python_code and the cipher of squash.datasets.pydoc_text against independent
computations: the splits against the standard library's files grouped by package by hand, the
windows against the tokenizer run on the split's text, the cipher against its inverse."""

import string
import sysconfig
from pathlib import Path

import pytest

from squash.datasets.pydoc_text import PydocTextDataset, encipher, letter_cipher, pydoc_text
from squash.datasets.python_code import PythonCodeDataset, python_code_files, python_code_text


class CharTokenizer:
    """One token per character (its code point): windows are checkable by eye."""

    def encode(self, text, add_bos=False, add_eos=False):
        return [ord(c) for c in text]


def test_code_splits_are_disjoint_by_package_and_cover_the_library():
    files = python_code_files()
    tops = {s: {m.split(".")[0] for m, _ in v} for s, v in files.items()}
    assert not tops["train"] & tops["test"] and not tops["train"] & tops["validation"]
    assert not tops["test"] & tops["validation"]
    root = Path(sysconfig.get_paths()["stdlib"])
    every = [p for v in files.values() for _, p in v]
    assert len(every) == len(set(every)) and all(p.is_relative_to(root) for p in every)
    assert not any("test" == p.relative_to(root).parts[0] for p in every)
    size = {s: sum(p.stat().st_size for _, p in v) for s, v in files.items()}
    total = sum(size.values())
    for s in ("test", "validation"):  # a twentieth each, within the dealing's slack
        assert 0.05 * total <= size[s] <= 0.075 * total + max(p.stat().st_size for p in every)


def test_code_windows_are_consecutive_tokens_of_the_split_text():
    text = python_code_text("validation")
    assert text.startswith("# file: ")
    ds = PythonCodeDataset(CharTokenizer(), "validation", max_seq_len=64)
    assert len(ds) == len(text) // 64 and ds.num_tokens == len(text)
    assert "".join(map(chr, ds[3]["tokens"])) == text[3 * 64 : 4 * 64]
    assert ds[3]["labels"] == ds[3]["tokens"]
    few = PythonCodeDataset(CharTokenizer(), "validation", max_seq_len=64, max_windows=4)
    n = len(text) // 64
    assert [w["tokens"] for w in (few[i] for i in range(4))] == [
        ds[i * n // 4]["tokens"] for i in range(4)]  # spread evenly over the split
    with pytest.raises(ValueError, match="split must be one of"):
        python_code_text("dev")


def test_cipher_is_a_derangement_of_the_letters_and_inverts():
    table = letter_cipher(0)
    assert sorted(table) == sorted(table.values()) == list(string.ascii_lowercase)
    assert all(a != b for a, b in table.items())
    assert letter_cipher(0) == table and letter_cipher(1) != table
    text = pydoc_text("validation")[:2000]
    secret = encipher(text, 0)
    inverse = {b: a for a, b in table.items()}
    inverse.update({b.upper(): a.upper() for a, b in table.items()})
    assert "".join(inverse.get(c, c) for c in secret) == text
    assert [c.isalpha() for c in secret] == [c.isalpha() for c in text]  # shape kept
    assert sum(a != b for a, b in zip(secret, text)) == sum(c.isascii() and c.isalpha() for c in text)


def test_enciphered_windows_are_the_enciphered_text():
    ds = PydocTextDataset(CharTokenizer(), "validation", max_seq_len=32, cipher_seed=0)
    plain = PydocTextDataset(CharTokenizer(), "validation", max_seq_len=32)
    assert len(ds) == len(plain)
    assert "".join(map(chr, ds[5]["tokens"])) == encipher(pydoc_text("validation"), 0)[160:192]
    with pytest.raises(ValueError, match="cipher_seed"):
        PydocTextDataset(CharTokenizer(), "validation", cipher_seed=-1)
