"""benchmarks/distill.py: its table against hand-computed values, and the corpus generator
against its definition (the benchmark runs the recipes for minutes, so the tests run its
pieces; tests/recipes/test_squash_distill.py runs the same commands end to end)."""

import collections
import json
import math
import sys
from pathlib import Path

import distill
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import distill_teacher  # noqa: E402


def test_table_gap_closed_is_hand_computed():
    res = dict(teacher=10.0, nf4=20.0, steps=30, seeds=2, rows=[
        dict(arm="plain CE", lr=3e-3, perplexity=[14.0, 16.0]),        # mean 15: gap 5 of 10
        dict(arm="SquareHead + KL", lr=3e-3, perplexity=[11.0, 12.0]),  # mean 11.5: 1.5 of 10
    ])  # fmt: skip
    text = distill.table(res)
    assert "gap 10.000" in text
    assert "| plain CE | 0.003 | 15.000 ± 1.414 | 50% |" in text  # stdev(14, 16) = sqrt(2)
    assert "| SquareHead + KL | 0.003 | 11.500 ± 0.707 | 85% |" in text


def test_corpus_is_the_bigram_chain_it_claims(tmp_path):
    from squash.models.opt import opt_tokenizer

    path = tmp_path / "corpus.jsonl"
    entropy = distill_teacher.write_corpus(path, records=400)
    texts = [json.loads(line)["text"] for line in path.read_text().splitlines()]
    assert len(texts) == 400
    words = [t.split() for t in texts]
    assert all(21 <= len(w) <= 40 for w in words)  # a first word and 20-39 successors
    vocab = {w for ws in words for w in ws}
    assert len(vocab) <= 200
    successors = collections.defaultdict(collections.Counter)
    for ws in words:
        for a, b in zip(ws, ws[1:]):
            successors[a][b] += 1
    assert max(len(c) for c in successors.values()) <= 8  # 8 successors a word
    # the empirical conditional entropy approaches the generator's (short of it: finite sample)
    n = sum(sum(c.values()) for c in successors.values())
    empirical = -sum(v / n * math.log(v / sum(c.values()))
                     for c in successors.values() for v in c.values())
    assert 1.0 < entropy < math.log(8)
    assert empirical == pytest.approx(entropy, abs=0.15)
    # every word after a space is one token (the first word of a record has no space)
    tok = opt_tokenizer(str(REPO / "assets/tiny_opt/vocab.json"),
                        str(REPO / "assets/tiny_opt/merges.txt"))
    for ws, text in zip(words[:20], texts):
        first = len(tok.encode(ws[0], add_bos=False, add_eos=False))
        assert len(tok.encode(text, add_bos=False, add_eos=False)) == first + len(ws) - 1
    # deterministic: the same seed writes the same file
    again = tmp_path / "again.jsonl"
    distill_teacher.write_corpus(again, records=400)
    assert again.read_bytes() == path.read_bytes()
