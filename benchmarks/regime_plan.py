"""A regime where rank pays: the candidate tasks, their arms and queue (``frontier.py`` runs
them beside the frontier; ``regime_report`` reports them).

A candidate is a task built at run time from what ships with Python, where the adapter's
capacity might limit the fine-tune. Each is screened by dense LoRA at rank 128 (8x QLoRA r=16's
adapter memory) against QLoRA r=16, each at its own best learning rate (seed 0 swept on
validation, widened at an edge), then both at three seeds: rank pays where dense beats r=16 at
each one's best validation point by at least three pooled seed standard deviations. Where it
does, squash at r=16's memory (A+B 90% and A 90%) is swept and seeded there too.

The candidates (``--tasks``), text completion scored by held-out loss per token:

- ``code``: continued pretraining on the standard library's Python source, held out by package
  (``squash.datasets.python_code_dataset``), the setting where Biderman et al. (2024, "LoRA
  Learns Less and Forgets Less") found full fine-tuning far ahead of LoRA;
- ``cipher``: the Python Language Reference's prose with every letter through a fixed
  substitution (``squash.datasets.pydoc_text_dataset`` with ``cipher_seed``): English structure
  in token sequences the model has never read, many new token-level mappings at once.
"""

import math

from frontier_plan import arms as frontier_arms
from quality_curves_plan import MAX_WIDEN, SEEDS, TASKS, run_id, sweep_state

CANDIDATES = {
    "code": dict(dataset="squash.datasets.python_code_dataset", max_seq_len=128, text=True),
    "cipher": dict(dataset="squash.datasets.pydoc_text_dataset", max_seq_len=128, text=True,
                   args={"cipher_seed": 0}),
}
TASKS.update(CANDIDATES)  # what quality_curves' recipe config and loaders read
# 200 steps of 8 windows of 128 tokens (205k tokens, a tenth of the code's train split), scored
# every 50 steps on 64 held-out windows of each split
SIZE = dict(steps=200, eval_every=50, batch=8, n_val=64, n_test=64, warmup=20)
QUICK_SIZE = dict(steps=4, eval_every=2, batch=2, n_val=2, n_test=2, warmup=1)
# first grids: two rates each, around what the learning curves found best for each kind
GRIDS = {"qlora_r16": [1e-3, 3e-3], "qlora_r128": [3e-4, 1e-3], "squash": [1e-3, 3e-3],
         "squash_a": [1e-3, 3e-3]}  # fmt: skip
SCREEN = ("qlora_r16", "qlora_r128")
SQUASH = ("squash", "squash_a")
PAYS_SDS = 3.0


def arms(steps: int) -> dict:
    """The regime's arms: QLoRA r=16, dense LoRA at rank 128, and squash A+B and A at r=16's
    memory (the frontier's arms of those keys)."""
    f = frontier_arms(steps)
    out = {k: f[k] for k in ("qlora_r16", "squash", "squash_a")}
    dense = dict(f["qlora_r64"], key="qlora_r128", rank=128, alpha=256.0, budget=128,
                 name="QLoRA r=128 (dense, 8x r=16's memory)")  # fmt: skip
    dense["adapter_bytes"] = f["qlora_r64"]["adapter_bytes"] * 2 - 4 * 420  # linear in rank
    dense["vs_qlora_r16"] = dense["adapter_bytes"] / f["qlora_r16"]["adapter_bytes"]
    out["qlora_r128"] = dense
    return out


def pooled_sd(a: list, b: list) -> float:
    """The pooled sample standard deviation of two groups of seeds."""
    import statistics

    va, vb = statistics.variance(a), statistics.variance(b)
    return math.sqrt(((len(a) - 1) * va + (len(b) - 1) * vb) / (len(a) + len(b) - 2))


def rank_pays(dense: list, r16: list) -> tuple:
    """``(gap in pooled SDs, pays)``: r=16's mean minus dense's over the pooled SD of their seeds'
    best-point test losses; pays at :data:`PAYS_SDS` or more (None before 2 seeds each)."""
    import statistics

    if len(dense) < 2 or len(r16) < 2:
        return None, None
    sd = pooled_sd(dense, r16)
    gap = statistics.fmean(r16) - statistics.fmean(dense)
    if sd == 0:
        return math.inf if gap > 0 else -math.inf, gap > 0
    return gap / sd, gap / sd >= PAYS_SDS


def plan(task: str, done: dict, mine: dict, points: dict, seeds: dict, steps: int,
         quick: bool = False) -> list:  # fmt: skip
    """The runs of candidate ``task`` as ``(stage, run id, arm, lr, seed)``: the screening
    sweeps of QLoRA r=16 and dense r=128 (0), their seeds 1 and 2 at the best rate (1), and
    where rank pays (``seeds``: arm -> its seeds' best-point test losses), squash's sweeps (2)
    and seeds (3).

    Args:
        done: finished runs of ``task`` by id. ``mine`` and ``points`` are unused here (the
            frontier's plan takes them; one signature for both).
    """
    by_key = arms(steps)
    widen = 0 if quick else MAX_WIDEN
    grid = {k: (g[:1] if quick else g) for k, g in GRIDS.items()}
    more = SEEDS[1:2] if quick else SEEDS[1:]
    out, later, best = [], [], {}
    for key in by_key:
        todo, best[key] = sweep_state(done, key, grid[key], widen)
        if key in SCREEN:
            out += [(0, run_id(key, lr, 0), key, lr, 0) for lr in todo]
        elif key in SQUASH:
            later += [(2, run_id(key, lr, 0), key, lr, 0) for lr in todo]
    for key in SCREEN:
        if best[key] is not None:
            out += [(1, run_id(key, best[key], s), key, best[key], s) for s in more]
    _, pays = rank_pays(seeds.get("qlora_r128", []), seeds.get("qlora_r16", []))
    if pays:
        out += later
        for key in SQUASH:
            if best[key] is not None:
                out += [(3, run_id(key, best[key], s), key, best[key], s) for s in more]
    return [q for q in out if q[1] not in done]
