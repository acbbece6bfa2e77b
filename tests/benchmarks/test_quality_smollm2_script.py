"""benchmarks/quality_smollm2.py's arithmetic against independent computations: the ranks at equal
memory counted by hand from SmolLM2's shapes, the exact-match rule against greedy decoding's
definition, Welch's t against scipy, means and spreads against the per-seed values; and one tiny
``--quick`` run on the real checkpoint (smollm2, slow) whose table agrees with its per-seed
values."""

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import quality_smollm2 as q
import torch
from scipy import stats

REPO = Path(__file__).resolve().parents[2]


def hand_bytes(rank, sparsity, factor, elem):
    """Adapter + grad + 2 AdamW moments at ``elem`` bytes, 4-byte step per tensor, int16 indices
    (every width here is < 32768), for SmolLM2's 30 x (q, k, v, o, w1, w2, w3)."""
    layer = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (1536, 576), (576, 1536)]
    total = 0
    for d_in, d_out in layer * 30:
        for rows, width, sparse in ((rank, d_in, factor in ("a", "both")),
                                    (d_out, rank, factor in ("b", "both"))):  # fmt: skip
            if sparsity is not None and sparse:
                k = max(1, min(width, round((1 - sparsity) * width)))
                total += rows * k * 4 * elem + rows * k * 2
            else:
                total += rows * width * 4 * elem
            total += 4
    return total


def test_shapes_are_smollm2_linears():
    shapes = q.adapted_shapes()
    assert len(shapes) == 7 * 30
    # parameters of the seven linears per layer, from the model card's sizes
    per_layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536
    assert sum(i * o for i, o in shapes) == 30 * per_layer


@pytest.mark.parametrize("dtype,elem", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_ranks_at_equal_memory_by_hand(dtype, elem):
    by = {a["key"]: a for a in q.arms(0.9, dtype)}
    for key, budget_rank, factor in (("squash_both_eq16", 16, "both"),
                                     ("squash_both_eq8", 8, "both"), ("squash_a_eq16", 16, "a")):  # fmt: skip
        budget = hand_bytes(budget_rank, None, "a", elem)
        r = by[key]["rank"]
        # the largest rank that fits, by linear search on the hand count
        want = max(x for x in range(1, 400) if hand_bytes(x, 0.9, factor, elem) <= budget)
        assert r == want
        assert by[key]["adapter_bytes"] == hand_bytes(r, 0.9, factor, elem)
        assert by[key]["vs_budget"] == pytest.approx(hand_bytes(r, 0.9, factor, elem) / budget)
    if dtype == torch.float32:  # the ranks the docs name
        assert (by["squash_both_eq16"]["rank"], by["squash_both_eq8"]["rank"],
                by["squash_a_eq16"]["rank"]) == (143, 71, 28)  # fmt: skip
    assert by["qlora_at_squash16"]["rank"] == by["squash_both_eq16"]["rank"]
    assert by["qlora_at_squash16"]["adapter_bytes"] == hand_bytes(by["squash_both_eq16"]["rank"],
                                                                  None, "a", elem)  # fmt: skip
    assert by["qlora_r16"]["vs_budget"] == 1.0 and by["qlora_r8"]["vs_budget"] == 1.0


def test_rslora_alpha_gives_gamma_over_sqrt_rank():
    r = 143
    a = q.rslora_alpha(r)
    assert a / r == pytest.approx(8 / math.sqrt(143))  # gamma = 2 sqrt(16) = 8
    assert q.rslora_alpha(16) / 16 == pytest.approx(2.0)


def test_exact_match_is_greedy_decoding():
    """A row matches iff greedy decoding from the prompt (argmax, stop at a stop token) returns
    the answer: checked against a decoding loop over a fixed next-token table."""
    vocab, stop = 6, 5
    torch.manual_seed(0)
    for _ in range(200):
        s = 7
        table = torch.randint(0, vocab, (s,))  # the argmax the "model" gives at each position
        table[torch.randint(0, s, (1,))] = stop
        logits = torch.nn.functional.one_hot(table, vocab).float()[None] * 3.0
        n_prompt = int(torch.randint(1, 3, ()))
        ans = torch.randint(0, vocab - 1, (int(torch.randint(1, 3, ())),)).tolist() + [stop, stop]
        ans = ans[: s - n_prompt + 1]
        labels = torch.full((1, s), q.IGNORE)
        labels[0, n_prompt - 1 : n_prompt - 1 + len(ans)] = torch.tensor(ans)
        # greedy: position n_prompt-1 predicts the first answer token; teacher forcing along the
        # answer is greedy's own path as long as every prediction is right
        out, pos = [], n_prompt - 1
        while pos < s:
            out.append(int(table[pos]))
            if out[-1] == stop:
                break
            pos += 1
        first_stop = ans.index(stop) if stop in ans else len(ans) - 1
        want = out == ans[: first_stop + 1]
        assert q.score_logits(logits, labels, [stop])[2] == int(want)


def test_loss_and_tokens_by_hand():
    logits = torch.tensor([[[0.0, 1.0, 2.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])
    labels = torch.tensor([[2, 0, q.IGNORE]])
    ce, n, hits, rows = q.score_logits(logits, labels, [0])
    lse0 = math.log(1 + math.e + math.e**2)
    lse1 = math.log(math.e + 2)
    assert ce == pytest.approx((lse0 - 2.0) + (lse1 - 1.0))
    assert (n, hits, rows) == (2, 1, 1)


def test_welch_against_scipy():
    a, b = [1.71, 1.75, 1.69, 1.80], [1.73, 1.78, 1.81]
    w = q.welch(a, b)
    ref = stats.ttest_ind(a, b, equal_var=False)
    assert w["t"] == pytest.approx(ref.statistic) and w["p"] == pytest.approx(ref.pvalue)
    va, vb = statistics.variance(a) / 4, statistics.variance(b) / 3
    assert w["df"] == pytest.approx((va + vb) ** 2 / (va**2 / 3 + vb**2 / 2))
    assert math.isnan(q.welch([1.0], b)["t"])


def test_summary_and_comparisons_from_per_seed_values():
    rows = []
    for key, losses in (("qlora_r16", [1.8, 1.7, 1.75]), ("squash_both_eq16", [1.6, 1.72, 1.7])):
        test = [{"loss": x, "exact_match": 0.1 * i} for i, x in enumerate(losses)]
        sw = {1e-3: {"val": {"loss": 2.0, "exact_match": 0.0}, "test": test[0]}}
        rows.append(q.summarize({"key": key, "name": key}, sw, 1e-3, True, test))
    for r, losses in zip(rows, ([1.8, 1.7, 1.75], [1.6, 1.72, 1.7])):
        assert r["test_loss_mean"] == pytest.approx(sum(losses) / 3)
        m = sum(losses) / 3
        assert r["test_loss_std"] == pytest.approx(math.sqrt(sum((x - m) ** 2 for x in losses) / 2))
        assert r["test_em_mean"] == pytest.approx(0.1) and r["test_em_std"] == pytest.approx(0.1)
    (c,) = q.comparisons(rows)
    assert c["loss_diff"] == pytest.approx((1.6 + 1.72 + 1.7 - 1.8 - 1.7 - 1.75) / 3)
    ref = stats.ttest_ind([1.6, 1.72, 1.7], [1.8, 1.7, 1.75], equal_var=False)
    assert c["loss"]["t"] == pytest.approx(ref.statistic)


@pytest.mark.smollm2
@pytest.mark.slow
def test_quick_run_on_smollm2(smollm2_checkpoint, tmp_path):
    out = tmp_path / "q.md"
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "quality_smollm2.py"), "--quick",
         "--checkpoint-dir", str(smollm2_checkpoint), "--arms", "qlora_r16,squash_both_eq16",
         "--out", str(out)],
        capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    md, res = out.read_text(), json.loads(out.with_suffix(".json").read_text())
    assert [a["key"] for a in res["arms"]] == ["qlora_r16", "squash_both_eq16"]
    for a in res["arms"]:
        assert a["test_loss_mean"] == pytest.approx(statistics.fmean(a["test_loss"]))
        assert a["test_loss_std"] == pytest.approx(statistics.stdev(a["test_loss"]))
        sweep = {float(k): v for k, v in a["sweep"].items()}
        assert a["best_lr"] == min(sweep, key=lambda lr: sweep[lr]["val"]["loss"])
        assert a["test_loss"][0] == sweep[a["best_lr"]]["test"]["loss"]
        assert f"| {a['name']} | {a['rank']} |" in md
    (c,) = res["comparisons"]
    ref = stats.ttest_ind(res["arms"][1]["test_loss"], res["arms"][0]["test_loss"], equal_var=False)
    assert c["loss"]["t"] == pytest.approx(ref.statistic, nan_ok=True)


def _part(tmp_path, key, losses, **over):
    test = [{"loss": x, "exact_match": 0.5} for x in losses]
    sw = {3e-3: {"val": {"loss": 2.0, "exact_match": 0.0}, "test": test[0]}}
    res = dict(quick=False, sparsity=0.9, seeds=3, steps=12, batch=16, grid=[3e-3, 1e-2],
               n_train_available=885, n_val=48, n_test=110, device="cpu", dtype="fp32",
               shapes=q.adapted_shapes(), machine="m", base={"test": {"loss": 2.5, "exact_match": 0.0}},
               arms=[q.summarize({"key": key, "name": key, "rank": 1, "vs_budget": 1.0}, sw, 3e-3,
                                 False, test)], wall_s=len(losses) * 10.0)  # fmt: skip
    res.update(over)
    path = tmp_path / f"{key}.json"
    path.write_text(json.dumps(res))
    return path


def test_merge_orders_arms_and_recomputes_the_comparison(tmp_path):
    s = _part(tmp_path, "squash_both_eq16", [1.6, 1.7, 1.65])
    ql = _part(tmp_path, "qlora_r16", [1.8, 1.75, 1.7, 1.71])
    res = q.merge([s, ql])
    assert [a["key"] for a in res["arms"]] == ["qlora_r16", "squash_both_eq16"]
    assert res["wall_s"] == 40.0 and res["processes"] == 2
    (c,) = res["comparisons"]
    ref = stats.ttest_ind([1.6, 1.7, 1.65], [1.8, 1.75, 1.7, 1.71], equal_var=False)
    assert c["loss"]["t"] == pytest.approx(ref.statistic) and c["loss"]["p"] == pytest.approx(ref.pvalue)
    assert "| squash_both_eq16 | qlora_r16 | -0.090 |" in q.markdown(res)  # 1.65 - 1.74
    with pytest.raises(ValueError, match="steps"):
        q.merge([s, _part(tmp_path / "..", "qlora_r8", [1.0, 1.1], steps=40)])
    with pytest.raises(ValueError, match="more than one file"):
        q.merge([s, s])


def _seed_part(tmp_path, key, seed, loss, em):
    arm = {k: v for k, v in {a["key"]: a for a in q.arms(0.9, torch.float32)}[key].items()}
    row = q.summarize(arm, {}, 3e-3, False, [{"loss": loss, "exact_match": em}], seeds=[seed])
    res = dict(quick=False, sparsity=0.9, seeds=1, steps=16, batch=8, grid=[3e-3],
               n_train_available=885, n_val=48, n_test=48, device="cpu", dtype="fp32",
               shapes=q.adapted_shapes(), machine="m", base=None, arms=[row], wall_s=5.0)  # fmt: skip
    path = tmp_path / f"{key}_{seed}.json"
    path.write_text(json.dumps(res))
    return path


def test_merge_joins_seeds_of_one_arm_in_seed_order(tmp_path):
    values = {"qlora_r16": {2: (1.9, 0.25), 0: (1.8, 0.5), 1: (1.7, 0.0)},
              "squash_both_eq16": {1: (1.6, 0.5), 0: (1.75, 0.25), 2: (1.65, 0.75)}}  # fmt: skip
    paths = [_seed_part(tmp_path, k, s, *v) for k, d in values.items() for s, v in d.items()]
    res = q.merge(paths)
    by = {a["key"]: a for a in res["arms"]}
    assert by["qlora_r16"]["test_seeds"] == [0, 1, 2]
    assert by["qlora_r16"]["test_loss"] == [1.8, 1.7, 1.9]
    assert by["qlora_r16"]["test_loss_mean"] == pytest.approx(1.8)
    assert by["qlora_r16"]["test_loss_std"] == pytest.approx(0.1)  # sqrt((0.01 + 0.01) / 2)
    assert by["squash_both_eq16"]["test_em_mean"] == pytest.approx(0.5)
    assert by["squash_both_eq16"]["test_em_std"] == pytest.approx(0.25)
    assert by["squash_both_eq16"]["rank"] == 143 and res["seeds"] == 3
    (c,) = res["comparisons"]
    ref = stats.ttest_ind([1.75, 1.6, 1.65], [1.8, 1.7, 1.9], equal_var=False)
    assert c["loss"]["t"] == pytest.approx(ref.statistic) and c["loss"]["p"] == pytest.approx(ref.pvalue)
    assert "not swept here" in q.markdown(res) and "(fixed)" in q.markdown(res)
    with pytest.raises(ValueError, match=r"seed \d+ is in more than one file"):
        q.merge(paths + [paths[0]])


def test_merge_takes_seed_0_and_the_best_lr_from_a_sweep(tmp_path):
    """A sweep (seed 0 at 1e-3, 1e-2; best on validation: 1e-2) joins the fixed-lr seeds 1, 2 at
    1e-2 as their seed 0; a fixed-lr row at the other lr stays a row of its own."""
    arm = {a["key"]: a for a in q.arms(0.9, torch.float32)}["squash_both_eq16"]
    sw = {1e-3: {"val": {"loss": 1.5, "exact_match": 0.0}, "test": {"loss": 1.7, "exact_match": 0.0}},
          1e-2: {"val": {"loss": 1.2, "exact_match": 0.0}, "test": {"loss": 1.4, "exact_match": 0.1}}}  # fmt: skip
    row = q.summarize(arm, sw, 1e-2, True, [sw[1e-2]["test"]])
    sweep = dict(json.loads(_seed_part(tmp_path, "squash_both_eq16", 0, 1.0, 0.0).read_text()),
                 arms=[row], grid=[1e-3, 1e-2])
    sweep_path = tmp_path / "sweep.json"
    sweep_path.write_text(json.dumps(sweep))
    fixed = []
    for seed, loss in ((1, 1.5), (2, 1.3)):
        path = _seed_part(tmp_path, "squash_both_eq16", seed, loss, 0.2)
        part = json.loads(path.read_text())
        part["arms"][0]["best_lr"] = 1e-2
        path.write_text(json.dumps(part))
        fixed.append(path)
    other = _seed_part(tmp_path / "..", "squash_both_eq16", 0, 1.9, 0.0)  # at 3e-3
    ql = [_seed_part(tmp_path, "qlora_r16", s, x, 0.0) for s, x in ((0, 1.45), (1, 1.43))]
    res = q.merge(fixed + [other] + ql, [sweep_path])
    rows = [a for a in res["arms"] if a["key"] == "squash_both_eq16"]
    best = [a for a in rows if a["best"]][0]
    assert best["best_lr"] == 1e-2 and best["test_seeds"] == [0, 1, 2]
    assert best["test_loss"] == [1.4, 1.5, 1.3] and best["test_loss_mean"] == pytest.approx(1.4)
    assert best["test_em"] == [0.1, 0.2, 0.2]
    (at3,) = [a for a in rows if not a["best"]]
    assert at3["best_lr"] == 3e-3 and at3["name"].endswith("at lr 3e-03")
    # best against best, then the equal-lr pair (3e-3 both)
    assert [(c["squash_name"], c["qlora"]) for c in res["comparisons"]] == [
        (best["name"], "qlora_r16"), (at3["name"], "qlora_r16")]
    ref = stats.ttest_ind([1.4, 1.5, 1.3], [1.45, 1.43], equal_var=False)
    assert res["comparisons"][0]["loss"]["t"] == pytest.approx(ref.statistic)


def test_merge_takes_a_whole_arm_run_in_one_process(tmp_path):
    """A process that swept an arm (seed 0 at 3e-3 and 1e-2) and ran seeds 1, 2 at the best lr
    joins fixed-lr seeds of another arm; a later sweep of the same arm at 3e-2 joins its sweep.
    The row's seed 0 is the sweep's run (not counted twice); mean, std and Welch's t against
    the per-seed values by hand and scipy."""
    by_key = {a["key"]: a for a in q.arms(0.9, torch.float32)}

    def cell(val, test):
        return {"val": {"loss": val, "exact_match": 0.0}, "test": {"loss": test, "exact_match": 0.0}}

    sw = {3e-3: cell(1.3, 1.55), 1e-2: cell(1.2, 1.45)}
    seeds = [sw[1e-2]["test"], {"loss": 1.40, "exact_match": 0.0}, {"loss": 1.50, "exact_match": 0.0}]
    row = q.summarize(by_key["squash_both_eq8"], sw, 1e-2, True, seeds)
    whole = dict(json.loads(_seed_part(tmp_path, "squash_both_eq8", 0, 1.0, 0.0).read_text()),
                 arms=[row], grid=[3e-3, 1e-2], seeds=3, wall_s=99.0)
    whole_path = tmp_path / "whole.json"
    whole_path.write_text(json.dumps(whole))
    later = dict(whole, arms=[q.summarize(by_key["squash_both_eq8"], {3e-2: cell(1.25, 1.6)}, 3e-2,
                                          False, [{"loss": 1.6, "exact_match": 0.0}])])  # fmt: skip
    later_path = tmp_path / "later.json"
    later_path.write_text(json.dumps(later))
    ql = [_seed_part(tmp_path, "qlora_r8", s, x, 0.0) for s, x in ((0, 1.52), (1, 1.56), (2, 1.54))]
    res = q.merge(ql + [whole_path], [later_path])
    (s8,) = [a for a in res["arms"] if a["key"] == "squash_both_eq8"]
    assert s8["best"] and s8["best_lr"] == 1e-2 and not s8["best_at_edge"]
    assert sorted(s8["sweep"], key=float) == ["0.003", "0.01", "0.03"]
    assert s8["test_seeds"] == [0, 1, 2] and s8["test_loss"] == [1.45, 1.40, 1.50]
    assert s8["test_loss_mean"] == pytest.approx(1.45) and s8["test_loss_std"] == pytest.approx(0.05)
    assert res["wall_s"] == 99.0 and res["seed0_checks"] == []
    (c,) = res["comparisons"]
    assert (c["squash"], c["qlora"]) == ("squash_both_eq8", "qlora_r8")
    ref = stats.ttest_ind([1.45, 1.40, 1.50], [1.52, 1.56, 1.54], equal_var=False)
    assert c["loss"]["t"] == pytest.approx(ref.statistic) and c["loss"]["p"] == pytest.approx(ref.pvalue)
    # a seed 0 that is not the sweep's run at the best lr, and a sweep-only file as a row
    bad = dict(whole, arms=[dict(row, test_loss=[1.44, 1.40, 1.50])])
    bad_path = tmp_path / "bad.json"
    bad_path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="not its sweep's run"):
        q.merge(ql + [bad_path])
    sweep_only = dict(whole, arms=[q.summarize(by_key["squash_both_eq8"], sw, 1e-2, True, seeds[:1])])
    sweep_only_path = tmp_path / "sweep_only.json"
    sweep_only_path.write_text(json.dumps(sweep_only))
    with pytest.raises(ValueError, match="pass it in --sweeps"):
        q.merge(ql + [sweep_only_path])
