"""Learning curves at equal memory on SmolLM2-135M-Instruct: QLoRA against squash, at length.

    python benchmarks/quality_curves.py work --threads 1     # one worker; start two side by side
    python benchmarks/quality_curves.py status               # what is done, running, next
    python benchmarks/quality_curves.py report               # tables + plots from the run files
    python benchmarks/quality_curves.py work --quick ...     # every stage on toy sizes

Every run fine-tunes through the recipe class users run (``SquashFinetuneRecipeSingleDevice``,
a config built in code, the NF4 base from ``squash download smollm2-135m-instruct``) for
:data:`FULL` ``steps`` steps of batch 8 with a cosine schedule, and scores the adapted model on the
whole validation and test splits before the first step and every ``eval_every`` steps: held-out
loss per answer token and the task metric (greedy exact match, computed under teacher forcing).
The points are taken right after the recipe's own step checkpoint is written, so a killed run
resumes from its last point through the recipe's exact resume (``resume_from_checkpoint``).

Two tasks of different kinds (``--task``):

- ``unicode``: name a Unicode character (``squash.datasets.unicode_names_dataset``); metric: the
  whole name and its stop token.
- ``pydocs``: explain a standard-library API in its docstring's prose
  (``squash.datasets.python_docs_dataset``, two to four sentences, splits disjoint by package);
  metric: the answer's first sentence.

Work is a queue of runs (:func:`plan`): each arm's learning rate swept on validation at the full
length (widened while the best is at an edge), then more seeds at the best rate, then a quarter
of the training data, then single-seed lever rows. Any number of workers share it: a run is
claimed by a lock held on an open file, each run writes its own json under
``benchmarks/results/quality_curves/<task>/`` after every point, and ``report`` reads them all.
"""

import argparse
import fcntl
import functools
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, padded_collate_sft  # noqa: E402

from squash.training import lora_adapter_memory, max_rank_within  # noqa: E402
from squash.training.memory import base_memory  # noqa: E402
from squash.training.heldout import next_token_loss  # noqa: E402

from common import adapted_shapes as _shapes  # noqa: E402
from common import has_matplotlib, host, mean_std, pyplot, save_png, welch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "quality_curves"
WORK = Path.home() / ".cache" / "squash" / "quality_curves"
DEFAULT_CKPT = Path.home() / ".cache" / "squash" / "smollm2-135m-instruct"
IGNORE = CROSS_ENTROPY_IGNORE_IDX
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


# ---- arms -----------------------------------------------------------------------------------
def adapted_shapes() -> list:
    """``(in, out)`` of SmolLM2-135M's adapted linears: all seven of each of its 30 layers."""
    return _shapes("smollm2")


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


# ---- the queue ------------------------------------------------------------------------------
def run_id(arm: str, lr: float, seed: int, frac: float = 1.0) -> str:
    return f"{arm}_lr{lr:.0e}_s{seed}" + ("" if frac == 1.0 else f"_d{frac:g}")


def sweep_state(done: dict, arm: str, grid=FIRST_GRID, max_widen=MAX_WIDEN) -> tuple:
    """``(lrs to run, best lr or None)`` of an arm's sweep from its finished seed-0 runs
    (``done``: run id -> record). The grid is widened one ladder step past an edge that holds
    the best final validation loss, at most ``max_widen`` times; ``best`` is set once no run
    is left."""
    lrs = list(grid)
    for _ in range(max_widen + 1):
        missing = [lr for lr in lrs if run_id(arm, lr, 0) not in done]
        if missing:
            return missing, None
        val = {lr: final(done[run_id(arm, lr, 0)])["val"]["loss"] for lr in lrs}
        best = min(lrs, key=lambda lr: (val[lr], lr))
        lo, hi = min(lrs), max(lrs)
        i = LADDER.index(best)
        nxt = LADDER[i - 1] if best == lo and i > 0 else LADDER[i + 1] if (
            best == hi and i + 1 < len(LADDER)) else None  # fmt: skip
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
    widen = 1 if quick else MAX_WIDEN
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
            add(3, arm, best[arm], seeds, frac=0.25)
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
# --quick: one lever of each code path (mask off, SVD init, two optimizer groups, another rank)
QUICK_LEVERS = ["squash_static", "squash_svd", "squash_loraplus", "squash_s80"]
BASES = ["qlora_r16_fp32", "squash_fp32", "qlora_r16_outliers", "squash_outliers"]
QUICK_BASES = ["qlora_r16_fp32", "squash_outliers"]  # one of each code path


def final(record: dict) -> dict:
    return record["points"][-1]


def load_done(task_dir: Path, steps: int) -> dict:
    """Finished runs of a task: run id -> record (a record with a point at ``steps``)."""
    out = {}
    for path in sorted(task_dir.glob("*.json")):
        rec = json.loads(path.read_text())
        if rec.get("done") and rec["points"] and rec["points"][-1]["step"] == steps:
            out[rec["id"]] = rec
    return out


class Claim:
    """A run claimed by an exclusive ``flock`` on ``<work>/claims/<id>.lock``: released when
    this process exits, however it exits."""

    def __init__(self, work: Path, rid: str):
        (work / "claims").mkdir(parents=True, exist_ok=True)
        self._f = open(work / "claims" / f"{rid}.lock", "a")
        try:
            fcntl.flock(self._f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._f.close()
            raise
        self._f.truncate(0)
        self._f.write(f"{os.getpid()}\n")
        self._f.flush()

    def release(self) -> None:
        self._f.close()


# ---- scoring --------------------------------------------------------------------------------
def required_tokens(task: str, sample: dict, answer: str, tok) -> int:
    """How many answer tokens (from the first) the task metric needs right: for ``unicode``
    every answer token up to and including the first stop token; for ``pydocs`` the tokens of
    the answer's first sentence (and the turn's header before them), found at the answer's
    start (checked)."""
    targets = [t for t in sample["labels"] if t != IGNORE]
    if task == "unicode":
        stops = set(tok.stop_tokens)
        return next(i + 1 for i, t in enumerate(targets) if t in stops)
    from squash.datasets.python_docs import first_sentence

    ids = tok.encode(first_sentence(answer), add_bos=False, add_eos=False)
    # the assistant turn's header (``<|im_start|>assistant\n``) comes first in the labels
    for start in range(min(8, len(targets))):
        if targets[start : start + len(ids)] == ids:
            return start + len(ids)
    raise ValueError(f"the first sentence's tokens do not open the answer's: {answer!r}")


def load_split(task: str, tok, split: str, n: int) -> list:
    """The first ``n`` samples of a split with the number of metric tokens of each."""
    from torchtune import config

    ds = config.instantiate(OmegaConf.create({"_component_": TASKS[task]["dataset"]}), tok,
                            split=split, max_samples=n)  # fmt: skip
    out = []
    for i in range(len(ds)):
        s = ds[i]
        out.append(dict(s, required=required_tokens(task, s, ds.answer(i), tok)))
    return out


def score_batch(logits: torch.Tensor, labels: torch.Tensor, required: list) -> tuple:
    """``(summed cross-entropy over answer tokens, answer tokens, exact-match flags)`` of one
    batch; ``labels`` ``(b, s)`` unshifted (position t's logits predict labels[t + 1])."""
    ce, _ = next_token_loss(logits, labels, IGNORE)  # squash's held-out loss
    logits, targets = logits[:, :-1], labels[:, 1:]
    valid = targets != IGNORE
    rank = torch.cumsum(valid.int(), dim=1)  # 1 at a row's first answer token
    need = valid & (rank <= torch.tensor(required, device=labels.device)[:, None])
    hit = ((logits.argmax(-1) == targets) | ~need).all(-1)
    return float(ce), int(valid.sum()), [bool(h) for h in hit]


@torch.no_grad()
def evaluate(model, samples: list, *, pad_id: int, device, batch: int = 16) -> dict:
    """Held-out loss per answer token and exact match over ``samples``."""
    was = model.training
    model.eval()
    ce = tokens = 0
    hits = []
    for i in range(0, len(samples), batch):
        part = samples[i : i + batch]
        b = padded_collate_sft([{k: s[k] for k in ("tokens", "labels")} for s in part],
                               padding_idx=pad_id, ignore_idx=IGNORE)  # fmt: skip
        logits = model(b["tokens"].to(device))
        if isinstance(logits, list):
            logits = torch.cat(logits, dim=1)
        c, t, h = score_batch(logits, b["labels"].to(device), [s["required"] for s in part])
        ce, tokens, hits = ce + c, tokens + t, hits + h
    model.train(was)
    return {"loss": ce / tokens, "exact_match": sum(hits) / len(hits)}


# ---- one run --------------------------------------------------------------------------------
def recipe_config(task: str, arm: dict, lr: float, seed: int, frac: float, run_dir: Path,
                  ckpt: Path, size: dict, n_train: int, device: str, dtype: str,
                  resume: bool) -> dict:  # fmt: skip
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
    dataset = dict(_component_=TASKS[task]["dataset"], split="train")
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


def write_text(path: Path, text: str) -> None:
    """``text`` at ``path``, written to a temporary file and renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_json(path: Path, obj: dict) -> None:
    write_text(path, json.dumps(obj, indent=1))


def run_one(task: str, arm: dict, lr: float, seed: int, frac: float, *, size: dict, ckpt: Path,
            out: Path, work: Path, data: dict, n_train: int, device: str, dtype: str,
            keep: bool = False) -> dict:  # fmt: skip
    """One run, resumed where a killed one stopped; its record is rewritten after every
    point. A finished run's checkpoints are deleted unless ``keep``."""
    from squash_finetune import SquashFinetuneRecipeSingleDevice

    rid = run_id(arm["key"], lr, seed, frac)
    run_dir = work / "runs" / task / rid
    rec = json.loads(out.read_text()) if out.exists() else None
    from squash.training.checkpoint import latest_checkpoint

    if rec is None or not rec["points"] or latest_checkpoint(run_dir) is None:
        shutil.rmtree(run_dir, ignore_errors=True)
        rec = dict(id=rid, task=task, arm=arm, lr=lr, seed=seed, frac=frac, size=size,
                   n_train=n_train, device=device, dtype=dtype, points=[], done=False,
                   sessions=[])  # fmt: skip
    resume = bool(rec["points"])
    rec["sessions"].append(dict(machine=host(), started=time.strftime("%Y-%m-%d %H:%M:%S"),
                                resumed_at=rec["points"][-1]["step"] if resume else 0))  # fmt: skip
    cfg = OmegaConf.create(recipe_config(task, arm, lr, seed, frac, run_dir, ckpt, size, n_train,
                                         device, dtype, resume))  # fmt: skip
    train_losses = []
    t_start = time.perf_counter()

    def point(recipe, step):
        t = time.perf_counter()
        kw = dict(pad_id=recipe._tokenizer.pad_id, device=recipe._device)
        p = dict(step=step, **{k: evaluate(recipe._model, v, **kw) for k, v in data.items()})
        p.update(train_loss=statistics.fmean(train_losses) if train_losses else None,
                 eval_s=time.perf_counter() - t, wall_s=time.perf_counter() - t_start)
        train_losses.clear()
        rec["points"] = [q for q in rec["points"] if q["step"] < step] + [p]
        write_json(out, rec)
        print(f"[{task} {rid}] step {step}: val {p['val']['loss']:.4f}/{p['val']['exact_match']:.3f}"
              f" test {p['test']['loss']:.4f}/{p['test']['exact_match']:.3f} "
              f"({p['wall_s']:.0f} s)", flush=True)  # fmt: skip

    class CurveRecipe(SquashFinetuneRecipeSingleDevice):
        def save_checkpoint(self, epoch, name=None):
            path = super().save_checkpoint(epoch, name)
            if name is not None and name.startswith("step_"):
                point(self, int(name[len("step_") :]))
            return path

    recipe = CurveRecipe(cfg=cfg)
    try:
        recipe.setup(cfg=cfg)
        log_dict = recipe._metric_logger.log_dict

        def logged(payload, step):
            if "loss" in payload:
                train_losses.append(float(payload["loss"]))
            return log_dict(payload, step)

        recipe._metric_logger.log_dict = logged
        if not rec["points"]:
            point(recipe, 0)
        elif recipe.global_step > rec["points"][-1]["step"]:
            point(recipe, recipe.global_step)
        recipe.train()
    finally:
        recipe.cleanup()
    rec["done"] = rec["points"][-1]["step"] == size["steps"]
    rec["sessions"][-1]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    rec["sessions"][-1]["seconds"] = time.perf_counter() - t_start
    write_json(out, rec)
    if rec["done"] and not keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return rec


def work_loop(args) -> None:
    size = dict(QUICK if args.quick else FULL)
    tasks = args.tasks.split(",")
    results = args.results or (RESULTS.with_name("quality_curves_quick") if args.quick else RESULTS)
    work = args.work or (WORK.with_name("quality_curves_quick") if args.quick else WORK)
    if args.threads:
        torch.set_num_threads(args.threads)
    import squash_finetune  # noqa: F401

    import logging

    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torchtune", "squash")):
            logging.getLogger(name).setLevel(logging.WARNING)
    from squash.models.smollm2 import smollm2_tokenizer

    ckpt = Path(args.checkpoint_dir or DEFAULT_CKPT)
    by_key = arms(size["steps"])
    cache = {}
    ran = 0
    while args.max_runs is None or ran < args.max_runs:
        todo = None
        done = {task: load_done(results / task, size["steps"]) for task in tasks}
        queue = sorted(((stage, tasks.index(task), rid, task, arm, lr, seed, frac)
                        for task in tasks
                        for stage, rid, arm, lr, seed, frac in plan(task, done[task], args.quick)
                        if rid not in done[task]),
                       key=lambda q: q[:2])  # fmt: skip
        for _, _, rid, task, arm, lr, seed, frac in queue:
            try:
                claim = Claim(work, f"{task}_{rid}")
            except OSError:
                continue
            todo = (task, rid, arm, lr, seed, frac, claim)
            break
        if todo is None:
            print("nothing left to run (or everything left is claimed)", flush=True)
            return
        task, rid, arm, lr, seed, frac, claim = todo
        try:
            if task not in cache:
                tok = smollm2_tokenizer(str(ckpt), max_seq_len=TASKS[task]["max_seq_len"])
                data = {"val": load_split(task, tok, "validation", size["n_val"]),
                        "test": load_split(task, tok, "test", size["n_test"])}  # fmt: skip
                cache[task] = (data, _n_train(task))
            data, n_train = cache[task]
            print(f"[{task} {rid}] starting ({by_key[arm]['name']}, lr {lr:.0e}, seed {seed}, "
                  f"data {frac:g})", flush=True)  # fmt: skip
            run_one(task, by_key[arm], lr, seed, frac, size=size, ckpt=ckpt,
                    out=results / task / f"{rid}.json", work=work, data=data, n_train=n_train,
                    device=args.device, dtype=args.dtype, keep=args.keep_checkpoints)  # fmt: skip
        finally:
            claim.release()
        ran += 1


def _n_train(task: str) -> int:
    if task == "unicode":
        from squash.datasets.unicode_names import unicode_name_pairs

        return len(unicode_name_pairs("train"))
    from squash.datasets.python_docs import python_doc_splits

    return len(python_doc_splits()["train"])


# ---- the report (mean_std, welch: common's) ------------------------------------------------
def load_records(task_dir: Path) -> list:
    return [json.loads(p.read_text()) for p in sorted(task_dir.glob("*.json"))]


def rows(records: list, steps: int) -> dict:
    """Finished runs grouped as ``{(arm, frac): {"sweep": {lr: record of seed 0}, "best": lr,
    "seeds": [records at the best lr, seed order]}}``; the best lr is the sweep's lowest final
    validation loss (for a row that was not swept, its one lr)."""
    out = {}
    for r in records:
        if r.get("done") and r["points"][-1]["step"] == steps:
            g = out.setdefault((r["arm"]["key"], r["frac"]), {"by_lr": {}})
            g["by_lr"].setdefault(r["lr"], []).append(r)
    for g in out.values():
        sweep = {lr: next((r for r in rs if r["seed"] == 0), None) for lr, rs in g["by_lr"].items()}
        g["sweep"] = {lr: r for lr, r in sweep.items() if r is not None}
        if g["sweep"]:
            g["best"] = min(g["sweep"], key=lambda lr: (final(g["sweep"][lr])["val"]["loss"], lr))
        else:
            g["best"] = min(g["by_lr"])
        g["seeds"] = sorted(g["by_lr"][g["best"]], key=lambda r: r["seed"])
    return out


def curve(records: list, split: str, metric: str) -> tuple:
    """``(steps, means, mins, maxs)`` of ``metric`` over ``records`` (seeds) at each step."""
    steps = [p["step"] for p in records[0]["points"]]
    vals = [[r["points"][i][split][metric] for r in records] for i in range(len(steps))]
    return steps, [statistics.fmean(v) for v in vals], [min(v) for v in vals], [max(v) for v in vals]


def _pm(values: list, fmt: str = ".3f") -> str:
    m, s = mean_std(values)
    return f"{m:{fmt}} +/- {s:{fmt}}" if len(values) > 1 else f"{m:{fmt}}"


def _t(w: dict) -> str:
    return "n/a" if math.isnan(w["t"]) else f"{w['t']:+.2f} ({w['df']:.1f}, p={w['p']:.3g})"


def best_point(rec: dict) -> dict:
    """The point of a run with the lowest validation loss after step 0 (the earliest of equals):
    what early stopping on validation would keep."""
    trained = [p for p in rec["points"] if p["step"] > 0] or rec["points"]
    return min(trained, key=lambda p: (p["val"]["loss"], p["step"]))


def _test_cells(g: dict, key: str, frac: float, pick) -> tuple:
    """``(test losses, exact matches, t of the loss, t of the exact match)`` of an arm's seeds at
    the point ``pick(record)`` chooses; each t against QLoRA r=16 on the same data ("" for QLoRA
    itself or where it has no row)."""
    def values(row, metric):
        return [pick(r)["test"][metric] for r in row["seeds"]]

    row, ref = g[(key, frac)], g.get(("qlora_r16", frac))
    loss, em = values(row, "loss"), values(row, "exact_match")
    if ref is None or key == "qlora_r16":
        return loss, em, "", ""
    return (loss, em, _t(welch(loss, values(ref, "loss"))),
            _t(welch(em, values(ref, "exact_match"))))


def task_report(task: str, records: list, size: dict) -> tuple:
    """The markdown of one task and the data of its plot."""
    g = rows(records, size["steps"])
    lines = [f"### {task}", ""]
    if not g:
        return lines + ["No finished run yet.", ""], g
    base = next(r["points"][0] for r in records if r["points"])
    lines += [f"Before fine-tuning (step 0, NF4 base): test loss {base['test']['loss']:.3f}, "
              f"exact match {base['test']['exact_match']:.3f}.", "",
              f"At step {size['steps']} (batch {size['batch']}; mean +/- sample std over seeds; "
              "Welch's t against QLoRA r=16 on the same data: t (df, p)):", "",
              "| arm | data | memory vs QLoRA r=16 | lr sweep: final val loss | best lr | seeds | "
              "test loss | test exact match | t (loss) | t (exact match) |",
              "|---|---:|---:|---|---:|---:|---:|---:|---|---|"]  # fmt: skip
    order = list(arms(size["steps"]))
    main = sorted(((k, r) for k, r in g.items() if k[0] not in BASES),
                  key=lambda kv: (kv[0][1] != 1.0, order.index(kv[0][0])))  # fmt: skip
    for (key, frac), row in main:
        arm = row["seeds"][0]["arm"]
        cells = "; ".join(
            (f"**{lr:.0e}: {final(r)['val']['loss']:.3f}**" if lr == row["best"] else
             f"{lr:.0e}: {final(r)['val']['loss']:.3f}") for lr, r in sorted(row["sweep"].items())
        ) if len(row["sweep"]) > 1 else "(fixed)"  # fmt: skip
        loss, em, tl, te = _test_cells(g, key, frac, final)
        lines.append(f"| {arm['name']} | {frac:g} | {arm['vs_qlora_r16']:.2f}x | {cells} | "
                     f"{row['best']:.0e} | {len(row['seeds'])} | {_pm(loss)} | {_pm(em)} | {tl} | "
                     f"{te} |")  # fmt: skip
    lines += ["", "At each seed's best validation point (the step of its lowest validation loss, "
              "as early stopping would keep; same statistics):", "",
              "| arm | data | seeds | steps kept | test loss | test exact match | t (loss) | "
              "t (exact match) |", "|---|---:|---:|---|---:|---:|---|---|"]  # fmt: skip
    for (key, frac), row in main:
        kept = [best_point(r) for r in row["seeds"]]
        loss, em, tl, te = _test_cells(g, key, frac, best_point)
        lines.append(f"| {row['seeds'][0]['arm']['name']} | {frac:g} | {len(kept)} | "
                     f"{', '.join(str(p['step']) for p in kept)} | {_pm(loss)} | {_pm(em)} | "
                     f"{tl} | {te} |")  # fmt: skip
    steps = curve(next(iter(g.values()))["seeds"], "test", "loss")[0]
    lines += ["", "Test loss (exact match) against step, mean over seeds, full data:", "",
              "| arm | " + " | ".join(str(s) for s in steps) + " |",
              "|---|" + "---:|" * len(steps)]  # fmt: skip
    for (key, frac), row in g.items():
        if frac != 1.0 or key in LEVERS or key in BASES:
            continue
        _, lo, _, _ = curve(row["seeds"], "test", "loss")
        _, em, _, _ = curve(row["seeds"], "test", "exact_match")
        lines.append(f"| {row['seeds'][0]['arm']['name']} | "
                     + " | ".join(f"{a:.3f} ({b:.2f})" for a, b in zip(lo, em)) + " |")
    lines += base_report(g, size)
    hours = sum(sess.get("seconds", 0) for r in records for sess in r["sessions"]) / 3600
    hosts = sorted({sess["machine"] for r in records for sess in r["sessions"]})
    lines += ["", f"{len(records)} runs, {hours:.1f} h of run time in all; hosts: "
              + "; ".join(hosts) + ".", ""]
    return lines, g


@functools.lru_cache(maxsize=None)
def base_bytes(key: str) -> int:
    """Bytes of the frozen model arm ``key`` trains on (NF4 codes and scalers, the outliers'
    values and indices, dense tensors; tied embeddings once): ``base_memory`` of the model its
    recipe config builds, built on the meta device."""
    from squash.training.model_setup import build_adapter_model

    arm = arms(FULL["steps"])[key]
    cfg = recipe_config("unicode", arm, 1e-3, 0, 1.0, Path("/unused"), Path("/unused"),
                        dict(FULL), 885, "cpu", "fp32", False)  # fmt: skip
    model = build_adapter_model(OmegaConf.create(cfg["model"]), device="meta",
                                dtype=torch.float32)  # fmt: skip
    return base_memory(model)


def base_report(g: dict, size: dict) -> list:
    """The base-arm section: each method on NF4, NF4 + outliers and fp32 (empty without a base
    arm's finished runs)."""
    if not any((k, 1.0) in g for k in BASES):
        return []
    lines = ["", "The base under the fine-tune: each method at its best learning rate on NF4, "
             "trained on NF4 + 1% sensitivity outliers and on the unquantized fp32 base (Welch's "
             "t against the same method on NF4; gap closed = (NF4 - base) / (NF4 - fp32) of the "
             "mean test loss; memory: the frozen base, counted from the model's tensors, and the "
             "adapter with its gradient and AdamW state):", "",
             "| method | base | frozen base MiB | adapter MiB | seeds | test loss | test exact "
             "match | t vs NF4 (loss) | gap closed | best-point test loss | t vs NF4 | gap "
             "closed |", "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---|---:|"]  # fmt: skip
    mib = 1024**2
    for method in ("qlora_r16", "squash"):
        ref, fp32 = g.get((method, 1.0)), g.get((f"{method}_fp32", 1.0))
        for key, label in ((method, "NF4"), (f"{method}_outliers", "NF4 + 1% outliers"),
                           (f"{method}_fp32", "fp32")):  # fmt: skip
            row = g.get((key, 1.0))
            if row is None:
                continue
            cells = []
            for pick in (final, best_point):
                loss = [pick(r)["test"]["loss"] for r in row["seeds"]]
                em = [pick(r)["test"]["exact_match"] for r in row["seeds"]]
                ref_loss = [pick(r)["test"]["loss"] for r in ref["seeds"]] if ref else None
                t = _t(welch(loss, ref_loss)) if ref and key != method else ""
                gap = ""
                if ref and fp32 and key != method:
                    nf4, full = statistics.fmean(ref_loss), statistics.fmean(
                        [pick(r)["test"]["loss"] for r in fp32["seeds"]])
                    gap = f"{(nf4 - statistics.fmean(loss)) / (nf4 - full):.0%}" if nf4 != full else ""
                cells.append((loss, em, t, gap))
            (loss, em, t, gap), (bloss, _, bt, bgap) = cells
            arm = row["seeds"][0]["arm"]
            lines.append(f"| {'QLoRA r=16' if method == 'qlora_r16' else 'squash'} | {label} | "
                         f"{base_bytes(key) / mib:.1f} | {arm['adapter_bytes'] / mib:.1f} | "
                         f"{len(row['seeds'])} | {_pm(loss)} | {_pm(em)} | {t} | {gap} | "
                         f"{_pm(bloss)} | {bt} | {bgap} |")  # fmt: skip
    return lines


def plot(path: Path, groups: dict, task: str) -> None:
    """Test loss and exact match against step, one line per arm (mean over seeds) with the
    seeds' range shaded; full data solid, a quarter dashed."""
    fig, axes = pyplot().subplots(1, 2, figsize=(11, 4))
    colors = {"qlora_r16": "tab:blue", "squash": "tab:red", "squash_a": "tab:orange",
              "lora_dense": "tab:gray"}  # fmt: skip
    for (key, frac), row in sorted(groups.items()):
        if key not in colors:
            continue
        label = row["seeds"][0]["arm"]["name"] + ("" if frac == 1.0 else f", {frac:g} of the data")
        for ax, metric in zip(axes, ("loss", "exact_match")):
            x, m, lo, hi = curve(row["seeds"], "test", metric)
            ls = "-" if frac == 1.0 else "--"
            ax.plot(x, m, ls, color=colors[key], label=f"{label} ({len(row['seeds'])} seeds)")
            ax.fill_between(x, lo, hi, color=colors[key], alpha=0.15)
    axes[0].set(xlabel="step (batch 8)", ylabel="test loss per answer token", yscale="log")
    axes[1].set(xlabel="step (batch 8)", ylabel="test exact match")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"SmolLM2-135M-Instruct, task {task}: QLoRA r=16 against squash at equal memory")
    fig.tight_layout()
    save_png(fig, path)


def report(results: Path, tasks: list, size: dict, png_dir: Path = None) -> str:
    """The markdown of every task (and a PNG per task beside ``results``; with ``png_dir``, a copy
    of each as ``png_dir/quality_curves_<task>.png``, where the README shows them)."""
    lines = ["# Learning curves: QLoRA r=16 against squash at equal memory", "",
             "Written by `python benchmarks/quality_curves.py report` from the run files in "
             f"`{results.relative_to(ROOT) if results.is_relative_to(ROOT) else results}/`.", ""]  # fmt: skip
    for task in tasks:
        recs = load_records(results / task)
        text, groups = task_report(task, recs, size)
        lines += text
        if groups and not has_matplotlib():
            lines += ["(no plot: matplotlib is not installed; `pip install -e .[plot]`)", ""]
        elif groups:
            png = results / f"{task}.png"
            plot(png, groups, task)
            if png_dir is not None:
                png_dir.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(png, png_dir / f"quality_curves_{task}.png")
            lines += [f"![{task}]({png.name})", ""]
    return "\n".join(lines)


def status(results: Path, work: Path, tasks: list, size: dict, quick: bool) -> str:
    out = []
    for task in tasks:
        done = load_done(results / task, size["steps"])
        partial = [r for r in load_records(results / task) if not r.get("done")]
        todo = [q for q in plan(task, done, quick) if q[1] not in done]
        running = []
        for q in todo:
            try:
                Claim(work, f"{task}_{q[1]}").release()
            except OSError:
                running.append(q[1])
        waiting = [q[1] for q in todo if q[1] not in running]
        out.append(f"{task}: {len(done)} done; running: {', '.join(running) or 'none'}; "
                   "stopped part-way: "
                   + (", ".join(f"{r['id']} at step {r['points'][-1]['step'] if r['points'] else 0}"
                                for r in partial if r["id"] not in running) or "none")
                   + f"; queued now: {len(waiting)}" + (f" (next {waiting[0]})" if waiting else ""))  # fmt: skip
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("command", choices=["work", "status", "report"])
    p.add_argument("--tasks", default="unicode,pydocs", help="comma-separated, in priority order")
    p.add_argument("--quick", action="store_true", help="toy sizes: every stage in minutes")
    p.add_argument("--checkpoint-dir", default=None, help="squash download's output directory")
    p.add_argument("--results", type=Path, default=None)
    p.add_argument("--work", type=Path, default=None, help="claims and run checkpoints")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-runs", type=int, default=None)
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep each finished run's checkpoints in --work (default: deleted)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--png-dir", type=Path, default=None,
                   help="report: also copy each task's PNG here as quality_curves_<task>.png "
                        "(the README shows docs/benchmarks/quality_curves_*.png)")
    args = p.parse_args(argv)
    if args.command == "work":
        return work_loop(args)
    size = dict(QUICK if args.quick else FULL)
    results = args.results or (RESULTS.with_name("quality_curves_quick") if args.quick else RESULTS)
    tasks = args.tasks.split(",")
    if args.command == "status":
        print(status(results, args.work or WORK, tasks, size, args.quick))
    else:
        text = report(results, tasks, size, args.png_dir)
        write_text(results / "README.md", text)
        print(text)
        print(f"Wrote {results / 'README.md'} and a PNG per task beside it")


if __name__ == "__main__":
    main(sys.argv[1:])
