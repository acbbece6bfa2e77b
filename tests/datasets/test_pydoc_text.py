"""The Language Reference text dataset (squash.datasets.pydoc_text) against the standard library's
own topics: the splits share no 13-word run (counted here, independently of the grouping), every
topic's text is in them, nothing repeats inside a split; the windows against the tokenizer's own
encoding (a character tokenizer here, SmolLM2's ``tokenizer.json`` through ``tokenizers``)."""

import collections

import pytest
from pydoc_data.topics import topics

from squash.datasets import pydoc_documents, pydoc_text, pydoc_text_dataset

SPLITS = ("train", "validation", "test")


def runs_of_words(text, n=13):
    w = text.split()
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


@pytest.mark.parametrize("seed", [0, 1])
def test_splits_share_no_run_of_13_words(seed):
    texts = {s: pydoc_text(s, seed=seed) for s in SPLITS}
    runs = {s: runs_of_words(t) for s, t in texts.items()}
    for a, b in (("train", "validation"), ("train", "test"), ("validation", "test")):
        assert not runs[a] & runs[b], (a, b, list(runs[a] & runs[b])[:3])
    # the topics that repeat each other are in one split (specialnames holds customization)
    where = {k: s for s in SPLITS for names, _ in pydoc_documents(seed)[s] for k in names}
    assert sorted(where) == sorted(topics)  # every topic in exactly one document's names
    assert where["customization"] == where["specialnames"] == where["attribute-access"]
    assert where["if"] == where["compound"] == where["try"]
    # the held-out splits each hold about a tenth of the characters
    total = sum(len(t) for t in texts.values())
    for s in ("validation", "test"):
        assert 0.1 * total * 0.9 <= len(texts[s]) <= 0.15 * total
    if seed == 1:
        assert pydoc_text("test", seed=1) != pydoc_text("test", seed=0)


def test_every_paragraph_of_every_topic_is_kept_once():
    texts = {s: pydoc_text(s) for s in SPLITS}
    for name, text in topics.items():
        for para in text.split("\n\n"):
            para = para.strip()
            if not para:
                continue
            homes = [s for s, t in texts.items() if para in t]
            assert homes, (name, para[:60])
            if len(para.split()) >= 13:  # a 13-word run lives in one split only
                assert len(homes) == 1, (name, para[:60], homes)
    for s, t in texts.items():
        counts = collections.Counter(p.strip() for p in t.split("\n\n") if len(p.split()) >= 13)
        repeated = [p[:60] for p, c in counts.items() if c > 1]
        assert not repeated, (s, repeated[:3])


class CharTokenizer:
    """Token = code point: the windows must be the text's characters."""

    def encode(self, text, add_bos=True, add_eos=True):
        assert not add_bos and not add_eos
        return [ord(c) for c in text]


def test_windows_are_consecutive_pieces_of_the_encoding():
    text = pydoc_text("validation")
    ds = pydoc_text_dataset(CharTokenizer(), split="validation", max_seq_len=100)
    assert len(ds) == len(text) // 100 and ds.num_tokens == len(text)
    for i in (0, 1, len(ds) - 1):
        sample = ds[i]
        assert sample["tokens"] == [ord(c) for c in text[100 * i : 100 * (i + 1)]]
        assert sample["labels"] == sample["tokens"]
    assert len(pydoc_text_dataset(CharTokenizer(), split="validation", max_seq_len=100,
                                  max_windows=3)) == 3  # fmt: skip


def test_bad_arguments_name_the_argument():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match="split"):
        pydoc_text("dev")
    with pytest.raises(ValueError, match="max_seq_len"):
        pydoc_text_dataset(tok, max_seq_len=1)
    with pytest.raises(ValueError, match="max_windows"):
        pydoc_text_dataset(tok, max_windows=0)
    with pytest.raises(ValueError, match="fewer than max_seq_len"):
        pydoc_text_dataset(tok, split="test", max_seq_len=10**7)


@pytest.mark.smollm2
def test_windows_are_smollm2_tokenizer_json_encoding(smollm2_checkpoint):
    from tokenizers import Tokenizer

    from squash.models.smollm2 import smollm2_tokenizer

    ref = Tokenizer.from_file(str(smollm2_checkpoint / "tokenizer.json"))
    tok = smollm2_tokenizer(str(smollm2_checkpoint))
    for split in ("validation", "test"):
        ids = ref.encode(pydoc_text(split), add_special_tokens=False).ids
        ds = pydoc_text_dataset(tok, split=split, max_seq_len=256)
        assert ds.num_tokens == len(ids) and len(ds) == len(ids) // 256
        got = [t for i in range(len(ds)) for t in ds[i]["tokens"]]
        assert got == ids[: 256 * len(ds)]
        # plain text: no BOS, no chat markup
        assert tok.bos_id not in got and tok.im_start_id not in got
