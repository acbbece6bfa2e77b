"""The quality-per-byte frontier's arms and queue (``frontier.py`` runs them,
``frontier_report.py`` reports them).

A point of the frontier is a method at an adapter budget, at its own best learning rate: QLoRA at
ranks 2 to 64, squash with both factors 90% sparse (A+B) and with factor A alone 90% sparse at
the ranks that fit 1/8, 1/4, 1/2, 1 and 2 times QLoRA r=16's adapter + gradient + AdamW bytes
(``squash.training.lora_adapter_memory``), and full fine-tuning of the unquantized model as the
ceiling (the frozen base, step 0 of any run, is the floor).

Each arm's learning rate is swept on validation at the full length, on a grid of three centred on
its neighbour's best (the next arm of the same method toward QLoRA r=16's budget), widened while
the best is at an edge (``quality_curves_plan.sweep_state``). The three arms at r=16's budget
(``qlora_r16``, ``squash``, ``squash_a``) were swept by the learning curves
(``benchmarks/results/quality_curves/``): their sweeps are read from there, and only their best
rate's seed 0 is run again here, for the general-text perplexity those runs did not record. Then
seeds 1 and 2 at the decisive points (:func:`decisive`), where each method's line meets QLoRA
r=16's quality.
"""

import math

import torch

from squash.training import lora_adapter_memory

from quality_curves_plan import (
    FIRST_GRID, LADDER, MAX_WIDEN, SEEDS, adapted_shapes, arms as curve_arms, mask_schedule,
    rank_at, run_id, sweep_state,
)

# adapter budgets as QLoRA ranks: 1/8, 1/4, 1/2, 1, 2 (and QLoRA alone, 4) times r=16's bytes
BUDGETS = [2, 4, 8, 16, 32]
QLORA_RANKS = [2, 4, 8, 16, 32, 64]
SPARSITY = 0.9
# full fine-tuning's rates sit below the adapters' (every weight moves)
FULL_LADDER = [1e-6, 3e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3]
FULL_GRID = [1e-5, 3e-5, 1e-4]
LINES = ("qlora", "squash", "squash_a")
# --quick: one arm of each kind and code path (r=16's budget, a neighbour-centred sweep, full)
QUICK_ARMS = ["qlora_r16", "squash", "squash_a", "qlora_r8", "squash_b8", "full"]
LINE_NAMES = {"qlora": "QLoRA", "squash": "squash A+B 90%", "squash_a": "squash A 90%",
              "full": "full fine-tuning (fp32 base)"}  # fmt: skip
# SmolLM2-135M-Instruct: trainable tensors of a full fine-tune (tied embedding once) and their
# elements; checked against the built model in the tests
FULL_PARAMS = 134_515_008
FULL_TENSORS = 272


def arm_key(line: str, budget: int) -> str:
    """``qlora_r8``, ``squash_b8`` (squash at QLoRA r=8's bytes), ``squash_a_b8``; at r=16's
    budget the learning curves' keys ``qlora_r16``, ``squash``, ``squash_a``."""
    if line == "qlora":
        return f"qlora_r{budget}"
    return line if budget == 16 else f"{line}_b{budget}"


def full_memory_bytes(dtype=torch.float32) -> int:
    """Full fine-tuning's trainable state: every weight, its gradient, AdamW's two moments (the
    weight's dtype) and a float32 ``step`` per tensor."""
    e = torch.empty((), dtype=dtype).element_size()
    return FULL_PARAMS * 4 * e + 4 * FULL_TENSORS


def arms(steps: int, dtype=torch.float32) -> dict:
    """Every frontier arm by key: builder settings, its line, its budget (as a QLoRA rank) and
    its adapter bytes against QLoRA r=16's."""
    budget16 = lora_adapter_memory(adapted_shapes(), 16, dtype=dtype).total_bytes
    curves = curve_arms(steps, dtype)
    mask = mask_schedule(steps)
    out = {}
    for r in QLORA_RANKS:
        out[arm_key("qlora", r)] = dict(curves["qlora_r16"], rank=r, name=f"QLoRA r={r}")
    for line, factor in (("squash", "both"), ("squash_a", "a")):
        for b in BUDGETS:
            r = rank_at(SPARSITY, factor, budget_rank=b, dtype=dtype)
            what = "A+B" if factor == "both" else "A"
            out[arm_key(line, b)] = dict(rank=r, sparsity=SPARSITY, factor=factor,
                                         mask_update=mask,
                                         name=f"squash r={r}, {what} 90% (= QLoRA r={b})")  # fmt: skip
    for key, arm in out.items():
        arm.pop("alpha", None)
        arm.update(key=key, alpha=2.0 * arm["rank"])
        arm["line"] = "qlora" if key.startswith("qlora") else key.split("_b")[0]
        arm["budget"] = int(key.split("_r")[1]) if arm["line"] == "qlora" else (
            16 if "_b" not in key else int(key.split("_b")[1]))  # fmt: skip
        mem = lora_adapter_memory(adapted_shapes(), arm["rank"], sparsity=arm.get("sparsity"),
                                  sparse_factor=arm.get("factor", "a"), dtype=dtype)  # fmt: skip
        arm["adapter_bytes"], arm["vs_qlora_r16"] = mem.total_bytes, mem.total_bytes / budget16
    full = full_memory_bytes(dtype)
    out["full"] = dict(key="full", full=True, line="full", budget=None, rank=None,
                       name="full fine-tuning (fp32 base)", adapter_bytes=full,
                       vs_qlora_r16=full / budget16)  # fmt: skip
    return out


def neighbour(arm: dict) -> str:
    """The arm whose best rate centres ``arm``'s first grid: the next of its line toward r=16's
    budget (None for the three arms at that budget, swept by the learning curves)."""
    b = arm["budget"]
    if b == 16:
        return None
    return arm_key(arm["line"], b * 2 if b < 16 else b // 2)


def centred(lr: float, ladder=LADDER) -> list:
    """Three rates of ``ladder`` around ``lr`` (two at a ladder's end)."""
    i = ladder.index(lr)
    return ladder[max(0, i - 1) : i + 2]


def _order(arm: dict) -> tuple:
    """The queue's order of arms: r=16's budget, then the smaller budgets outward (what the
    headline needs: the same quality for less memory), then the larger ones, full
    fine-tuning last; lines interleaved at each budget."""
    b = arm["budget"]
    return (b is None, (b or 16) > 16, abs(math.log2((b or 16) / 16)), LINES.index(arm["line"])
            if arm["line"] in LINES else 0)  # fmt: skip


def sweeps(done: dict, by_key: dict, quick: bool = False) -> tuple:
    """``({arm: lrs still to run}, {arm: best lr or None})`` of every arm's sweep, from the
    finished seed-0 runs in ``done`` (the learning curves' and the frontier's together).
    ``quick``: one rate an arm, never widened (the sweep's code path without its runs)."""
    todo, best = {}, {}
    widen = 0 if quick else MAX_WIDEN

    def state(key, grid, ladder=LADDER):
        return sweep_state(done, key, grid[1:2] if quick else grid, widen, ladder)

    order = sorted(by_key, key=lambda k: _order(by_key[k]))
    for key in order:
        arm = by_key[key]
        if arm.get("full"):
            todo[key], best[key] = state(key, FULL_GRID, FULL_LADDER)
            continue
        near = neighbour(arm)
        if near is None:
            todo[key], best[key] = state(key, FIRST_GRID)
        elif best.get(near) is None:
            todo[key], best[key] = [], None  # waits for its neighbour's sweep
        else:
            todo[key], best[key] = state(key, centred(best[near]))
    return todo, best


def decisive(points: dict, by_key: dict, ref_mean: float, ref_std: float) -> list:
    """The arms that decide the headline: on each line, the smallest budget whose seed-0
    best-point test loss (``points``: arm -> loss) is within two of QLoRA r=16's seed standard
    deviations of its mean, and the next smaller budget (which is not); plus ``qlora_r16``.
    A line with an unfinished arm adds nothing yet."""
    out = ["qlora_r16"]
    for line in LINES:
        keys = sorted((k for k, a in by_key.items() if a["line"] == line),
                      key=lambda k: by_key[k]["budget"])  # fmt: skip
        if any(k not in points for k in keys):
            continue
        ok = [k for k in keys if points[k] <= ref_mean + 2 * ref_std]
        if not ok:
            continue
        i = keys.index(ok[0])
        out += [k for k in keys[max(0, i - 1) : i + 1] if k not in out]
    return out


def plan(task: str, done: dict, mine: dict, points: dict, ref: tuple, steps: int,
         quick: bool = False) -> list:  # fmt: skip
    """The runs of ``task`` as ``(stage, run id, arm, lr, seed)``, stage 0 first: the sweeps,
    arm by arm as their neighbours' finish (0); the best rate's seed 0 of each arm at r=16's
    budget, again with the general-text perplexity (1); seeds 1 and 2 at the decisive points (2).

    Args:
        done: finished runs by id, the learning curves' and the frontier's (sweeps and seeds).
        mine: finished frontier runs by id (what has the general-text perplexity).
        points: arm -> its best rate's seed-0 best-point test loss (finished arms only).
        ref: ``(mean, std)`` of QLoRA r=16's best-point test loss over its seeds.
        steps: the runs' length.
        quick: toy sizes: the arms of :data:`QUICK_ARMS`, one rate each.
    """
    by_key = arms(steps)
    if quick:
        by_key = {k: by_key[k] for k in QUICK_ARMS}
    todo, best = sweeps(done, by_key, quick)
    out = []
    for key in sorted(todo, key=lambda k: _order(by_key[k])):
        out += [(0, run_id(key, lr, 0), key, lr, 0) for lr in todo[key]]
    for key in ("qlora_r16", "squash", "squash_a"):
        if best[key] is not None and run_id(key, best[key], 0) not in mine:
            out.append((1, run_id(key, best[key], 0), key, best[key], 0))
    for key in decisive(points, by_key, *ref) if ref is not None else ["qlora_r16"]:
        if best[key] is not None:
            out += [(2, run_id(key, best[key], s), key, best[key], s)
                    for s in (SEEDS[1:2] if quick else SEEDS[1:])]
    return [q for q in out if q[1] not in done or (q[0] == 1 and q[1] not in mine)]
