"""benchmarks/quality_curves.py and its ``_plan`` and ``_report`` modules against independent
computations: the sweep's widening and the queue's order worked by hand, exact match against
greedy decoding, loss by hand, Welch's t against scipy, the report's means and spreads against
the per-seed values; and (smollm2, slow) a ``--quick`` run of every stage whose final points
equal a direct evaluation of the saved adapters by another scorer and by greedy decoding."""

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import quality_curves as qc
import quality_curves_plan as qp
import quality_curves_report as qr
import torch
from scipy import stats

REPO = Path(__file__).resolve().parents[2]


def record(arm, lr, seed, val, test=(1.0, 0.0), frac=1.0, steps=200, losses=None):
    """A finished run's record with a final validation loss ``val``; ``losses`` the test losses
    at every point (default: ``test[0]`` at the last)."""
    points = []
    pts = losses or [test[0]]
    for i, lo in enumerate(pts):
        step = steps * (i + 1) // len(pts)
        points.append({"step": step, "val": {"loss": val, "exact_match": 0.0},
                       "test": {"loss": lo, "exact_match": test[1]}})  # fmt: skip
    arms = qp.arms(steps)
    return {"id": qp.run_id(arm, lr, seed, frac), "arm": arms[arm], "lr": lr, "seed": seed,
            "frac": frac, "points": points, "done": True, "sessions": []}  # fmt: skip


def done_of(*recs):
    return {r["id"]: r for r in recs}


# ---- the queue ------------------------------------------------------------------------------
def test_sweep_widens_past_an_edge_and_stops_inside():
    grid = [1e-3, 3e-3, 1e-2]
    assert qp.sweep_state({}, "qlora_r16", grid) == (grid, None)
    # best at the high edge: widen to 3e-2
    d = done_of(*(record("qlora_r16", lr, 0, v) for lr, v in zip(grid, [1.3, 1.2, 1.1])))
    assert qp.sweep_state(d, "qlora_r16", grid) == ([3e-2], None)
    # 3e-2 worse: 1e-2 is inside the grid now
    d.update(done_of(record("qlora_r16", 3e-2, 0, 1.15)))
    assert qp.sweep_state(d, "qlora_r16", grid) == ([], 1e-2)
    # best at the low edge twice: widened twice (1e-4 is two ladder steps down), then stops
    d = done_of(*(record("squash", lr, 0, v) for lr, v in zip(grid, [1.0, 1.2, 1.3])))
    assert qp.sweep_state(d, "squash", grid) == ([3e-4], None)
    d.update(done_of(record("squash", 3e-4, 0, 0.9)))
    assert qp.sweep_state(d, "squash", grid) == ([1e-4], None)
    d.update(done_of(record("squash", 1e-4, 0, 0.8)))
    assert qp.sweep_state(d, "squash", grid) == ([], 1e-4)  # still at the edge: max_widen spent


def test_plan_orders_the_stages():
    grid = qp.FIRST_GRID
    p = qp.plan("unicode", {})
    assert [q[0] for q in p] == sorted(q[0] for q in p)  # stages in order
    assert [(q[2], q[3]) for q in p if q[0] == 0] == [
        (a, lr) for lr in grid for a in ("qlora_r16", "squash")]  # interleaved sweeps
    assert {q[0] for q in p} == {0, 2}  # no seeds, quarter data or levers before a best lr
    d = done_of(*(record(a, lr, 0, v) for a in ("qlora_r16", "squash")
                  for lr, v in zip(grid, [1.2, 1.1, 1.3])))  # fmt: skip
    p = qp.plan("unicode", d)
    seeds = [(q[2], q[3], q[4]) for q in p if q[0] == 1]
    assert seeds == [("qlora_r16", 3e-3, 1), ("qlora_r16", 3e-3, 2), ("squash", 3e-3, 1),
                     ("squash", 3e-3, 2)]  # fmt: skip
    quarter = [(q[2], q[4], q[5]) for q in p if q[0] == 3]
    assert quarter == [(a, s, 0.25) for a in ("qlora_r16", "squash") for s in (0, 1, 2)]
    assert [q[2] for q in p if q[0] == 4] == qp.LEVERS and {q[3] for q in p if q[0] == 4} == {3e-3}
    assert not [q for q in qp.plan("pydocs", d) if q[0] == 4]  # levers on the first task only
    bases = [(q[2], q[3], q[4]) for q in p if q[0] == 5]  # every seed, at the method's best lr,
    assert bases == [(a, 3e-3, s) for s in (0, 1, 2) for a in qp.BASES]  # seed by seed
    assert not [q for q in qp.plan("pydocs", d) if q[0] == 5]


def test_base_arms_change_only_the_base():
    a = qp.arms(200)
    size = dict(qp.FULL)

    def model(key):
        return qp.recipe_config("unicode", a[key], 1e-3, 0, 1.0, Path("/x"), Path("/c"), size,
                                885, "cpu", "fp32", False)["model"]  # fmt: skip

    for method in ("qlora_r16", "squash"):
        nf4, fp32, out = model(method), model(f"{method}_fp32"), model(f"{method}_outliers")
        assert fp32 == {**nf4, "quantize_base": False}
        assert out == {**nf4, "base_outliers": {"fraction": 0.01, "criterion": "sensitivity"}}
        assert a[f"{method}_fp32"]["adapter_bytes"] == a[method]["adapter_bytes"]


@pytest.mark.slow
def test_base_bytes_by_hand():
    """SmolLM2-135M's frozen bytes: fp32 is its 134,515,008 parameters (embeddings 49152 x 576,
    30 layers of q/o 576x576, k/v 576x192, three MLP 576x1536, two norms, the final norm) at 4
    bytes; the outliers add, per layer, out x k x (2-byte value + 2-byte index) with
    k = round(1% of in_features): 6 for the six 576-wide inputs, 15 for w2's 1536."""
    layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576
    assert qr.base_bytes("qlora_r16_fp32") == 4 * (49152 * 576 + 30 * layer + 576)
    s_layer = 4 * (6 * (576 + 192 + 192 + 576 + 1536 + 1536) + 15 * 576)
    assert qr.base_bytes("squash_outliers") - qr.base_bytes("squash") == 30 * s_layer
    assert qr.base_bytes("qlora_r16") == qr.base_bytes("squash")  # the same NF4 base


def test_arms_at_equal_memory():
    a = qp.arms(200)
    assert (a["squash"]["rank"], a["squash_a"]["rank"], a["lora_dense"]["rank"]) == (143, 28, 143)
    for key, arm in a.items():  # every squash arm within QLoRA r=16's bytes
        if arm.get("sparsity") is not None:
            assert 0.98 < arm["vs_qlora_r16"] <= 1.0, key
    assert a["squash"]["mask_update"] == {"every_n_steps": 10, "drop_fraction": 0.3,
                                          "until_step": 150}  # fmt: skip
    assert a["squash_rslora"]["alpha"] / 143 == pytest.approx(8 / math.sqrt(143))


def test_config_epochs_cover_the_steps():
    arm = qp.arms(200)["squash"]
    size = dict(qp.FULL)
    for n_train, frac, epochs, per in ((885, 1.0, 2, 100), (885, 0.25, 8, 25), (824, 1.0, 2, 100),
                                       (824, 0.25, 8, 25)):  # fmt: skip
        cfg = qp.recipe_config("unicode", arm, 1e-3, 0, frac, Path("/x"), Path("/c"), size, n_train,
                               "cpu", "fp32", False)  # fmt: skip
        assert (cfg["epochs"], cfg["max_steps_per_epoch"]) == (epochs, per)
        assert cfg["dataset"].get("max_samples") == (None if frac == 1 else round(n_train / 4))


# ---- scoring --------------------------------------------------------------------------------
def greedy(table, start, limit):
    """Greedy decoding over a fixed next-token table from position ``start``."""
    return [int(table[p]) for p in range(start, min(limit, len(table)))]


@pytest.mark.parametrize("task", ["unicode", "pydocs"])
def test_exact_match_is_greedy_decoding(task):
    """A row matches iff greedy decoding from the prompt returns the metric's tokens: the whole
    answer up to its stop token (unicode), the first ``required`` tokens (pydocs)."""
    vocab, stop, s = 6, 5, 8
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(300):
        table = torch.randint(0, vocab, (s,), generator=g)
        n_prompt = int(torch.randint(1, 3, (), generator=g))
        n_ans = int(torch.randint(2, s - n_prompt, (), generator=g))
        ans = torch.randint(0, vocab, (n_ans,), generator=g).tolist()
        if task == "unicode":
            ans[-1] = stop
            tok = type("Tok", (), {"stop_tokens": [stop]})()
            labels = [qc.IGNORE] * n_prompt + ans + [qc.IGNORE] * (s - n_prompt - n_ans)
            required = qc.required_tokens("unicode", {"labels": labels}, "", tok)
        else:
            required = int(torch.randint(1, n_ans + 1, (), generator=g))
            labels = [qc.IGNORE] * n_prompt + ans + [qc.IGNORE] * (s - n_prompt - n_ans)
        # position t's logits predict labels[t + 1]; greedy starts at the prompt's last position
        table[torch.randint(0, s, (1,), generator=g)] = ans[0]  # some rows match
        logits = torch.nn.functional.one_hot(table, vocab).float()[None] * 4.0
        out = greedy(table, n_prompt - 1, s)
        want = out[:required] == ans[:required]
        _, _, hits = qc.score_batch(logits, torch.tensor([labels]), [required])
        assert hits == [want]
        seen.add(want)
    assert seen == {True, False}


def test_loss_by_hand():
    logits = torch.tensor([[[0.0, 1.0, 2.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])
    labels = torch.tensor([[qc.IGNORE, 2, 0]])
    ce, n, hits = qc.score_batch(logits, labels, [1])
    lse0, lse1 = math.log(1 + math.e + math.e**2), math.log(math.e + 2)
    assert ce == pytest.approx((lse0 - 2.0) + (lse1 - 1.0)) and n == 2 and hits == [True]


def test_loss_against_float64_at_a_real_vocabulary():
    """Summed answer-token loss over SmolLM2's 49,152-token vocabulary within 1e-5 nats a token
    of a float64 computation (the class-dimension layout of ``cross_entropy`` is off by about
    4.5e-5 here)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 100, 49152) * 5
    labels = torch.randint(0, 49152, (2, 100))
    labels[:, :10] = qc.IGNORE
    ce, n, _ = qc.score_batch(logits, labels, [1, 1])
    lp = torch.log_softmax(logits[:, :-1].double(), -1)
    t = labels[:, 1:]
    ref = -lp.gather(-1, t.clamp(min=0)[..., None])[..., 0][t != qc.IGNORE].sum()
    assert n == 2 * 90 and abs(ce - float(ref)) / n < 1e-5


def test_welch_against_scipy():
    a, b = [1.71, 1.75, 1.69], [1.73, 1.78, 1.81]
    w = qr.welch(a, b)
    ref = stats.ttest_ind(a, b, equal_var=False)
    assert w["t"] == pytest.approx(ref.statistic) and w["p"] == pytest.approx(ref.pvalue)
    assert math.isnan(qr.welch([1.0], b)["t"]) and math.isnan(qr.welch([1.0, 1.0], [2.0, 2.0])["t"])


def test_report_numbers_from_per_seed_values(tmp_path):
    grid = qp.FIRST_GRID
    recs = [record("qlora_r16", lr, 0, v, (t, 0.1)) for lr, v, t in
            zip(grid, [1.2, 1.1, 1.3], [1.5, 1.4, 1.6])]  # fmt: skip
    recs += [record("qlora_r16", 3e-3, s, 9.0, (t, e)) for s, t, e in ((1, 1.45, 0.2), (2, 1.38, 0.3))]
    recs += [record("squash", 3e-3, s, 1.0, (t, e)) for s, t, e in
             ((0, 1.30, 0.3), (1, 1.33, 0.25), (2, 1.28, 0.4))]  # fmt: skip
    text, groups = qr.task_report("unicode", recs, dict(qp.FULL))
    q, sq = groups[("qlora_r16", 1.0)], groups[("squash", 1.0)]
    assert q["best"] == 3e-3 and [r["seed"] for r in q["seeds"]] == [0, 1, 2]
    row = next(line for line in text if line.startswith("| squash r=143"))
    ql, sl = [1.4, 1.45, 1.38], [1.30, 1.33, 1.28]
    assert f"{statistics.fmean(sl):.3f} +/- {statistics.stdev(sl):.3f}" in row
    ref = stats.ttest_ind(sl, ql, equal_var=False)
    assert f"{ref.statistic:+.2f}" in row and f"p={ref.pvalue:.3g}" in row
    em = stats.ttest_ind([0.3, 0.25, 0.4], [0.1, 0.2, 0.3], equal_var=False)
    assert f"{em.statistic:+.2f}" in row
    qrow = next(line for line in text if line.startswith("| QLoRA r=16 |"))
    assert "**3e-03: 1.100**" in qrow and "1e-03: 1.200" in qrow
    assert sq["best"] == 3e-3


def test_report_at_each_seeds_best_validation_point():
    """The early-stopping table keeps, per seed, the point of lowest validation loss after step 0
    (the earliest of equals) and compares those test values with Welch's t (scipy)."""

    def rec(arm, seed, vals, tests):
        r = record(arm, 3e-3, seed, 0.0)
        r["points"] = [{"step": 50 * i, "val": {"loss": v, "exact_match": 0.0},
                        "test": {"loss": t, "exact_match": 0.1 * i}}
                       for i, (v, t) in enumerate(zip(vals, tests))]  # fmt: skip
        return r

    q = [rec("qlora_r16", 0, [3.0, 1.0, 2.0, 2.0, 2.0], [3.0, 1.5, 1.7, 1.8, 1.9]),
         rec("qlora_r16", 1, [3.0, 2.0, 1.0, 1.0, 2.0], [3.0, 1.6, 1.45, 1.2, 1.9])]
    sq = [rec("squash", 0, [0.5, 2.0, 2.0, 2.0, 1.0], [1.0, 1.5, 1.7, 1.8, 1.4]),
          rec("squash", 1, [3.0, 2.0, 2.0, 0.9, 0.95], [3.0, 1.6, 1.45, 1.3, 1.2])]
    assert [qr.best_point(r)["step"] for r in q + sq] == [50, 100, 200, 150]  # step 0 never kept
    text, _ = qr.task_report("unicode", q + sq, dict(qp.FULL))
    i = text.index(next(line for line in text if line.startswith("At each seed's best")))
    row = next(line for line in text[i:] if line.startswith("| squash r=143"))
    assert "| 200, 150 |" in row and f"{statistics.fmean([1.4, 1.3]):.3f} +/- " in row
    ref = stats.ttest_ind([1.4, 1.3], [1.5, 1.45], equal_var=False)
    assert f"{ref.statistic:+.2f}" in row and f"p={ref.pvalue:.3g}" in row
    qrow = next(line for line in text[i:] if line.startswith("| QLoRA r=16 |"))
    assert "| 50, 100 |" in qrow


def test_report_base_section_by_hand(monkeypatch):
    """Each method on NF4, NF4 + outliers and fp32: means, Welch's t against the same method on
    NF4 (scipy) and the gap closed worked by hand; the base arms stay out of the main table."""
    monkeypatch.setattr(qr, "base_bytes", lambda key: {"fp32": 8, "outliers": 5}.get(
        key.rsplit("_", 1)[-1], 4) * 1024**2)  # fmt: skip
    nf4, out, fp32 = [1.30, 1.34, 1.32], [1.20, 1.26, 1.22], [1.10, 1.12, 1.14]
    recs = [record("qlora_r16", 3e-3, i, 1.0, (t, 0.1)) for i, t in enumerate(nf4)]
    recs += [record("qlora_r16_outliers", 3e-3, i, 1.0, (t, 0.2)) for i, t in enumerate(out)]
    recs += [record("qlora_r16_fp32", 3e-3, i, 1.0, (t, 0.3)) for i, t in enumerate(fp32)]
    text, _ = qr.task_report("unicode", recs, dict(qp.FULL))
    i = text.index(next(line for line in text if line.startswith("The base under the fine-tune")))
    assert not [line for line in text[:i] if "outliers" in line or "fp32 base" in line]
    row = next(line for line in text[i:] if "| NF4 + 1% outliers |" in line)
    gap = (statistics.fmean(nf4) - statistics.fmean(out)) / (
        statistics.fmean(nf4) - statistics.fmean(fp32))
    ref = stats.ttest_ind(out, nf4, equal_var=False)
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[:5] == ["QLoRA r=16", "NF4 + 1% outliers", "5.0",
                         f"{qp.arms(200)['qlora_r16']['adapter_bytes'] / 1024**2:.1f}", "3"]
    assert cells[5] == f"{statistics.fmean(out):.3f} +/- {statistics.stdev(out):.3f}"
    assert cells[7].startswith(f"{ref.statistic:+.2f}") and cells[8] == f"{gap:.0%}" == "47%"  # 0.0933 / 0.2
    nrow = next(line for line in text[i:] if "| NF4 |" in line)
    assert [c.strip() for c in nrow.split("|")[1:-1]][7:9] == ["", ""]  # NF4 is the reference
    frow = next(line for line in text[i:] if "| fp32 |" in line)
    assert [c.strip() for c in frow.split("|")[1:-1]][2] == "8.0"


def test_report_writes_a_png_per_task_and_copies_it_to_png_dir(tmp_path):
    """``report --png-dir DIR``: the PNG beside the results, and the same bytes as
    ``DIR/quality_curves_<task>.png`` (where the README shows it)."""
    pytest.importorskip("matplotlib")
    res = tmp_path / "res"
    (res / "unicode").mkdir(parents=True)
    recs = [record("qlora_r16", 3e-3, s, 1.0, (t, e), losses=[2.0, t]) for s, t, e in
            ((0, 1.45, 0.2), (1, 1.38, 0.3))]  # fmt: skip
    recs += [record("squash", 3e-3, s, 1.0, (t, e), losses=[1.9, t]) for s, t, e in
             ((0, 1.30, 0.3), (1, 1.33, 0.25))]  # fmt: skip
    for r in recs:
        (res / "unicode" / f"{r['id']}.json").write_text(json.dumps(r))
    text = qr.report(res, ["unicode"], dict(qp.FULL, steps=200), png_dir=tmp_path / "docs")
    assert "![unicode](unicode.png)" in text
    png = (res / "unicode.png").read_bytes()
    assert len(png) > 10_000 and (tmp_path / "docs" / "quality_curves_unicode.png").read_bytes() == png


# ---- a quick run of every stage on the real model -------------------------------------------
@pytest.mark.slow
@pytest.mark.smollm2
def test_quick_run_of_every_stage(smollm2_checkpoint, tmp_path):
    res, work = tmp_path / "res", tmp_path / "work"
    cmd = [sys.executable, str(REPO / "benchmarks" / "quality_curves.py"), "work", "--quick",
           "--checkpoint-dir", str(smollm2_checkpoint), "--results", str(res), "--work",
           str(work), "--keep-checkpoints", "--threads", "2"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{REPO / 'recipes'}")
    proc = subprocess.run(cmd + ["--tasks", "unicode"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = subprocess.run(cmd + ["--tasks", "pydocs", "--max-runs", "1"], capture_output=True,
                          text=True, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    size = dict(qp.QUICK)
    done = qp.load_done(res / "unicode", size["steps"])
    assert not [q for q in qp.plan("unicode", done, quick=True) if q[1] not in done]  # all ran
    stages = {r["arm"]["key"] for r in done.values()}
    assert set(qp.QUICK_LEVERS) <= stages and {"squash_a", "lora_dense"} <= stages
    assert set(qp.QUICK_BASES) <= stages  # an fp32 base and a corrected one through the recipe
    assert any(r["frac"] == 0.25 for r in done.values())
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "quality_curves.py"),
                           "report", "--quick", "--results", str(res)], capture_output=True,
                          text=True, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (res / "unicode.png").stat().st_size > 10_000 and (res / "README.md").is_file()

    # the last point of a run equals a direct evaluation of its saved adapter
    for task, arm in (("unicode", "squash"), ("pydocs", "qlora_r16")):
        rec = next(r for r in qp.load_records(res / task) if r["arm"]["key"] == arm)
        direct = evaluate_saved(task, rec, work / "runs" / task / rec["id"], smollm2_checkpoint,
                                size)  # fmt: skip
        last = qp.final(rec)["test"]
        assert direct["loss"] == pytest.approx(last["loss"], rel=1e-5)
        assert direct["exact_match"] == last["exact_match"]


def evaluate_saved(task, rec, run_dir, ckpt, size):
    """Load a run's newest adapter into a freshly built model and score the test split by other
    code: quality_smollm2's scorer (unicode) or greedy decoding of the first sentence
    (pydocs)."""
    from omegaconf import OmegaConf
    from torchtune import training

    from squash.assembly.model_setup import setup_frozen_model
    from squash.models.smollm2 import smollm2_tokenizer
    from squash.runs.checkpoint import latest_checkpoint, load_adapter_into, load_squash_adapter

    cfg = qp.recipe_config(task, rec["arm"], rec["lr"], rec["seed"], rec["frac"], run_dir, ckpt,
                           size, 10, "cpu", "fp32", False)  # fmt: skip
    base = training.FullModelHFCheckpointer(str(ckpt), ["model.safetensors"], "LLAMA3_2",
                                            str(run_dir / "unused"))  # fmt: skip
    model_cfg = OmegaConf.create(cfg["model"])
    model_cfg.pop("init", None)
    model = setup_frozen_model(model_cfg, base.load_checkpoint()["model"], device=torch.device("cpu"),
                               dtype=torch.float32)  # fmt: skip
    path = latest_checkpoint(run_dir)
    load_adapter_into(model, load_squash_adapter(path), path)
    tok = smollm2_tokenizer(str(ckpt), max_seq_len=qp.TASKS[task]["max_seq_len"])
    samples = qc.load_split(task, tok, "test", size["n_test"])
    if task == "unicode":
        import quality_smollm2 as qs

        return qs.evaluate(model, [{k: s[k] for k in ("tokens", "labels")} for s in samples],
                           pad_id=tok.pad_id, stop_tokens=list(tok.stop_tokens), device="cpu")  # fmt: skip
    ce = n = hits = 0
    with torch.no_grad():
        for s in samples:
            tokens, labels = torch.tensor([s["tokens"]]), s["labels"]
            logits = model(tokens)[0]
            first = next(i for i, t in enumerate(labels) if t != qc.IGNORE)
            ans = torch.tensor(labels[first:])
            ce += torch.nn.functional.cross_entropy(logits[first - 1 : -1], ans, reduction="sum")
            n += len(ans)
            seq = s["tokens"][:first]  # greedy decoding, one token at a time, no teacher forcing
            for _ in range(s["required"]):
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
            hits += seq[first:] == labels[first : first + s["required"]]
    return {"loss": float(ce) / n, "exact_match": hits / len(samples)}
