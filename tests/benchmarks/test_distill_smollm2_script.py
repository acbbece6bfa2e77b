"""benchmarks/distill_smollm2.py (``benchmarks/distill.py --model smollm2``) against independent
computations: the gap fraction, means and spreads by hand from per-seed values, Welch's t against
scipy, the recipe config against the recipe's own key checks; the perplexity against
transformers' ``LlamaForCausalLM`` loss on the same windows (smollm2); and one tiny ``--quick``
run on the real checkpoint (smollm2, slow) whose table is recomputed from its json."""

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import distill_smollm2 as d
import pytest
import torch
from scipy import stats

REPO = Path(__file__).resolve().parents[2]


def test_gap_closed_by_hand():
    # teacher 18, NF4 25: a gap of 7; a student at 21 is 3 above the teacher, 4/7 closed
    assert d.gap_closed(21.0, 18.0, 25.0) == pytest.approx(4 / 7)
    assert d.gap_closed(18.0, 18.0, 25.0) == 1.0 and d.gap_closed(25.0, 18.0, 25.0) == 0.0
    assert d.gap_closed(26.0, 18.0, 25.0) == pytest.approx(-1 / 7)  # worse than NF4
    assert math.isnan(d.gap_closed(20.0, 18.0, 18.0))  # no gap


def _test(ppls):
    return [{"perplexity": p, "loss": math.log(p), "tokens": 100} for p in ppls]


def test_summary_from_per_seed_values():
    arm = dict(key="kl", name="KL alone", weights=(0, 1, 0))
    sw = {1e-3: {"val": {"perplexity": 30.0, "loss": math.log(30.0)}, "test": _test([20.0])[0],
                 "setup_s": 1.0}}  # fmt: skip
    row = d.summarize(arm, sw, 1e-3, True, _test([20.0, 21.0, 22.0]), [0, 1, 2], 18.0, 25.0)
    assert row["ppl_mean"] == pytest.approx(21.0)
    assert row["ppl_std"] == pytest.approx(1.0)  # sqrt((1 + 0 + 1) / 2)
    assert row["gap_closed"] == pytest.approx(1 - 3 / 7)
    assert row["gap_closed_seeds"] == pytest.approx([1 - 2 / 7, 1 - 3 / 7, 1 - 4 / 7])
    assert row["gap_closed_std"] == pytest.approx(1 / 7)
    assert row["test_loss"] == pytest.approx([math.log(20), math.log(21), math.log(22)])
    assert row["sweep"] == {"0.001": {"val": sw[1e-3]["val"], "test": sw[1e-3]["test"]}}
    assert not row["swept"] and row["best_at_edge"]


def test_kl_columns_from_per_seed_values():
    arm = dict(key="kl", name="KL alone", weights=(0, 1, 0))
    test = [dict(t, kl=k) for t, k in zip(_test([20.0, 21.0]), (0.10, 0.14))]
    row = d.summarize(arm, {}, 1e-3, False, test, [0, 1], 18.0, 25.0, nf4_kl=0.4)
    assert row["kl_mean"] == pytest.approx(0.12)
    assert row["kl_std"] == pytest.approx(math.sqrt(2 * 0.02**2))
    assert row["kl_closed"] == pytest.approx(1 - 0.12 / 0.4)  # 70% of NF4's divergence removed
    assert "kl_mean" not in d.summarize(arm, {}, 1e-3, False, _test([20.0]), [0], 18.0, 25.0)


class FixedLogits(torch.nn.Module):
    """A "model" whose logits at each position are a fixed function of the token there."""

    def __init__(self, table):
        super().__init__()
        self.table = table  # (vocab, vocab)
        self.output_hidden_states = [3]

    def forward(self, tokens):
        return [self.table[tokens][:, :2], self.table[tokens][:, 2:]]  # chunked, as the recipe's


def test_perplexity_and_kl_by_hand():
    torch.manual_seed(0)
    student, teacher = FixedLogits(torch.randn(5, 5)), FixedLogits(torch.randn(5, 5))
    samples = [{"tokens": t, "labels": t} for t in ([0, 3, 1, 4], [2, 2, 0, 1], [4, 1, 3, 3])]
    ref = d.reference_log_probs(teacher, samples, device="cpu", batch=2)
    got = d.perplexity(student, samples, device="cpu", batch=2, reference=ref)
    nll, kl, n = 0.0, 0.0, 0
    for s in samples:
        for here, nxt in zip(s["tokens"], s["tokens"][1:]):  # each position predicts the next
            ps = torch.softmax(student.table[here], -1)
            pt = torch.softmax(teacher.table[here], -1)
            nll -= math.log(ps[nxt])
            kl += float((pt * (pt / ps).log()).sum())
            n += 1
    assert got["tokens"] == n == 9
    assert got["loss"] == pytest.approx(nll / n) and got["perplexity"] == pytest.approx(math.exp(nll / n))
    assert got["kl"] == pytest.approx(kl / n)
    assert student.output_hidden_states == [3] and student.training  # restored
    assert d.perplexity(teacher, samples, device="cpu", reference=ref)["kl"] == pytest.approx(0, abs=1e-7)
    with pytest.raises(ValueError, match="labels == tokens"):
        d.perplexity(student, [{"tokens": [1, 2], "labels": [-100, 2]}], device="cpu")


def _row(key, ppls, lr=3e-3):
    arm = {a["key"]: a for a in d.ARMS}[key]
    return d.summarize(arm, {}, lr, False, _test(ppls), list(range(len(ppls))), 18.0, 25.0)


def test_comparisons_and_table_from_per_seed_values():
    rows = [_row("ce", [23.0, 23.4, 22.9]), _row("kl", [20.0, 21.0, 22.0]),
            _row("sh_kl", [20.5, 20.9, 21.2])]  # fmt: skip
    cmp = {(c["arm"], c["against"]): c for c in d.comparisons(rows)}
    assert sorted(cmp) == [("kl", "ce"), ("sh_kl", "ce"), ("sh_kl", "kl")]  # no SH-alone row
    ref = stats.ttest_ind([20.5, 20.9, 21.2], [20.0, 21.0, 22.0], equal_var=False)
    c = cmp[("sh_kl", "kl")]
    assert c["ppl_diff"] == pytest.approx((20.5 + 20.9 + 21.2) / 3 - 21.0)
    assert c["welch"]["t"] == pytest.approx(ref.statistic)
    assert c["welch"]["p"] == pytest.approx(ref.pvalue)
    res = dict(
        teacher={"val": {"perplexity": 19.0}, "test": {"perplexity": 18.0, "tokens": 1000}},
        nf4={"val": {"perplexity": 26.0}, "test": {"perplexity": 25.0}}, dtype="fp32",
        device="cpu", steps=24, batch=4, seq_len=256, grid=[1e-3, 3e-3], max_widen=1, seeds=3,
        corpus=dict(source="s", windows=dict(train=300, validation=40, test=45)),
        student=dict(lora_rank=143, sparsity=0.9, mask_updates=1), machine="m", wall_s=60.0,
        arms=rows, comparisons=d.comparisons(rows),
    )  # fmt: skip
    md = d.markdown(res)
    assert "teacher **18.000**, NF4 student before training **25.000** (gap 7.000)" in md
    # KL alone: mean 21, sample std 1, (21 - 18) / 7 of the gap left: 57% closed, spread 1/7
    assert "| KL alone | 0, 1, 0 | not swept | 3e-03 (fixed) | 21.000 +/- 1.000 | 57% +/- 14 |" in md
    assert "| plain CE | 1, 0, 0 |" in md and "| 23.100 +/- 0.265 | 27% +/- 4 |" in md
    assert f"| SquareHead + KL | KL alone | {(20.5 + 20.9 + 21.2) / 3 - 21:+.3f} |" in md
    assert "Lowest test perplexity (the most of the NF4 gap closed): SquareHead + KL, 20.867" in md


def test_recipe_config_is_the_yaml_with_the_arm(tmp_path):
    from omegaconf import OmegaConf

    yaml = OmegaConf.load(REPO / "configs" / "smollm2_135m_distill.yaml")
    size = dict(d.FULL, steps=20, batch=3, seq_len=128)
    arm = {a["key"]: a for a in d.ARMS}["sh_kl"]
    cfg = d.recipe_config(arm, 3e-3, 2, tmp_path / "run", tmp_path / "ckpt", size, "cpu", "fp32")
    assert (cfg.task_weight, cfg.kd_weight, cfg.squarehead_weight) == (0.0, 1.0, 1.0)
    assert cfg.optimizer.lr == 3e-3 and cfg.seed == 2 and cfg.batch_size == 3
    assert cfg.max_steps_per_epoch == 20 and cfg.epochs == 1
    assert cfg.dataset == {"_component_": "squash.datasets.pydoc_text_dataset", "split": "train",
                           "max_seq_len": 128}  # fmt: skip
    assert "heldout" not in cfg and cfg.mask_update.until_step == 15
    assert cfg.checkpointer.checkpoint_dir == str(tmp_path / "ckpt")
    assert cfg.teacher_checkpointer.output_dir == str(tmp_path / "run" / "teacher")
    assert cfg.model == yaml.model and cfg.teacher == yaml.teacher  # the student of the YAML
    # the recipe's own key and value checks accept it
    sys.path.insert(0, str(REPO / "recipes"))
    from squash_distill import SquashDistillRecipeSingleDevice

    SquashDistillRecipeSingleDevice(cfg=cfg)


@pytest.mark.smollm2
def test_perplexity_is_transformers_loss(smollm2_checkpoint, tmp_path):
    """exp(mean NLL) of the teacher (the torchtune model squash builds) on a few held-out
    windows, against exp(loss) of transformers' LlamaForCausalLM on the same windows."""
    import torch
    from transformers import LlamaForCausalLM

    from squash.datasets import pydoc_text_dataset
    from squash.models.smollm2 import smollm2_tokenizer

    tok = smollm2_tokenizer(str(smollm2_checkpoint))
    ds = pydoc_text_dataset(tok, split="test", max_seq_len=64, max_windows=3)
    samples = [ds[i] for i in range(len(ds))]
    size = dict(d.QUICK, seq_len=64)
    cfg = d.recipe_config(d.ARMS[0], 1e-3, 0, tmp_path, smollm2_checkpoint, size, "cpu", "fp32")
    teacher = d.build_teacher(cfg, torch.device("cpu"), torch.float32)
    got = d.perplexity(teacher, samples, device="cpu", batch=2)
    assert got["tokens"] == 3 * 63
    hf = LlamaForCausalLM.from_pretrained(str(smollm2_checkpoint), dtype=torch.float32)
    ids = torch.tensor([s["tokens"] for s in samples])
    with torch.no_grad():
        loss = hf(input_ids=ids, labels=ids).loss  # mean over the 3 x 63 shifted tokens
    assert got["loss"] == pytest.approx(float(loss), rel=1e-4)
    assert got["perplexity"] == pytest.approx(math.exp(float(loss)), rel=1e-4)


@pytest.mark.smollm2
@pytest.mark.slow
def test_quick_run_on_smollm2(smollm2_checkpoint, tmp_path):
    out = tmp_path / "d.md"
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "distill.py"), "--model", "smollm2", "--quick",
         "--checkpoint-dir", str(smollm2_checkpoint), "--arms", "kl,sh_kl", "--lrs", "1e-2",
         "--out", str(out)],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    md, res = out.read_text(), json.loads(out.with_suffix(".json").read_text())
    t, q = res["teacher"]["test"]["perplexity"], res["nf4"]["test"]["perplexity"]
    for split in ("val", "test"):  # perplexity = exp(loss) as it says
        assert res["teacher"][split]["perplexity"] == pytest.approx(
            math.exp(res["teacher"][split]["loss"]))
    assert [a["key"] for a in res["arms"]] == ["kl", "sh_kl"]
    for a in res["arms"]:
        assert len(a["test_ppl"]) == 2
        m = statistics.fmean(a["test_ppl"])
        assert a["ppl_mean"] == pytest.approx(m)
        assert a["ppl_std"] == pytest.approx(statistics.stdev(a["test_ppl"]))
        assert a["test_ppl"] == pytest.approx([math.exp(x) for x in a["test_loss"]])
        assert a["gap_closed"] == pytest.approx(1 - (m - t) / (q - t))
        # one lr (the sweep's choice by validation is quality.py's sweep, tested with it)
        assert a["best_lr"] == 1e-2 and a["sweep"] == {} and not a["swept"]
        assert f"| {a['ppl_mean']:.3f} +/- {a['ppl_std']:.3f} |" in md
        assert f"| {100 * (1 - (m - t) / (q - t)):.0f}% +/-" in md
        k = statistics.fmean(a["test_kl"])
        assert a["kl_closed"] == pytest.approx(1 - k / res["nf4"]["test"]["kl"])
        assert f"| {k:.4f} +/- {statistics.stdev(a['test_kl']):.4f} |" in md
    # every run is in the log, each arm's seed 0 and 1 at 1e-2
    assert [(r["key"], r["lr"], r["seed"]) for r in res["runs"]] == [
        ("kl", 1e-2, 0), ("kl", 1e-2, 1), ("sh_kl", 1e-2, 0), ("sh_kl", 1e-2, 1)]
    assert [r["test"]["perplexity"] for r in res["runs"]] == res["arms"][0]["test_ppl"] + res[
        "arms"][1]["test_ppl"]
    (c,) = res["comparisons"]
    ref = stats.ttest_ind(res["arms"][1]["test_ppl"], res["arms"][0]["test_ppl"], equal_var=False)
    assert c["welch"]["t"] == pytest.approx(ref.statistic, nan_ok=True)
    assert f"teacher **{t:.3f}**, NF4 student before training **{q:.3f}**" in md
    assert res["teacher"]["test"]["kl"] == pytest.approx(0, abs=1e-6)  # against its own cache
