"""benchmarks/quality.py --quick runs end to end, and its table agrees with independent
computations: the ranks with ``max_rank_within``, the means and spreads with the per-seed values
the script writes, the chosen and added learning rates with the sweep, the data with the task's
rule, and the reference predictors' exact match with a count over the test records."""

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from squash.training import lora_adapter_memory, max_rank_within

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("quality") / "quality.md"
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "quality.py"), "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    return out.read_text(), json.loads(out.with_suffix(".json").read_text())


@pytest.mark.slow
def test_ranks_are_the_memory_accounting(quick):
    _, res = quick
    shapes, r, sp = [tuple(s) for s in res["shapes"]], res["rank"], res["sparsity"]
    # 2 layers x (q, k, v, output: 128 -> 128; fc1: 128 -> 256; fc2: 256 -> 128)
    assert sorted(set(shapes)) == [(128, 128), (128, 256), (256, 128)] and len(shapes) == 12
    budget = lora_adapter_memory(shapes, r, dtype=torch.float32).total_bytes
    r_both = max_rank_within(budget, shapes, sparsity=sp, sparse_factor="both", dtype=torch.float32)
    r_a = max_rank_within(budget, shapes, sparsity=sp, sparse_factor="a", dtype=torch.float32)
    assert r_both > r_a > r  # what the memory buys, and more with both factors sparse
    want = {"qlora": (r, None, "a"), "squash_r": (r, sp, "a"), "squash_both": (r_both, sp, "both"),
            "squash_a": (r_a, sp, "a"), "squash_both_mask": (r_both, sp, "both"),
            "squash_both_svd": (r_both, sp, "both"),
            "qlora_dense_at_squash_rank": (r_both, None, "a")}  # fmt: skip
    assert [a["key"] for a in res["arms"]] == list(want)
    for arm in res["arms"]:
        rank, sparsity, factor = want[arm["key"]]
        assert (arm["rank"], arm["sparsity"], arm["factor"]) == (rank, sparsity, factor)
        mem = lora_adapter_memory(shapes, rank, sparsity=sparsity, sparse_factor=factor,
                                  dtype=torch.float32)  # fmt: skip
        assert arm["adapter_bytes"] == mem.total_bytes
        assert arm["vs_budget"] == pytest.approx(mem.total_bytes / budget)
        if arm["key"] in ("squash_both", "squash_a"):  # the largest rank that fits
            assert mem.total_bytes <= budget
            bigger = lora_adapter_memory(shapes, rank + 1, sparsity=sparsity,
                                         sparse_factor=factor, dtype=torch.float32)  # fmt: skip
            assert bigger.total_bytes > budget
        assert f"| {arm['name']} | {rank} | {arm['vs_budget']:.2f}x |" in quick[0]


@pytest.mark.slow
def test_means_spreads_and_sweep_agree_with_per_seed_values(quick):
    md, res = quick
    rows = {line.split(" | ")[0][2:]: line for line in md.splitlines() if line.startswith("| ")}
    for arm in res["arms"]:
        losses, ems = arm["test_loss"], arm["test_em"]
        assert len(losses) == len(ems) == res["seeds"] >= 2
        assert arm["test_loss_mean"] == pytest.approx(statistics.fmean(losses))
        assert arm["test_loss_std"] == pytest.approx(statistics.stdev(losses))
        assert arm["test_em_mean"] == pytest.approx(statistics.fmean(ems))
        assert arm["test_em_std"] == pytest.approx(statistics.stdev(ems))
        # the best lr is the sweep's lowest validation loss; seed 0 at it is the sweep's run
        sweep = {float(lr): r for lr, r in arm["sweep"].items()}
        best = min(sweep, key=lambda lr: sweep[lr]["val"]["loss"])
        assert arm["best_lr"] == best
        assert losses[0] == sweep[best]["test"]["loss"]
        # a 2-point grid (1e-3, 1e-2) widened once: one grid step past the edge that held the
        # better of the two
        first = {1e-3: sweep[1e-3]["val"]["loss"], 1e-2: sweep[1e-2]["val"]["loss"]}
        added = 1e-4 if first[1e-3] <= first[1e-2] else 1e-1
        assert sorted(sweep) == pytest.approx(sorted([1e-3, 1e-2, added]))
        row = rows[arm["name"]]
        assert f"{arm['test_loss_mean']:.3f} +/- {arm['test_loss_std']:.3f}" in row
        assert f"{arm['test_em_mean']:.3f} +/- {arm['test_em_std']:.3f}" in row
        assert f"**{best:.1e}: {sweep[best]['val']['loss']:.3f}" in row
        assert row.count("**") == 2  # one best cell
        for value in (*losses, *(r["val"]["loss"] for r in sweep.values())):
            assert 0.0 < value < 20.0
        for value in (*ems, *(r["val"]["exact_match"] for r in sweep.values())):
            assert 0.0 <= value <= 1.0


@pytest.mark.slow
def test_data_and_reference_predictors(quick):
    md, res = quick
    sigma, records = res["sigma"], res["test_records"]
    assert sorted(sigma) == sorted(sigma.values()) and len(sigma) == 16  # a permutation
    assert len(records) == res["n_test"]
    inputs = set()
    reverse_only = 0
    for r in records:
        task, *letters = r["input"].split()
        assert task == "code:" and 3 <= len(letters) <= 6
        assert r["output"] == " ".join(sigma[c] for c in reversed(letters))
        reverse_only += r["output"] == " ".join(reversed(letters))
        inputs.add(r["input"])
    assert len(inputs) == len(records)  # no duplicate test inputs
    # the script's numbers come from one-hot logits through its own scorer
    assert res["reference"]["oracle"] == 1.0
    assert res["reference"]["reverse_only"] == reverse_only / len(records)
    assert f"reversal without the mapping {reverse_only / len(records):.3f}" in md


@pytest.mark.slow
def test_verdict_says_which_won(quick):
    md, res = quick
    by = {a["key"]: a for a in res["arms"]}
    q, s = by["qlora"], by["squash_both"]
    word = "beat" if s["test_loss_mean"] < q["test_loss_mean"] else "did not beat"
    assert f"Squash at equal memory (both factors 90% sparse, rank {s['rank']}) {word} QLoRA" in md
    best = min(res["arms"], key=lambda a: a["test_loss_mean"])
    assert f"Lowest test loss: {best['name']}" in md


def test_evaluate_scores_known_predictors(tmp_path):
    """The script's evaluation on models whose scores are known: uniform logits give loss
    ln(vocab) and no exact match; logits one-hot on the true next token give exact match 1; one
    wrong answer token in every other example halves it."""
    import math

    import quality as q

    sigma = q.make_sigma(1)
    seqs = q.make_splits(0, 0, 8, 0)["val"]
    path = q.write_json(tmp_path / "val.json", [q.record("code", s, sigma) for s in seqs])
    tok = q.tokenizer()
    samples = q.load_split(path, tok)
    vocab = tok.vocab_size

    class Fixed(torch.nn.Module):
        def __init__(self, spoil_every_other=False, uniform=False):
            super().__init__()
            self.spoil, self.uniform = spoil_every_other, uniform

        def forward(self, tokens):  # (b, s) -> (b, s, vocab)
            logits = torch.zeros(*tokens.shape, vocab)
            if self.uniform:
                return logits
            nxt = torch.cat((tokens[:, 1:], tokens[:, -1:]), dim=1)
            if self.spoil:  # the first answer token of even examples is wrong
                for i in range(0, tokens.shape[0], 2):
                    row = [s for s in samples if s["tokens"] == tokens[i][: len(s["tokens"])]
                           .tolist()][0]  # fmt: skip
                    first = next(j for j, m in enumerate(row["labels"]) if m != q.IGNORE) - 1
                    nxt[i, first] = (nxt[i, first] + 1) % vocab
            return logits.scatter(2, nxt.unsqueeze(-1), 50.0)

    uniform = q.evaluate(Fixed(uniform=True), samples)
    assert uniform["loss"] == pytest.approx(math.log(vocab), rel=1e-5)
    assert uniform["exact_match"] == 0.0
    oracle = q.evaluate(Fixed(), samples)
    assert oracle["exact_match"] == 1.0 and oracle["loss"] < 1e-6
    assert q.evaluate(Fixed(spoil_every_other=True), samples)["exact_match"] == 0.5
