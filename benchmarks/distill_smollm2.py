"""Distillation on a real model: how much of what NF4 loses on SmolLM2-135M-Instruct each loss recovers.

    python benchmarks/distill.py --model smollm2                    # the run in the README
    python benchmarks/distill.py --model smollm2 --quick            # a smoke run of every stage
    python benchmarks/distill.py --model smollm2 --device cuda --dtype bf16
    python benchmarks/distill_smollm2.py ...                        # the same script

``--checkpoint-dir DIR`` is what ``squash download smollm2-135m-instruct --output-dir DIR``
writes; without it the script runs that download into ``~/.cache/squash/smollm2-135m-instruct``
once (``benchmarks/quality_smollm2.py``'s ``ensure_checkpoint``).

The teacher is SmolLM2-135M-Instruct unquantized; the student is its NF4 copy with the squash
adapters of ``configs/smollm2_135m_distill.yaml`` (rank 143, both factors 90% sparse, all seven
linears of the 30 layers, a mask update every 5 steps). The text is real English prose the
model did not see in this form: the Python Language Reference that ships with CPython
(:mod:`squash.datasets.pydoc_text`, split by document into train / validation / test sharing no
run of 13 words), in windows of ``--seq-len`` tokens, plain text completion.

First the NF4 gap: the held-out perplexity of the teacher and of the student before its first
step (the NF4 base; every adapter's B is zero, so it adds nothing). Then four arms, each
``SquashDistillRecipeSingleDevice`` run in this process on a config built from the YAML, the
same data, steps and batches, differing only in the loss weights ``(task_weight, kd_weight,
squarehead_weight)`` and the learning rate: plain CE ``(1, 0, 0)``, logit KL alone ``(0, 1, 0)``,
SquareHead alone ``(0, 0, 1)`` (layers 1 .. 29) and SquareHead + KL ``(0, 1, 1)``. Each arm's
learning rate is picked on the validation split (seed 0) from a log grid, widened once past an
edge that holds the best (``benchmarks/quality.py``'s ``sweep``); then ``--seeds`` seeds on the
test split at that rate (seed 0 is the sweep's run). Perplexity = exp(mean NLL per predicted
token) over all the split's windows, by a plain forward of the model in memory
(:func:`perplexity`, equal to transformers' ``LlamaForCausalLM`` loss on the same windows).
Gap closed = 1 - (student - teacher) / (NF4 - teacher) on the mean test perplexity. Beside it,
how close each student is to the teacher: the mean per-token KL(teacher || student) over the
test windows (the teacher's log-probabilities computed once), and KL closed = 1 - KL(student) /
KL(NF4 student). The two can disagree: plain CE on text of one domain can go below the teacher's
perplexity (past 100% of the gap) while staying further from the teacher. Welch's t compares
SquareHead + KL with KL alone (and each arm with plain CE) on both.

One teacher is built, scored, and handed to every run (the recipe's teacher set-up returns it);
the student and its NF4 base are built by each run as the recipe does.

Writes ``benchmarks/results/distill_smollm2.md`` (``distill_smollm2_quick.md`` with ``--quick``)
and ``.json`` beside it after every arm, so a run cut short keeps what it finished.
"""

import argparse
import contextlib
import gc
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # the recipe's progress bar, once per run

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

# quality_smollm2.py: the checkpoint download, the command line's sizes (sized_run), quiet
# recipe logs, a timed recipe run (set_up_train_score), the atomic table and json writer, an
# arm's splits and runs (run_splits, arm_runs: quality.py's sweep, then the seeds)
import quality_smollm2 as _q  # noqa: E402
from common import DTYPES, machine_line, mean_std, welch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CONFIG = ROOT / "configs" / "smollm2_135m_distill.yaml"
sys.path.insert(0, str(ROOT / "recipes"))  # this checkout's squash_distill before an installed one
ensure_checkpoint = _q.ensure_checkpoint

ARMS = [  # key, name, (task_weight, kd_weight, squarehead_weight)
    dict(key="ce", name="plain CE", weights=(1, 0, 0)),
    dict(key="kl", name="KL alone", weights=(0, 1, 0)),
    dict(key="sh", name="SquareHead alone", weights=(0, 0, 1)),
    dict(key="sh_kl", name="SquareHead + KL", weights=(0, 1, 1)),
]
ARM_KEYS = [a["key"] for a in ARMS]
# (arm, against): Welch's t of the first's test perplexity against the second's
PAIRS = [("sh_kl", "kl"), ("kl", "ce"), ("sh_kl", "ce"), ("sh", "ce")]

# Sized for ~45 minutes on a 2-core CPU (43 min measured with --threads 1, README): 16 runs
# (4 arms x (2 sweep runs + 2 more seeds)).
FULL = dict(steps=8, batch=4, seq_len=256, grid=[3e-3, 1e-2], max_widen=0, seeds=3, n_val=8,
            n_test=16)  # fmt: skip
# --quick: every stage on toy sizes (2 steps, a 2-point grid, 2 seeds, 2 windows a split).
QUICK = dict(steps=2, batch=2, seq_len=64, grid=[1e-3, 1e-2], max_widen=0, seeds=2, n_val=2,
             n_test=2)  # fmt: skip


# ---- arithmetic -----------------------------------------------------------------------------
def gap_closed(student: float, teacher: float, nf4: float) -> float:
    """``1 - (student - teacher) / (nf4 - teacher)``: 0 at the NF4 model, 1 at the teacher; nan
    when NF4 is no worse than the teacher (no gap to close)."""
    if not nf4 > teacher:
        return math.nan
    return 1.0 - (student - teacher) / (nf4 - teacher)


def summarize(arm: dict, sw: dict, best: float, at_edge: bool, test: list, seeds: list,
              teacher: float, nf4: float, nf4_kl: float = None) -> dict:  # fmt: skip
    """An arm's row: its sweep (``{lr: {"val": ..., "test": ...}}``), the chosen lr, per-seed
    test perplexities and losses, their mean and sample std, and the gap each closes; with
    ``nf4_kl`` (the NF4 model's KL to the teacher) and a ``kl`` in every test score, the KL's
    mean and std and ``kl_closed`` = 1 - mean KL / ``nf4_kl``."""
    ppl = [t["perplexity"] for t in test]
    m, s = mean_std(ppl)
    closed = [gap_closed(p, teacher, nf4) for p in ppl]
    kl = {}
    if nf4_kl is not None and all("kl" in t for t in test):
        km, ks = mean_std([t["kl"] for t in test])
        kl = dict(test_kl=[t["kl"] for t in test], kl_mean=km, kl_std=ks,
                  kl_closed=1.0 - km / nf4_kl if nf4_kl > 0 else math.nan)  # fmt: skip
    row = dict(
        arm, sweep={f"{lr:.6g}": {k: r[k] for k in ("val", "test") if k in r} for lr, r in sw.items()},
        best_lr=best, best_at_edge=at_edge, swept=len(sw) > 1, test_seeds=list(seeds),
        test_ppl=ppl, test_loss=[t["loss"] for t in test], ppl_mean=m, ppl_std=s,
        gap_closed=gap_closed(m, teacher, nf4), gap_closed_seeds=closed,
        gap_closed_std=mean_std(closed)[1] if not any(map(math.isnan, closed)) else math.nan,
    )  # fmt: skip
    row.update(kl)
    return row


def comparisons(rows: list) -> list:
    """Welch's t of each :data:`PAIRS` pair present, on the per-seed test perplexities."""
    by = {a["key"]: a for a in rows}
    out = []
    for a, b in PAIRS:
        if a in by and b in by:
            out.append(dict(arm=a, against=b, arm_name=by[a]["name"], against_name=by[b]["name"],
                            ppl_diff=by[a]["ppl_mean"] - by[b]["ppl_mean"],
                            welch=welch(by[a]["test_ppl"], by[b]["test_ppl"])))  # fmt: skip
            if "test_kl" in by[a] and "test_kl" in by[b]:
                out[-1].update(kl_diff=by[a]["kl_mean"] - by[b]["kl_mean"],
                               kl_welch=welch(by[a]["test_kl"], by[b]["test_kl"]))  # fmt: skip
    return out


# ---- models and scoring ---------------------------------------------------------------------
def recipe_config(arm: dict, lr: float, seed: int, run_dir: Path, ckpt: Path, size: dict,
                  device: str, dtype: str):  # fmt: skip
    """``configs/smollm2_135m_distill.yaml`` with the run's data, loss weights, lr, seed,
    steps, batch, device and dtype; its ``heldout`` block dropped (the script scores instead)."""
    cfg = OmegaConf.load(CONFIG)
    steps = size["steps"]
    task, kd, sh = arm["weights"]
    cfg.output_dir = str(run_dir)
    cfg.tokenizer.path = str(ckpt)
    cfg.tokenizer.max_seq_len = size["seq_len"]
    cfg.checkpointer.checkpoint_dir = str(ckpt)
    cfg.teacher_checkpointer.checkpoint_dir = str(ckpt)
    cfg.dataset = dict(_component_="squash.datasets.pydoc_text_dataset", split="train",
                       max_seq_len=size["seq_len"])  # fmt: skip
    cfg.pop("heldout", None)
    cfg.task_weight, cfg.kd_weight, cfg.squarehead_weight = float(task), float(kd), float(sh)
    cfg.optimizer.lr = lr
    cfg.seed = seed
    cfg.batch_size = size["batch"]
    cfg.epochs = 1
    cfg.max_steps_per_epoch = steps
    cfg.lr_scheduler.num_warmup_steps = max(1, steps // 10)
    if cfg.get("mask_update") is not None:
        cfg.mask_update.until_step = max(2, (3 * steps) // 4)
    cfg.save_adapter_weights_only = True
    cfg.save_every_n_steps = None
    cfg.device, cfg.dtype, cfg.teacher_dtype = device, dtype, None
    cfg.log_peak_memory_stats = False
    return cfg


def mask_updates(cfg) -> int:
    """How many mask updates a run of ``cfg`` makes (``mask_update_due`` over its steps)."""
    from squash.training.masks import MaskUpdateSchedule, mask_update_due

    schedule = MaskUpdateSchedule.from_config(cfg.get("mask_update", None))
    return sum(bool(mask_update_due(schedule, s)) for s in range(1, cfg.max_steps_per_epoch + 1))


def build_teacher(cfg, device: torch.device, dtype: torch.dtype):
    """The config's teacher from its ``teacher_checkpointer``, as the recipe builds it."""
    from torchtune import config, training

    from squash.assembly.model_setup import setup_frozen_model

    sd = config.instantiate(cfg.teacher_checkpointer).load_checkpoint()[training.MODEL_KEY]
    return setup_frozen_model(cfg.teacher, sd, device=device, dtype=dtype,
                              where="teacher (teacher_checkpointer)")  # fmt: skip


@contextlib.contextmanager
def shared_teacher(teacher):
    """Make the recipe's teacher set-up return ``teacher`` (built once) instead of building and
    loading a new one; the student's set-up is untouched. The recipe sets the teacher's hidden
    state outputs and output chunks itself in every run."""
    import squash_distill

    original = squash_distill.setup_frozen_model

    def setup(cfg_model, state_dict, *, device, dtype, where="model", **kwargs):
        if where.startswith("teacher"):
            p = next(teacher.parameters())
            if p.dtype != dtype or p.device.type != torch.device(device).type:
                raise ValueError(f"the shared teacher is {p.dtype} on {p.device}, the run wants "
                                 f"{dtype} on {device}")  # fmt: skip
            return teacher
        return original(cfg_model, state_dict, device=device, dtype=dtype, where=where, **kwargs)

    squash_distill.setup_frozen_model = setup
    try:
        yield
    finally:
        squash_distill.setup_frozen_model = original


@contextlib.contextmanager
def _plain(model):
    """The model in eval mode returning logits only (no hidden states), restored after."""
    hidden, was = getattr(model, "output_hidden_states", None), model.training
    model.output_hidden_states = []
    model.eval()
    try:
        yield
    finally:
        model.output_hidden_states = hidden
        model.train(was)


def _batches(samples: list, batch: int, device):
    for start in range(0, len(samples), batch):
        chunk = samples[start : start + batch]
        if any(s["labels"] != s["tokens"] or len(s["tokens"]) != len(chunk[0]["tokens"])
               for s in chunk):  # fmt: skip
            raise ValueError("perplexity takes text windows of one length with labels == tokens")
        yield start, torch.tensor([s["tokens"] for s in chunk], device=device)  # (b, s)


def _log_probs(model, tokens: torch.Tensor) -> torch.Tensor:
    """``(b, s - 1, vocab)`` log-probabilities of the next token at every position but the last."""
    out = model(tokens)
    if isinstance(out, list):  # chunked output (CEWithChunkedOutputLoss)
        out = torch.cat(out, dim=1)
    return torch.log_softmax(out[:, :-1].float(), dim=-1)


@torch.no_grad()
def reference_log_probs(model, samples: list, *, device, batch: int = 8) -> list:
    """The teacher's next-token log-probabilities on ``samples``, one ``(s - 1, vocab)`` CPU
    tensor a window (what :func:`perplexity` measures a student's KL against)."""
    with _plain(model):
        return [row for _, t in _batches(samples, batch, device)
                for row in _log_probs(model, t).cpu()]  # fmt: skip


@torch.no_grad()
def perplexity(model, samples: list, *, device, batch: int = 8, reference: list = None) -> dict:
    """Over text windows (``labels == tokens``; every token after a window's first predicted):
    ``loss`` (mean NLL per predicted token), ``perplexity`` (exp of it), ``tokens`` (the count)
    and, given the teacher's :func:`reference_log_probs`, ``kl``: the mean per token of
    KL(teacher || model) over the vocabulary."""
    nll, kl, n = 0.0, 0.0, 0
    with _plain(model):
        if reference is not None and len(reference) != len(samples):
            raise ValueError(f"{len(reference)} reference windows for {len(samples)} samples")
        for start, tokens in _batches(samples, batch, device):
            logp = _log_probs(model, tokens)  # (b, s - 1, vocab)
            target = tokens[:, 1:]  # (b, s - 1)
            nll -= float(logp.gather(-1, target[..., None]).sum())
            n += target.numel()
            if reference is not None:
                ref = torch.stack(reference[start : start + len(tokens)]).to(device)
                kl += float((ref.exp() * (ref - logp)).sum())
    out = {"loss": nll / n, "perplexity": math.exp(nll / n), "tokens": n}
    if reference is not None:
        out["kl"] = kl / n
    return out


def distill(cfg, splits: dict, teacher, base: bool = False, references: dict = None) -> dict:
    """One run of the recipe's code path with the shared teacher, then held-out perplexity on
    ``splits`` (and, with ``base``, of the student before its first step: the NF4 base)."""
    from squash_distill import SquashDistillRecipeSingleDevice

    recipe = SquashDistillRecipeSingleDevice(cfg=cfg)
    # The epoch-end adapter checkpoint is not needed (the model is scored in memory); training
    # is untouched.
    recipe.save_checkpoint = lambda *args, **kwargs: None
    refs = references or {}

    def setup():
        with shared_teacher(teacher):
            recipe.setup(cfg=cfg)

    def scores():
        return {k: perplexity(recipe._model, v, device=recipe._device, reference=refs.get(k))
                for k, v in splits.items()}  # fmt: skip

    try:
        return _q.set_up_train_score(recipe, setup, scores, base)
    finally:
        recipe.cleanup()
        del recipe
        gc.collect()  # the student and its NF4 base, before the next run builds its own
        shutil.rmtree(cfg.output_dir, ignore_errors=True)


# ---- the table ------------------------------------------------------------------------------
def _num(x, fmt: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _pct(x) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.0f}%"


def markdown(res: dict) -> str:
    t, q = res["teacher"], res.get("nf4") or {}
    tt, qt = t["test"]["perplexity"], q.get("test", {}).get("perplexity")
    c = res["corpus"]
    lines = [
        f"SmolLM2-135M-Instruct. Teacher: the model unquantized ({res['dtype']}). Student: its "
        f"NF4 copy with squash adapters as `configs/smollm2_135m_distill.yaml` (rank "
        f"{res['student']['lora_rank']}, A and B {res['student']['sparsity']:.0%} sparse, "
        f"q/k/v/output and w1/w2/w3 of all 30 layers, "
        f"{res['student']['mask_updates']} mask update(s) in the run), "
        f"`SquashDistillRecipeSingleDevice` in process.",
        f"Text: the Python Language Reference (`squash.datasets.pydoc_text_dataset`, "
        f"{c['source']}), windows of {res['seq_len']} tokens; train {c['windows']['train']} "
        f"windows ({res['steps'] * res['batch']} seen: {res['steps']} steps of batch "
        f"{res['batch']}), validation {c['windows']['validation']}, test {c['windows']['test']}; "
        f"the splits share no run of 13 words.",
        f"Held-out perplexity (exp of the mean NLL over the test split's "
        f"{t['test']['tokens']} predicted tokens): teacher **{tt:.3f}**, NF4 student before "
        f"training **{_num(qt, '.3f')}** (gap {_num(None if qt is None else qt - tt, '.3f')}); "
        f"validation: teacher {t['val']['perplexity']:.3f}, NF4 "
        f"{_num(q.get('val', {}).get('perplexity'), '.3f')}. KL(teacher || NF4 student) on "
        f"test: {_num(q.get('test', {}).get('kl'), '.4f')} nats a token.",
        f"Each arm: lr from the validation perplexity of seed 0 over {res['grid']} (widened "
        f"{res['max_widen']}x past an edge), then {res['seeds']} seeds on test at that lr (mean "
        f"+/- sample std); AdamW, cosine schedule, {res['dtype']} on {res['device']}. Gap closed "
        f"= 1 - (student - teacher) / (NF4 - teacher) of the mean (+/- the seeds' spread); "
        f"above 100%: below the teacher's perplexity. KL closed = 1 - KL(teacher || student) / "
        f"KL(teacher || NF4 student), test tokens, mean over seeds.",
        f"Machine: {res['machine']}; wall time {res['wall_s']:.0f} s.",
        "",
        "| arm | CE, KL, SH | lr sweep: validation perplexity | best lr | test perplexity "
        "| gap closed | seeds | test KL to teacher | KL closed |",
        "|---|---|---|---:|---:|---:|---|---:|---:|",
    ]
    for a in res["arms"]:
        cells = []
        for lr_s, r in sorted(a["sweep"].items(), key=lambda kv: float(kv[0])):
            v = f"{float(lr_s):.0e}: {r['val']['perplexity']:.3f}"
            cells.append(f"**{v}**" if float(lr_s) == a["best_lr"] else v)
        edge = " (edge)" if a["best_at_edge"] else "" if a["swept"] else " (fixed)"
        w = ", ".join(f"{x:g}" for x in a["weights"])
        seeds = ", ".join(f"{x:.3f}" for x in a["test_ppl"])
        lines.append(
            f"| {a['name']} | {w} | {'; '.join(cells) or 'not swept'} | {a['best_lr']:.0e}{edge} "
            f"| {a['ppl_mean']:.3f} +/- {a['ppl_std']:.3f} | {_pct(a['gap_closed'])} +/- "
            f"{_num(100 * a['gap_closed_std'], '.0f')} | {seeds} | "
            + (f"{a['kl_mean']:.4f} +/- {a['kl_std']:.4f} | {_pct(a['kl_closed'])} |"
               if "kl_mean" in a else "n/a | n/a |")
        )
    if res["comparisons"]:
        lines += ["", "| arm | against | test perplexity diff | Welch t (df, p) | test KL diff "
                  "| Welch t (df, p) |", "|---|---|---:|---|---:|---|"]  # fmt: skip

        def tdp(w):
            return f"{_num(w['t'], '.2f')} ({_num(w['df'], '.1f')}, {_num(w['p'], '.3f')})"

        for cmp in res["comparisons"]:
            kl = (f"{cmp['kl_diff']:+.4f} | {tdp(cmp['kl_welch'])}" if "kl_diff" in cmp
                  else "n/a | n/a")  # fmt: skip
            lines.append(f"| {cmp['arm_name']} | {cmp['against_name']} | {cmp['ppl_diff']:+.3f} | "
                         f"{tdp(cmp['welch'])} | {kl} |")
    if res["arms"]:
        best = min(res["arms"], key=lambda a: a["ppl_mean"])
        lines += ["", f"Lowest test perplexity (the most of the NF4 gap closed): {best['name']}, "
                      f"{best['ppl_mean']:.3f} ({_pct(best['gap_closed'])})."]  # fmt: skip
        with_kl = [a for a in res["arms"] if "kl_mean" in a]
        if with_kl:
            near = min(with_kl, key=lambda a: a["kl_mean"])
            lines[-1] += (f" Closest to the teacher (lowest KL): {near['name']}, "
                          f"{near['kl_mean']:.4f} ({_pct(near['kl_closed'])} of NF4's KL removed).")
    return "\n".join(lines) + "\n"


def write_result(res: dict, out_md: Path, started: float | None = None) -> None:
    """quality_smollm2's ``write_table_and_json`` with this script's table and comparisons."""
    _q.write_table_and_json(out_md, res, markdown, comparisons, started)


# ---- main -----------------------------------------------------------------------------------
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint-dir", default=None, help="squash download's output directory")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of every stage")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    for key, kind in (("steps", int), ("batch", int), ("seq-len", int), ("seeds", int),
                      ("n-val", int), ("n-test", int), ("max-widen", int)):  # fmt: skip
        p.add_argument(f"--{key}", type=kind, default=None)
    p.add_argument("--lrs", default=None, help="comma-separated lr grid (default 3e-3,1e-2)")
    p.add_argument("--arms", default=",".join(ARM_KEYS), help="comma-separated arm keys, in order")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=None, help="markdown path (json beside it)")
    args = p.parse_args(argv)
    size = _q.sized_run(p, args, dict(QUICK if args.quick else FULL),
                        ("steps", "batch", "seq_len", "seeds", "n_val", "n_test", "max_widen"),
                        ARM_KEYS)  # fmt: skip
    chosen = args.arms.split(",")
    out_md = args.out or RESULTS / ("distill_smollm2_quick.md" if args.quick else "distill_smollm2.md")
    ckpt = ensure_checkpoint(args.checkpoint_dir)
    import squash_distill  # noqa: F401  (its logger is set to INFO on import)

    _q.quiet_recipe_logs()
    t0 = time.perf_counter()

    from squash.datasets import pydoc_text_dataset
    from squash.models.smollm2 import smollm2_tokenizer

    tok = smollm2_tokenizer(str(ckpt), max_seq_len=size["seq_len"])
    windows, data = {}, {}
    for name, split, n in (("train", "train", None), ("val", "validation", size["n_val"]),
                           ("test", "test", size["n_test"])):  # fmt: skip
        ds = pydoc_text_dataset(tok, split=split, max_seq_len=size["seq_len"], max_windows=n)
        windows[split] = len(ds)
        if name != "train":
            data[name] = [ds[i] for i in range(len(ds))]
    if size["steps"] * size["batch"] > windows["train"]:
        p.error(f"--steps x --batch is {size['steps'] * size['batch']}, over the "
                f"{windows['train']} training windows (one epoch)")  # fmt: skip

    base_cfg = OmegaConf.load(CONFIG)
    device = torch.device(args.device)
    work = Path(tempfile.mkdtemp(prefix="squash_distill_smollm2_"))
    probe = recipe_config(ARMS[0], 1e-3, 0, work / "teacher", ckpt, size, args.device, args.dtype)
    t = time.perf_counter()
    teacher = build_teacher(probe, device, DTYPES[args.dtype])
    references = {"test": reference_log_probs(teacher, data["test"], device=device)}
    res = dict(
        model="smollm2", quick=args.quick, device=args.device, dtype=args.dtype,
        steps=size["steps"], batch=size["batch"], seq_len=size["seq_len"], grid=size["grid"],
        max_widen=size["max_widen"], seeds=size["seeds"], checkpoint=str(ckpt),
        corpus=dict(source=f"pydoc_data.topics of Python {sys.version.split()[0]}",
                    windows=windows),
        student=dict(lora_rank=base_cfg.model.lora_rank, lora_alpha=base_cfg.model.lora_alpha,
                     sparsity=base_cfg.model.sparsity, sparse_factor=base_cfg.model.sparse_factor,
                     mask_updates=mask_updates(probe)),
        teacher={k: perplexity(teacher, v, device=device, reference=references.get(k))
                 for k, v in data.items()}, nf4=None, arms=[],
        comparisons=[], machine=machine_line(args.device, DTYPES[args.dtype]),
        argv=list(argv if argv is not None else sys.argv[1:]), runs=[],
    )  # fmt: skip
    print(f"teacher: {res['teacher']} ({time.perf_counter() - t:.0f} s)", flush=True)

    def run(arm, lr, seed):
        run_dir = work / f"run_{arm['key']}_{lr:.3e}_{seed}"
        cfg = recipe_config(arm, lr, seed, run_dir, ckpt, size, args.device, args.dtype)
        t = time.perf_counter()
        splits = _q.run_splits(data, seed, size["grid"])
        r = distill(cfg, splits, teacher, base=res["nf4"] is None, references=references)
        if "base" in r:
            res["nf4"] = r.pop("base")
            print(f"NF4 student before training: {res['nf4']}", flush=True)
        timing = {k: round(r[k], 1) for k in ("setup_s", "train_s", "eval_s")}
        res["runs"].append(dict(key=arm["key"], lr=lr, seed=seed, **timing,
                                **{k: r[k] for k in ("val", "test") if k in r}))  # fmt: skip
        print(f"  {arm['name']} lr={lr:.1e} seed={seed}: "
              + ", ".join(f"{k} ppl {r[k]['perplexity']:.3f}" for k in ("val", "test") if k in r)
              + f" (set-up {timing['setup_s']} s, train {timing['train_s']} s, eval "
              f"{timing['eval_s']} s, all {time.perf_counter() - t:.0f} s)", flush=True)  # fmt: skip
        return r

    def record(arm, sw, best, at_edge, test):  # res["nf4"] is scored by the first run
        res["arms"].append(summarize(arm, sw, best, at_edge, test, seeds,
                                     res["teacher"]["test"]["perplexity"],
                                     res["nf4"]["test"]["perplexity"],
                                     res["nf4"]["test"].get("kl")))  # fmt: skip

    by_key, seeds = {a["key"]: a for a in ARMS}, list(range(size["seeds"]))
    _q.run_arms([by_key[k] for k in chosen], size, seeds, run,
                lambda: write_result(res, out_md, t0), work, record)
    print(markdown(res))
    print(f"Wrote {out_md} and {out_md.with_suffix('.json')}")
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
