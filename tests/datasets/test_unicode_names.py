"""The Unicode-names task (squash.datasets) against the standard library's own tables and
hand-checked names."""

import unicodedata
from pathlib import Path

import pytest

from squash.datasets import characters, unicode_name_pairs, unicode_names_dataset
from squash.models.opt import opt_tokenizer

TINY = Path(__file__).resolve().parents[2] / "assets" / "tiny_opt"


def test_splits_are_disjoint_cover_everything_and_are_deterministic():
    splits = {s: unicode_name_pairs(s) for s in ("train", "validation", "test")}
    chars = {s: {c for c, _ in p} for s, p in splits.items()}
    assert not chars["train"] & chars["validation"] and not chars["train"] & chars["test"]
    assert not chars["validation"] & chars["test"]
    assert set().union(*chars.values()) == set(characters())
    assert len(splits["validation"]) == len(splits["test"]) == round(0.1 * len(characters()))
    assert unicode_name_pairs("validation") == splits["validation"]
    assert unicode_name_pairs("validation", seed=1) != splits["validation"]


def test_names_are_the_unicode_names():
    pairs = dict(p for s in ("train", "validation", "test") for p in unicode_name_pairs(s))
    # by hand, from the Unicode code charts
    assert pairs["ñ"] == "LATIN SMALL LETTER N WITH TILDE"
    assert pairs["Ω"] == "GREEK CAPITAL LETTER OMEGA"
    assert pairs["Ж"] == "CYRILLIC CAPITAL LETTER ZHE"
    assert pairs["€"] == "EURO SIGN"
    assert pairs["→"] == "RIGHTWARDS ARROW"
    assert pairs["∑"] == "N-ARY SUMMATION"
    # names never change once assigned: the current tables agree with UCD 3.2.0's
    assert all(unicodedata.name(c) == n for c, n in pairs.items())
    # marks, digits, punctuation are left out
    assert "\u0301" not in pairs and "0" not in pairs and "!" not in pairs


def test_samples_mask_the_question_and_label_the_name():
    tok = opt_tokenizer(str(TINY / "vocab.json"), str(TINY / "merges.txt"))
    ds = unicode_names_dataset(tok, split="test", max_samples=4)
    assert len(ds) == 4
    for i in range(4):
        s = ds[i]
        label_ids = [t for t in s["labels"] if t != -100]
        assert tok.decode(label_ids) == ds.answer(i)
        prompt = tok.decode([t for t, lab in zip(s["tokens"], s["labels"]) if lab == -100])
        assert prompt == f"What is the Unicode name of the character '{ds.pairs[i][0]}'?"


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="split must be one of"):
        unicode_name_pairs("dev")
    tok = opt_tokenizer(str(TINY / "vocab.json"), str(TINY / "merges.txt"))
    with pytest.raises(ValueError, match="max_samples"):
        unicode_names_dataset(tok, max_samples=0)
