"""The ISO-date task (squash.datasets) against the standard library's own date parsing and
hand-checked dates."""

import datetime
from pathlib import Path

import pytest

from squash.datasets import iso_date_pairs, iso_dates_dataset
from squash.models.opt import opt_tokenizer

TINY = Path(__file__).resolve().parents[2] / "assets" / "tiny_opt"
SPLITS = ("train", "validation", "test")


def test_splits_are_disjoint_cover_every_day_and_are_deterministic():
    splits = {s: iso_date_pairs(s) for s in SPLITS}
    days = {s: {d for d, _ in p} for s, p in splits.items()}
    assert not days["train"] & days["validation"] and not days["train"] & days["test"]
    assert not days["validation"] & days["test"]
    # 1900-2099: 200 years, 49 of them leap (2000 is one, 1900 is not)
    assert sum(len(d) for d in days.values()) == 200 * 365 + 49
    assert len(splits["validation"]) == len(splits["test"]) == 500
    assert iso_date_pairs("test") == splits["test"]
    assert iso_date_pairs("test", seed=1) != splits["test"]


def test_every_answer_is_the_rule_applied_to_its_question():
    for split in SPLITS:
        for spoken, answer in iso_date_pairs(split):
            # strptime's own parse of the question's date, formatted by hand
            d = datetime.datetime.strptime(spoken, "%B %d, %Y")
            assert answer == f"{d.year:04d}-{d.month:02d}-{d.day:02d}"
    pairs = dict(iso_date_pairs("train") + iso_date_pairs("validation") + iso_date_pairs("test"))
    assert pairs["March 5, 2021"] == "2021-03-05"
    assert pairs["February 29, 2000"] == "2000-02-29"
    assert "February 29, 1900" not in pairs and pairs["December 31, 2099"] == "2099-12-31"


def test_samples_mask_the_question_and_label_the_answer():
    tok = opt_tokenizer(str(TINY / "vocab.json"), str(TINY / "merges.txt"))
    ds = iso_dates_dataset(tok, split="validation", max_samples=4)
    assert len(ds) == 4
    for i in range(4):
        s = ds[i]
        assert tok.decode([t for t in s["labels"] if t != -100]) == ds.answer(i)
        prompt = tok.decode([t for t, lab in zip(s["tokens"], s["labels"]) if lab == -100])
        assert prompt == f"Write the date {ds.items[i][0]} in ISO 8601 format (YYYY-MM-DD)."


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="split must be one of"):
        iso_date_pairs("dev")
    tok = opt_tokenizer(str(TINY / "vocab.json"), str(TINY / "merges.txt"))
    with pytest.raises(ValueError, match="max_samples"):
        iso_dates_dataset(tok, max_samples=0)
