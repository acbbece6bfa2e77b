"""The learning curves' arms, queue and recipe configs (``quality_curves.py`` runs them,
``quality_curves_report.py`` reports them).

An arm is a builder setting at a known adapter memory (:func:`arms`); a run is an arm at a
learning rate, seed and fraction of the training data (:func:`run_id`); the queue
(:func:`plan`) derives from the finished runs which to run next: each core arm's learning rate
swept on validation at the full length (widened while the best is at an edge,
:func:`sweep_state`), then more seeds at the best rate, then a quarter of the training data,
then single-seed lever rows and the base arms. :func:`recipe_config` is the config a run hands
the recipe class users run.
"""

import functools
import json
import math
from pathlib import Path

import torch

from squash.training import lora_adapter_memory, max_rank_within

from common import adapted_shapes as _shapes

ROOT = Path(__file__).resolve().parent.parent
ATTN = ["q_proj", "k_proj", "v_proj", "output_proj"]

TASKS = {
    "unicode": dict(dataset="squash.datasets.unicode_names_dataset", max_seq_len=96),
    "pydocs": dict(dataset="squash.datasets.python_docs_dataset", max_seq_len=160),
}
FULL = dict(steps=200, eval_every=25, batch=8, n_val=110, n_test=110, warmup=20)
QUICK = dict(steps=4, eval_every=2, batch=2, n_val=4, n_test=4, warmup=1)
LADDER = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1]  # the lr grid, widened along it
FIRST_GRID = [1e-3, 3e-3, 1e-2]
MAX_WIDEN = 2
SEEDS = [0, 1, 2]
# the corrected base of the base arms: 1% of each row (4.46 bits per parameter on SmolLM2, 72% of
# NF4's perplexity gap closed in-domain before fine-tuning: docs/benchmarks/nf4.md)
OUTLIERS = {"fraction": 0.01, "criterion": "sensitivity"}


# ---- arms ---------------------------------------------------------------------------------------
def adapted_shapes() -> list:
    """``(in, out)`` of SmolLM2-135M's adapted linears: all seven of each of its 30 layers."""
    return _shapes("smollm2")


@functools.lru_cache(maxsize=None)
def rank_at(sparsity: float, factor: str, budget_rank: int = 16, dtype=torch.float32) -> int:
    """The largest squash rank whose adapter + grad + AdamW + index bytes fit in QLoRA
    ``budget_rank``'s."""
    budget = lora_adapter_memory(adapted_shapes(), budget_rank, dtype=dtype).total_bytes
    return max_rank_within(budget, adapted_shapes(), sparsity=sparsity, sparse_factor=factor,
                           dtype=dtype)  # fmt: skip


def mask_schedule(steps: int, every: int = 10, drop: float = 0.3, until: float = 0.75) -> dict:
    """The configs' mask update scaled to a run of ``steps``: every ``every`` steps (a tenth
    of them at most), ``drop`` of each row, until ``until`` of the run."""
    return dict(every_n_steps=max(1, min(every, steps // 10 or 1)), drop_fraction=drop,
                until_step=max(2, int(until * steps)))  # fmt: skip


def arms(steps: int, dtype=torch.float32) -> dict:
    """Every arm by key: builder settings and adapter bytes against QLoRA r=16's."""
    r90, a90 = rank_at(0.9, "both", dtype=dtype), rank_at(0.9, "a", dtype=dtype)
    mask = mask_schedule(steps)
    squash = dict(rank=r90, sparsity=0.9, factor="both", mask_update=mask)
    out = {
        "qlora_r16": dict(name="QLoRA r=16", rank=16),
        "squash": dict(squash, name=f"squash r={r90}, A+B 90%, mask updates (= QLoRA r=16)"),
        "squash_a": dict(rank=a90, sparsity=0.9, factor="a", mask_update=mask,
                         name=f"squash r={a90}, A 90%, mask updates (= QLoRA r=16)"),
        "lora_dense": dict(rank=r90, name=f"QLoRA r={r90} (dense at squash's rank)"),
        # levers, one change each against "squash"
        "squash_static": dict(squash, mask_update=None, name="squash, static mask"),
        "squash_svd": dict(squash, init="svd", name="squash, SVD init"),
        "squash_loraplus": dict(squash, lora_plus_ratio=16.0, name="squash, LoRA+ (B lr x16)"),
        "squash_rslora": dict(squash, alpha=2.0 * math.sqrt(16) * math.sqrt(r90),
                              name="squash, rsLoRA scaling"),
        "squash_every5": dict(squash, mask_update=mask_schedule(steps, every=5),
                              name="squash, mask every 5 steps"),
        "squash_drop10": dict(squash, mask_update=mask_schedule(steps, drop=0.1),
                              name="squash, mask drop 10%"),
        "squash_drop50": dict(squash, mask_update=mask_schedule(steps, drop=0.5),
                              name="squash, mask drop 50%"),
        "squash_until_end": dict(squash, mask_update=mask_schedule(steps, until=1.0),
                                 name="squash, masks move to the end"),
    }
    # the base under the fine-tune (one change each against "qlora_r16" and "squash": its
    # frozen weights unquantized, or NF4 corrected by FFI outliers)
    qlora = out["qlora_r16"]
    for key, method in (("qlora_r16", qlora), ("squash", squash)):
        short = "QLoRA r=16" if key == "qlora_r16" else "squash"
        out[f"{key}_fp32"] = dict(method, base="fp32", name=f"{short}, fp32 base")
        out[f"{key}_outliers"] = dict(method, base="outliers", base_outliers=dict(OUTLIERS),
                                      name=f"{short}, NF4 + 1% sensitivity outliers")  # fmt: skip
    for sp in (0.8, 0.95):
        r = rank_at(sp, "both", dtype=dtype)
        out[f"squash_s{round(sp * 100)}"] = dict(squash, rank=r, sparsity=sp,
                                                  name=f"squash r={r}, A+B {sp:.0%}")  # fmt: skip
    budget = lora_adapter_memory(adapted_shapes(), 16, dtype=dtype).total_bytes
    for key, arm in out.items():
        arm["key"] = key
        arm.setdefault("alpha", 2.0 * arm["rank"])
        mem = lora_adapter_memory(adapted_shapes(), arm["rank"], sparsity=arm.get("sparsity"),
                                  sparse_factor=arm.get("factor", "a"), dtype=dtype)  # fmt: skip
        arm["adapter_bytes"], arm["vs_qlora_r16"] = mem.total_bytes, mem.total_bytes / budget
    return out


# ---- the queue ----------------------------------------------------------------------------------
def run_id(arm: str, lr: float, seed: int, frac: float = 1.0) -> str:
    return f"{arm}_lr{lr:.0e}_s{seed}" + ("" if frac == 1.0 else f"_d{frac:g}")


def sweep_state(done: dict, arm: str, grid=FIRST_GRID, max_widen=MAX_WIDEN,
                ladder=LADDER) -> tuple:  # fmt: skip
    """``(lrs to run, best lr or None)`` of an arm's sweep from its finished seed-0 runs
    (``done``: run id -> record). The grid is widened one ``ladder`` step past an edge that
    holds the best final validation loss, at most ``max_widen`` times; ``best`` is set once no
    run is left."""
    lrs = list(grid)
    for _ in range(max_widen + 1):
        missing = [lr for lr in lrs if run_id(arm, lr, 0) not in done]
        if missing:
            return missing, None
        val = {lr: final(done[run_id(arm, lr, 0)])["val"]["loss"] for lr in lrs}
        best = min(lrs, key=lambda lr: (val[lr], lr))
        lo, hi = min(lrs), max(lrs)
        i = ladder.index(best)
        nxt = ladder[i - 1] if best == lo and i > 0 else ladder[i + 1] if (
            best == hi and i + 1 < len(ladder)) else None  # fmt: skip
        if nxt is None or len(lrs) >= len(grid) + max_widen:
            return [], best
        lrs.append(nxt)
    raise AssertionError("unreachable: the loop returns once the grid is widened max_widen times")


def plan(task: str, done: dict, quick: bool = False) -> list:
    """The runs of ``task`` as ``(stage, run id, arm, lr, seed, frac)``, stage 0 first: the
    sweeps of QLoRA r=16 and squash, lr by lr (0); their other seeds (1); the sweeps of squash A
    alone and dense LoRA at squash's rank (2); a quarter of the data (3); levers (4); both
    methods on an fp32 base and on NF4 + outliers, every seed (5; the first task only). A stage
    whose lr is not known yet (its sweep unfinished) adds nothing yet."""
    grid = [1e-3, 1e-2] if quick else FIRST_GRID
    widen = 0 if quick else MAX_WIDEN  # --quick: no widening (sweep_state's own tests cover it)
    seeds = SEEDS[:2] if quick else SEEDS
    out, best, todo = [], {}, {}
    for arm in CORE:
        todo[arm], best[arm] = sweep_state(done, arm, grid, widen)
    for arm in OTHER:  # --quick: one lr, the sweep's code path without its runs
        todo[arm], best[arm] = sweep_state(done, arm, grid[:1] if quick else grid,
                                           0 if quick else widen)  # fmt: skip

    def add(stage, arm, lr, seeds, frac=1.0):
        out.extend((stage, run_id(arm, lr, s, frac), arm, lr, s, frac) for s in seeds)

    for i in range(max(len(todo[a]) for a in CORE)):  # the core sweeps, interleaved
        for arm in CORE:
            if i < len(todo[arm]):
                add(0, arm, todo[arm][i], [0])
    for arm in CORE:
        if best[arm] is not None:
            add(1, arm, best[arm], seeds[1:])
    for arm in OTHER:
        for lr in todo[arm]:
            add(2, arm, lr, [0])
    for arm in CORE:  # a quarter of the training data, at the full data's best lr
        if best[arm] is not None:
            add(3, arm, best[arm], seeds[:1] if quick else seeds, frac=0.25)
    if task == "unicode" and best["squash"] is not None:
        for arm in QUICK_LEVERS if quick else LEVERS:
            add(4, arm, best["squash"], [0])
    if task == "unicode":  # the base under the fine-tune, at its method's best lr on NF4;
        # seed by seed, so that every arm has a run before any has its second
        for seed in seeds[:1] if quick else seeds:
            for arm in QUICK_BASES if quick else BASES:
                method = arm.rsplit("_", 1)[0]
                if best[method] is not None:
                    add(5, arm, best[method], [seed])
    return out


CORE, OTHER = ["qlora_r16", "squash"], ["squash_a", "lora_dense"]
LEVERS = ["squash_static", "squash_svd", "squash_rslora", "squash_every5", "squash_drop10",
          "squash_drop50", "squash_until_end", "squash_s80", "squash_s95", "squash_loraplus"]  # fmt: skip
# --quick: the levers with code of their own (SVD init, two optimizer groups); the others change
# config values the core arms already pass through the recipe
QUICK_LEVERS = ["squash_svd", "squash_loraplus"]
BASES = ["qlora_r16_fp32", "squash_fp32", "qlora_r16_outliers", "squash_outliers"]
QUICK_BASES = ["qlora_r16_fp32", "squash_outliers"]  # one of each code path


# ---- the run files ------------------------------------------------------------------------------
def final(record: dict) -> dict:
    """A run's last point."""
    return record["points"][-1]


def finished(record: dict, steps: int) -> bool:
    """Whether a run is done with its last point at ``steps``."""
    return bool(record.get("done") and record["points"] and final(record)["step"] == steps)


def load_records(task_dir: Path) -> list:
    """Every run file of a task, finished or not, in name order."""
    return [json.loads(p.read_text()) for p in sorted(task_dir.glob("*.json"))]


def load_done(task_dir: Path, steps: int) -> dict:
    """Finished runs of a task: run id -> record (a record with a point at ``steps``)."""
    return {rec["id"]: rec for rec in load_records(task_dir) if finished(rec, steps)}


# ---- a run's recipe config ----------------------------------------------------------------------
def recipe_config(task: str, arm: dict, lr: float, seed: int, frac: float, run_dir: Path,
                  ckpt: Path, size: dict, n_train: int, device: str, dtype: str,
                  resume: bool) -> dict:  # fmt: skip
    """The config ``SquashFinetuneRecipeSingleDevice`` runs for arm ``arm`` at ``lr``, ``seed``
    and ``frac`` of the ``n_train`` training samples, writing to ``run_dir``."""
    if arm.get("sparsity") is None:
        model = dict(_component_="squash.models.smollm2.qlora_smollm2_135m")
    else:
        model = dict(_component_="squash.models.smollm2.squash_smollm2_135m", quantize_base=True,
                     sparsity=arm["sparsity"], sparse_factor=arm["factor"])  # fmt: skip
        if arm.get("init"):
            model["init"] = arm["init"]
    model.update(lora_attn_modules=ATTN, apply_lora_to_mlp=True, lora_rank=arm["rank"],
                 lora_alpha=arm["alpha"])  # fmt: skip
    if arm.get("base") == "fp32":
        model["quantize_base"] = False
    elif arm.get("base") == "outliers":
        model["base_outliers"] = dict(arm["base_outliers"])
    steps, every = size["steps"], size["eval_every"]
    dataset = dict(_component_=TASKS[task]["dataset"], split="train", **TASKS[task].get("args", {}))
    if frac != 1.0:
        dataset["max_samples"] = max(size["batch"], round(frac * n_train))
    batches = (dataset.get("max_samples", n_train)) // size["batch"]
    cfg = dict(
        output_dir=str(run_dir), model=model,
        tokenizer=dict(_component_="squash.models.smollm2.smollm2_tokenizer", path=str(ckpt),
                       max_seq_len=TASKS[task]["max_seq_len"]),
        checkpointer=dict(_component_="torchtune.training.FullModelHFCheckpointer",
                          checkpoint_dir=str(ckpt), checkpoint_files=["model.safetensors"],
                          model_type="LLAMA3_2", output_dir=str(run_dir)),
        resume_from_checkpoint=resume, save_adapter_weights_only=True,
        save_every_n_steps=every, keep_last_n=1,
        dataset=dataset, seed=seed, shuffle=True, batch_size=size["batch"],
        optimizer=dict(_component_="torch.optim.AdamW", lr=lr, weight_decay=0.0),
        lr_scheduler=dict(
            _component_="torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
            num_warmup_steps=size["warmup"]),
        loss=dict(_component_="torch.nn.CrossEntropyLoss"),
        # as few epochs as the steps need, each at most one pass over the data
        epochs=math.ceil(steps / batches), max_steps_per_epoch=steps // math.ceil(steps / batches),
        gradient_accumulation_steps=1, clip_grad_norm=1.0, compile=False, device=device,
        dtype=dtype, enable_activation_checkpointing=False, enable_activation_offloading=False,
        metric_logger=dict(_component_="torchtune.training.metric_logging.DiskLogger",
                           log_dir=str(run_dir / "logs")),
        log_every_n_steps=1, log_peak_memory_stats=False,
    )  # fmt: skip
    if cfg["epochs"] * cfg["max_steps_per_epoch"] != steps:
        raise ValueError(f"{steps} steps do not split into equal epochs of at most {batches} "
                         "batches")
    if arm.get("mask_update"):
        cfg["mask_update"] = dict(arm["mask_update"])
    if arm.get("lora_plus_ratio"):
        cfg["lora_plus_lr_ratio"] = arm["lora_plus_ratio"]
    return cfg
