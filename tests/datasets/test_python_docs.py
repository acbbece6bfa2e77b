"""The Python docs task's dataset: a split's first samples, their labels, bad arguments."""

import pytest

from squash.datasets.python_docs import python_doc_splits, python_docs_dataset
from squash.models.opt import opt_tokenizer
from tests.helpers import REPO

TINY = REPO / "assets" / "tiny_opt"


def _tok():
    return opt_tokenizer(str(TINY / "vocab.json"), str(TINY / "merges.txt"))


def test_max_samples_keeps_a_splits_first_items_and_labels_the_answer():
    ds = python_docs_dataset(_tok(), split="validation", max_samples=3)
    assert len(ds) == 3 and ds.items == python_doc_splits(0)["validation"][:3]
    tok = ds._tokenizer
    for i in range(3):
        s = ds[i]
        assert tok.decode([t for t in s["labels"] if t != -100]) == ds.answer(i)
        prompt = tok.decode([t for t, lab in zip(s["tokens"], s["labels"]) if lab == -100])
        assert prompt == ds.question(i)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "3"])
def test_a_bad_max_samples_or_split_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=r"^max_samples must be an integer >= 1"):
        python_docs_dataset(_tok(), max_samples=bad)
    with pytest.raises(ValueError, match="split must be one of"):
        python_docs_dataset(_tok(), split="dev")
