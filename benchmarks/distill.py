"""Distillation against plain cross-entropy: how much of what NF4 loses each recovers.

    python benchmarks/distill.py            # the full run (README: "Distillation and evaluation")
    python benchmarks/distill.py --quick    # a smoke run of every stage (about a minute)
    python benchmarks/distill.py --model smollm2 [--checkpoint-dir DIR] [--quick]
                                            # SmolLM2-135M-Instruct on real text:
                                            # benchmarks/distill_smollm2.py (its docstring)
    python benchmarks/distill.py --teacher-seed 1 --lrs 3e-3 --seeds 1 --out /tmp/d1.md
                                            # another teacher, one rate, one student seed

The teacher is ``scripts/distill_teacher.py``'s: the tiny OPT's architecture trained on a generated
word-bigram corpus. The student is its NF4 copy with a rank-32 squash adapter, A 90% sparse
(``configs/opt_tiny_distill.yaml``). Every arm is a real ``tune run squash_distill`` with the same
steps, batches and data, differing only in the loss weights and the learning rate, and every
model is scored by a real ``tune run squash_eval`` on the held-out records. Arms: plain CE
(``task_weight=1``) and SquareHead + logit KL at each rate of a grid, and logit KL alone,
SquareHead alone and all three terms at one rate. Each cell is ``seeds`` runs (the recipe's
``seed``: adapter init, data order); mean and sample standard deviation of the held-out perplexity.

Writes ``benchmarks/results/distill.md`` (``distill_quick.md`` with ``--quick``) and the per-run
numbers as ``.json`` beside it.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import machine_line, model_script

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))  # scripts/ is no package and not installed
import distill_teacher  # noqa: E402

MODELS = {  # --model: (the script that runs it, None for this one; help)
    "opt_tiny": (None, "the tiny OPT teacher of scripts/distill_teacher.py (default)"),
    "smollm2": ("distill_smollm2", "SmolLM2-135M-Instruct (benchmarks/distill_smollm2.py)"),
}
TUNE = str(Path(sys.executable).with_name("tune"))
ARMS = {  # name: (task_weight, kd_weight, squarehead_weight)
    "plain CE": (1, 0, 0),
    "SquareHead + KL": (0, 1, 1),
    "KL alone": (0, 1, 0),
    "SquareHead alone": (0, 0, 1),
    "CE + KL + SquareHead": (1, 1, 1),
}
# lrs: every rate runs both main arms; extras_lr: the rate of the other three arms.
FULL = dict(teacher_steps=1000, steps=30, lrs=[3e-4, 1e-3, 3e-3, 1e-2], extras_lr=3e-3, seeds=3)
QUICK = dict(teacher_steps=30, steps=2, lrs=[1e-2], extras_lr=1e-2, seeds=1)


def tune(recipe: str, config: str, *overrides: str) -> None:
    # the CPU in fp32, as the table's host line says (the configs' device/dtype: auto could differ)
    cmd = [TUNE, "run", recipe, "--config", str(ROOT / "configs" / config), "device=cpu",
           "dtype=fp32", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "TQDM_DISABLE": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")


def evaluate(teacher: Path, out: Path, *overrides: str) -> float:
    """Held-out perplexity by ``tune run squash_eval``."""
    held = distill_teacher.dataset_overrides(teacher, held_out=True)
    tune("squash_eval", "opt_tiny_eval.yaml", f"output_dir={out}",
         f"checkpointer.checkpoint_dir={teacher}", *held, *overrides)
    return json.loads((out / "eval_results.json").read_text())["perplexity"]


def student(teacher: Path, work: Path, weights, lr: float, seed: int, steps: int) -> float:
    """Train a student with ``squash_distill``; its held-out perplexity."""
    out = work / "run"
    shutil.rmtree(out, ignore_errors=True)
    task, kd, sh = weights
    tune("squash_distill", "opt_tiny_distill.yaml", f"output_dir={out}",
         f"checkpointer.checkpoint_dir={teacher}", f"teacher_checkpointer.checkpoint_dir={teacher}",
         *distill_teacher.dataset_overrides(teacher),
         f"task_weight={task}", f"kd_weight={kd}", f"squarehead_weight={sh}",
         f"optimizer.lr={lr}", f"seed={seed}", "epochs=1", f"max_steps_per_epoch={steps}",
         "save_adapter_weights_only=True")
    return evaluate(teacher, work / "eval", f"adapter_dir={out / 'epoch_0'}")


def cell(values: list) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f}"


def table(res: dict) -> str:
    t, q = res["teacher"], res["nf4"]
    gap0 = q - t
    lines = [
        f"Teacher (seed {res.get('teacher_seed', 0)}) {t:.3f}, its NF4 copy {q:.3f} "
        f"(gap {gap0:.3f}); {res['steps']} steps of 8 "
        f"records; held-out perplexity, mean ± std over {res['seeds']} seeds; gap closed = "
        "1 - (student - teacher) / (NF4 - teacher).",
        "",
        "| arm | lr | held-out perplexity | gap closed |",
        "|---|---:|---:|---:|",
    ]
    for row in res["rows"]:
        mean = statistics.mean(row["perplexity"])
        closed = f"{100 * (1 - (mean - t) / gap0):.0f}%" if gap0 > 0 else "-"
        lines.append(f"| {row['arm']} | {row['lr']:g} | {cell(row['perplexity'])} | {closed} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    smollm2, parser = model_script(argv, __doc__, MODELS)
    if smollm2 is not None:  # the real model: benchmarks/distill_smollm2.py
        smollm2()
        return 0
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--teacher-seed", type=int, default=0, help="the teacher's torch seed")
    parser.add_argument("--lrs", type=float, nargs="+", help="the grid (default: the full one)")
    parser.add_argument("--seeds", type=int, help="student seeds a cell (default 3)")
    args = parser.parse_args(argv)
    p = dict(QUICK if args.quick else FULL)
    if args.lrs:
        p.update(lrs=args.lrs, extras_lr=args.lrs[0])
    if args.seeds:
        p.update(seeds=args.seeds)
    out = args.out or ROOT / "benchmarks" / "results" / ("distill_quick.md" if args.quick
                                                         else "distill.md")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        teacher, work = Path(tmp) / "teacher", Path(tmp)
        held, entropy = distill_teacher.train_teacher(teacher, steps=p["teacher_steps"],
                                                      seed=args.teacher_seed)
        res = dict(teacher=evaluate(teacher, work / "t", "model.quantize_base=False"),
                   nf4=evaluate(teacher, work / "q"), teacher_hand_loss=held,
                   corpus_entropy=entropy, teacher_seed=args.teacher_seed, steps=p["steps"],
                   seeds=p["seeds"], rows=[])
        plan = [(a, lr) for lr in p["lrs"] for a in ("plain CE", "SquareHead + KL")]
        extras = ("KL alone", "SquareHead alone", "CE + KL + SquareHead")
        plan += [(a, p["extras_lr"]) for a in extras]
        for arm, lr in plan:
            ppl = [student(teacher, work, ARMS[arm], lr, seed, p["steps"])
                   for seed in range(p["seeds"])]
            res["rows"].append(dict(arm=arm, lr=lr, perplexity=ppl))
            print(f"{arm} lr {lr:g}: {cell(ppl)} ({time.perf_counter() - start:.0f} s)",
                  file=sys.stderr, flush=True)
    import squash.ops

    isa = squash.ops.status().get("cpu", {}).get("isa", "?")
    text = (f"{machine_line('cpu', torch.float32)}; CPU ISA for the FFI kernels {isa}; "
            f"{time.perf_counter() - start:.0f} s"
            f"\n\n{table(res)}\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
