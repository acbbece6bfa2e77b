"""benchmarks/frontier.py and its ``_plan`` and ``_report`` modules against independent
computations: each arm's adapter bytes counted by hand from SmolLM2's shapes, full fine-tuning's
from the built model, the sweeps' neighbour-centred grids and the decisive points worked by hand,
the kept best state against the model's own tensors, and the headline against the per-seed
values."""

import statistics

import frontier_plan as fp
import frontier_report as fr
import quality_curves as qc
import quality_curves_plan as qp
import torch
from torch import nn

# (in, out) of one SmolLM2-135M layer's adapted linears: q, k, v, output, w1, w2, w3
LAYER = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (1536, 576), (576, 1536)]


def hand_bytes(rank, sparsity=None, factor="a"):
    """Adapter + gradient + AdamW bytes in fp32 (4 + 4 + 8 per element, a float32 step per
    tensor) plus int16 FFI indices, counted from the 30 layers' shapes."""
    elems = idx = 0
    for i, o in LAYER * 30:
        ka = round((1 - sparsity) * i) if sparsity and factor in ("a", "both") else None
        kb = round((1 - sparsity) * rank) if sparsity and factor == "both" else None
        a = rank * (ka or i)
        b = o * (max(1, kb) if kb is not None else rank)
        elems += a + b
        idx += (rank * ka if ka else 0) + (o * max(1, kb) if kb is not None else 0)
    return elems * 16 + idx * 2 + 4 * 2 * 30 * len(LAYER)


def test_every_arm_fits_its_budget_by_hand():
    arms = fp.arms(200)
    r16 = hand_bytes(16)
    assert r16 == 78_153_360  # the configs' comment
    for key, arm in arms.items():
        if arm["line"] == "full":
            continue
        got = hand_bytes(arm["rank"], arm.get("sparsity"), arm.get("factor", "a"))
        assert arm["adapter_bytes"] == got, key
        assert abs(arm["vs_qlora_r16"] - got / r16) < 1e-12
        if arm["line"] == "qlora":  # 305,280 elements per rank (10,176 a layer), 420 tensors
            assert got == 305_280 * arm["rank"] * 16 + 4 * 420
            continue
        budget = hand_bytes(arm["budget"])  # QLoRA at the arm's budget rank
        # the largest rank within the budget: this one fits, one more does not
        assert got <= budget < hand_bytes(arm["rank"] + 1, arm["sparsity"], arm["factor"]), key
    assert arms["squash"]["rank"] == 143 and arms["squash_a"]["rank"] == 28  # the curves' arms
    assert {a["rank"] for k, a in arms.items() if a["line"] == "qlora"} == {2, 4, 8, 16, 32, 64}


def test_full_fine_tuning_memory_counts_the_built_model():
    from squash.models.smollm2 import smollm2_135m

    with torch.device("meta"):
        params = list(smollm2_135m().parameters())  # the tied embedding once
    assert (len(params), sum(p.numel() for p in params)) == (fp.FULL_TENSORS, fp.FULL_PARAMS)
    assert fp.full_memory_bytes() == sum(p.numel() for p in params) * 16 + 4 * len(params)
    assert fp.arms(200)["full"]["adapter_bytes"] == fp.full_memory_bytes()


def record(arm, lr, seed, val, test=1.0, steps=200, best_val=None):
    """A finished run: validation loss ``val`` at the end, ``best_val`` (default ``val``) at
    step 100, the test loss ``test`` at the best point."""
    best_val = val if best_val is None else best_val
    points = [{"step": 0, "val": {"loss": 9.0, "exact_match": 0.0},
               "test": {"loss": 9.0, "exact_match": 0.0}, "forget": {"loss": 2.0}},
              {"step": 100, "val": {"loss": best_val, "exact_match": 0.0},
               "test": {"loss": test, "exact_match": 0.5}},
              {"step": steps, "val": {"loss": val, "exact_match": 0.0},
               "test": {"loss": test + 0.1, "exact_match": 0.25}}]  # fmt: skip
    return {"id": qp.run_id(arm, lr, seed), "arm": fp.arms(steps)[arm], "lr": lr, "seed": seed,
            "frac": 1.0, "points": points, "done": True, "sessions": [],
            "best": {"step": 100 if best_val <= val else steps,
                     "forget": {"loss": 2.5}}}  # fmt: skip


def done_of(*recs):
    return {r["id"]: r for r in recs}


def test_sweeps_centre_on_the_neighbour_and_wait_for_it():
    arms = fp.arms(200)
    todo, best = fp.sweeps({}, arms)
    # the three arms at r=16's budget start on the curves' first grid; their neighbours wait
    for key in ("qlora_r16", "squash", "squash_a"):
        assert todo[key] == qp.FIRST_GRID and best[key] is None
    assert todo["qlora_r8"] == [] and best["qlora_r8"] is None
    assert todo["full"] == fp.FULL_GRID
    d = done_of(*(record("qlora_r16", lr, 0, v) for lr, v in zip(qp.FIRST_GRID, [1.2, 1.1, 1.3])))
    todo, best = fp.sweeps(d, arms)
    assert best["qlora_r16"] == 3e-3
    assert todo["qlora_r8"] == [1e-3, 3e-3, 1e-2] and todo["qlora_r32"] == [1e-3, 3e-3, 1e-2]
    assert todo["qlora_r4"] == [] and todo["qlora_r64"] == []  # their neighbours are not done
    # r8 best at its low edge: widened one ladder step down, and r4 centred on nothing yet
    d.update(done_of(*(record("qlora_r8", lr, 0, v) for lr, v in zip([1e-3, 3e-3, 1e-2],
                                                                      [1.0, 1.1, 1.2]))))  # fmt: skip
    todo, best = fp.sweeps(d, arms)
    assert todo["qlora_r8"] == [3e-4] and todo["qlora_r4"] == []
    d.update(done_of(record("qlora_r8", 3e-4, 0, 1.05)))
    todo, best = fp.sweeps(d, arms)
    assert best["qlora_r8"] == 1e-3 and todo["qlora_r4"] == [3e-4, 1e-3, 3e-3]
    assert fp.centred(1e-1) == [3e-2, 1e-1] and fp.centred(1e-6, fp.FULL_LADDER) == [1e-6, 3e-6]


def test_decisive_points_by_hand():
    arms = fp.arms(200)
    # r=16 at 0.70 +/- 0.01: within two stds means <= 0.72
    points = {"qlora_r2": 0.9, "qlora_r4": 0.8, "qlora_r8": 0.71, "qlora_r16": 0.70,
              "qlora_r32": 0.69, "qlora_r64": 0.68, "squash_b2": 0.75, "squash_b4": 0.72,
              "squash_b8": 0.70, "squash": 0.71, "squash_b32": 0.70}  # fmt: skip
    got = fp.decisive(points, arms, 0.70, 0.01)
    # QLoRA's smallest match is r=8 (r=4 the one below); squash's b4 (0.72 <= 0.72), b2 below;
    # squash A has unfinished arms: nothing yet
    assert got == ["qlora_r16", "qlora_r4", "qlora_r8", "squash_b2", "squash_b4"]


def test_plan_reruns_the_curves_best_seed_zero_for_the_general_text():
    d = done_of(*(record("qlora_r16", lr, 0, v) for lr, v in zip(qp.FIRST_GRID, [1.2, 1.1, 1.3])))
    p = fp.plan("unicode", d, {}, {}, None, 200)
    assert (1, "qlora_r16_lr3e-03_s0", "qlora_r16", 3e-3, 0) in p
    # r=16's other seeds are queued even before the decisive points are known
    assert [q[1] for q in p if q[0] == 2] == ["qlora_r16_lr3e-03_s1", "qlora_r16_lr3e-03_s2"]
    mine = {"qlora_r16_lr3e-03_s0": d["qlora_r16_lr3e-03_s0"]}
    assert not [q for q in fp.plan("unicode", d, mine, {}, None, 200) if q[0] == 1]


def test_best_state_keeps_the_best_validation_point(tmp_path):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.base = nn.Linear(2, 2)
            self.lora_a = nn.Linear(2, 2)
            self.register_buffer("lora_idx", torch.zeros(2, dtype=torch.int16))

    m = M()
    best = qc.BestState(m, tmp_path / "best.pt", lambda n: "lora_" in n)
    assert set(best.tensors) == {"lora_a.weight", "lora_a.bias", "lora_idx"}
    best.consider(0, 0.1)  # step 0 never counts
    assert best.step is None
    with torch.no_grad():
        m.lora_a.weight.fill_(1.0)
        m.lora_idx.fill_(3)
    best.consider(25, 2.0)
    kept = m.lora_a.weight.clone()
    with torch.no_grad():
        m.lora_a.weight.fill_(5.0)
        m.lora_idx.fill_(7)
    best.consider(50, 2.0)  # equal: the earlier point stays
    best.consider(75, 3.0)
    seen = best.score(lambda: {"w": m.lora_a.weight.clone(), "i": m.lora_idx.clone()})
    assert seen["step"] == 25 and torch.equal(seen["w"], kept) and seen["i"].tolist() == [3, 3]
    assert m.lora_a.weight.eq(5.0).all() and m.lora_idx.eq(7).all()  # put back
    again = qc.BestState(m, tmp_path / "best.pt", lambda n: "lora_" in n)  # a resumed run
    assert again.step == 25 and torch.equal(again.state["lora_a.weight"], kept)


def test_report_summary_and_headline_by_hand():
    recs = []
    for s, loss in enumerate([0.70, 0.72, 0.71]):
        recs.append(record("qlora_r16", 3e-3, s, 1.0, test=loss))
    recs.append(record("qlora_r8", 3e-3, 0, 1.1, test=0.75))
    for s, loss in enumerate([0.705, 0.715]):
        recs.append(record("squash_b8", 3e-3, s, 1.0, test=loss))
    s = fr.summary(fr.groups(done_of(*recs), 200, fp.arms(200)), fp.arms(200))
    assert s["qlora_r16"]["loss"] == [0.70, 0.72, 0.71] and s["qlora_r16"]["steps"] == [100] * 3
    assert s["squash_b8"]["forget"] == [2.5, 2.5] and s["squash_b8"]["rise"] == [0.5, 0.5]
    lines = fr.headline(s)
    m16, sd16 = statistics.fmean([0.70, 0.72, 0.71]), statistics.stdev([0.70, 0.72, 0.71])
    assert f"{m16:.3f} +/- {sd16:.3f}" in lines[0] and f"{m16 + sd16:.3f}" in lines[0]
    assert "QLoRA r=16 at 1.000x" in lines[1]  # r=8 at 0.75 does not match
    assert "squash r=71, A+B 90% (= QLoRA r=8) at 0.497x" in lines[2]
    assert lines[3].endswith("no finished budget matches.")


# ---- the regime search ----------------------------------------------------------------------
def test_rank_pays_is_the_gap_over_the_pooled_sd():
    import numpy as np
    import regime_plan as rp

    dense, r16 = [2.00, 2.01, 2.02], [2.10, 2.12, 2.11]
    pooled = np.sqrt((np.var(dense, ddof=1) * 2 + np.var(r16, ddof=1) * 2) / 4)
    sds, pays = rp.rank_pays(dense, r16)
    assert abs(sds - (np.mean(r16) - np.mean(dense)) / pooled) < 1e-9 and pays
    sds, pays = rp.rank_pays([2.00, 2.05, 2.10], [2.05, 2.10, 2.15])
    assert abs(sds - 1.0) < 1e-9 and not pays  # 0.05 nats over a pooled sd of 0.05
    assert rp.rank_pays([2.0], [2.1]) == (None, None)


def test_regime_plan_screens_then_seeds_then_squash_where_rank_pays():
    import regime_plan as rp

    arms = rp.arms(200)
    assert arms["qlora_r128"]["adapter_bytes"] == hand_bytes(128)
    assert arms["qlora_r128"]["vs_qlora_r16"] == hand_bytes(128) / hand_bytes(16)

    def rec(arm, lr, seed, val):
        r = record("qlora_r16", lr, seed, val)
        r.update(id=qp.run_id(arm, lr, seed), arm=arms[arm])
        return r

    p = rp.plan("code", {}, {}, {}, {}, 200)
    assert [(q[0], q[2], q[3]) for q in p] == [(0, "qlora_r16", 1e-3), (0, "qlora_r16", 3e-3),
                                               (0, "qlora_r128", 3e-4), (0, "qlora_r128", 1e-3)]  # fmt: skip
    d = done_of(rec("qlora_r16", 1e-3, 0, 1.1), rec("qlora_r16", 3e-3, 0, 1.2),
                rec("qlora_r128", 3e-4, 0, 1.0), rec("qlora_r128", 1e-3, 0, 0.9))  # fmt: skip
    p = rp.plan("code", d, {}, {}, {}, 200)
    # r16 best inside (1e-3 is the low edge: widened to 3e-4); r128 best at its high edge
    assert [(q[0], q[2], q[3]) for q in p if q[0] == 0] == [(0, "qlora_r16", 3e-4),
                                                            (0, "qlora_r128", 3e-3)]  # fmt: skip
    d.update(done_of(rec("qlora_r16", 3e-4, 0, 1.3), rec("qlora_r128", 3e-3, 0, 1.4)))
    p = rp.plan("code", d, {}, {}, {}, 200)
    assert [(q[0], q[2], q[3], q[4]) for q in p] == [
        (1, "qlora_r16", 1e-3, 1), (1, "qlora_r16", 1e-3, 2),
        (1, "qlora_r128", 1e-3, 1), (1, "qlora_r128", 1e-3, 2)]  # fmt: skip
    # seeds in: rank does not pay -> nothing more; pays -> squash's sweeps, then its seeds
    assert rp.plan("code", d, {}, {}, {"qlora_r128": [1.0, 1.1], "qlora_r16": [1.05, 1.12]},
                   200) == [q for q in p]  # fmt: skip
    pays = {"qlora_r128": [1.00, 1.01, 1.02], "qlora_r16": [1.10, 1.11, 1.12]}
    later = [(q[0], q[2], q[3]) for q in rp.plan("code", d, {}, {}, pays, 200) if q[0] >= 2]
    assert later == [(2, k, lr) for k in ("squash", "squash_a") for lr in (1e-3, 3e-3)]
