"""The main job against its QLoRA baseline, as a user runs them: ``configs/smollm2_135m.yaml``
(squash r=143, both factors 90% sparse) and ``configs/smollm2_135m_qlora.yaml`` (QLoRA r=16, the
same adapter memory in fp32), each at its shipped learning rate, over seeds. Each run is the
shipped config through ``tune run`` with only the paths and ``seed`` (and any ``--set``) changed;
its held-out loss and exact match are read from what the run prints, and its wall time.

    python benchmarks/main_job.py run --checkpoint-dir /tmp/squash/smollm2-135m-instruct \\
        --seeds 1234 1235 1236 --out benchmarks/results/main_job
    python benchmarks/main_job.py report --out benchmarks/results/main_job

``run`` skips a (config, seed) whose JSON exists, so an interrupted sweep resumes; two can run
side by side with ``--threads 1`` each (``--configs`` splits the work). ``report`` prints the
markdown table: mean +/- sample standard deviation over seeds of each config.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import host, mean_std, welch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"squash": "smollm2_135m", "qlora": "smollm2_135m_qlora"}
PATTERNS = {
    "loss": r"Held-out loss before training: ([\d.]+), after: ([\d.]+)",
    "exact": r"exact match: (\d+)/(\d+) held-out samples \(before: (\d+)\)",
    "answer": r"answer after training:  (.*)",
}


def parse_output(text: str) -> dict:
    """The held-out numbers a finished run printed.

    Raises:
        ValueError: the output lacks one of them (the run failed or has no heldout block).
    """
    found = {k: re.search(p, text) for k, p in PATTERNS.items()}
    missing = [k for k, m in found.items() if m is None]
    if missing:
        raise ValueError(f"the run's output has no {', '.join(missing)} line")
    before, after = map(float, found["loss"].groups())
    hits, of, hits_before = map(int, found["exact"].groups())
    return {"loss_before": before, "loss_after": after, "exact_before": hits_before,
            "exact_after": hits, "of": of, "answer_after": found["answer"].group(1).strip()}  # fmt: skip


def run_recipe(config: Path, overrides: list, env: dict = None) -> dict:
    """``tune run squash_finetune --config CONFIG OVERRIDES``: what it printed
    (:func:`parse_output`) and its wall time ``wall_s``.

    Raises:
        SystemExit: the run failed (its stderr's end).
    """
    cmd = [str(Path(sys.executable).with_name("tune")), "run", "squash_finetune", "--config",
           str(config), *overrides]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return {**parse_output(proc.stdout), "wall_s": round(wall, 1)}


def run_one(arm: str, seed: int, args) -> Path:
    path = args.out / f"{arm}_s{seed}.json"
    if path.exists():
        print(f"{path} exists, skipped")
        return path
    ckpt = str(args.checkpoint_dir)
    work = args.work / f"{arm}_s{seed}"
    overrides = [f"output_dir={work}", f"checkpointer.checkpoint_dir={ckpt}",
                 f"tokenizer.path={ckpt}", f"seed={seed}", *args.set]  # fmt: skip
    ran = run_recipe(REPO / "configs" / f"{CONFIGS[arm]}.yaml", overrides,
                     {"OMP_NUM_THREADS": str(args.threads)})  # fmt: skip
    res = {"arm": arm, "config": f"configs/{CONFIGS[arm]}.yaml", "seed": seed, "set": args.set,
           "threads": args.threads, "wall_s": ran.pop("wall_s"), "host": host(), **ran}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    os.replace(tmp, path)
    print(json.dumps(res))
    return path


def report(out: Path) -> str:
    """The markdown table of every ``ARM_sSEED.json`` in ``out``."""
    runs = [json.loads(p.read_text()) for p in sorted(out.glob("*_s*.json"))]
    if not runs:
        raise SystemExit(f"no runs in {out}")
    lines = ["| config | seeds | exact match before | exact match after | held-out loss before "
             "| held-out loss after | wall time (s) |", "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    by = {arm: [r for r in runs if r["arm"] == arm] for arm in CONFIGS}
    for rs in by.values():
        if not rs:
            continue
        of = rs[0]["of"]
        cells = []
        for key in ("exact_before", "exact_after"):
            m, s = mean_std([100.0 * r[key] / r["of"] for r in rs])
            cells.append(f"{m:.0f}% +/- {s:.0f} ({', '.join(str(r[key]) for r in rs)} of {of})")
        for key in ("loss_before", "loss_after"):
            m, s = mean_std([r[key] for r in rs])
            cells.append(f"{m:.4f} +/- {s:.4f}")
        m, s = mean_std([r["wall_s"] for r in rs])
        cells.append(f"{m:.0f} +/- {s:.0f}")
        seeds = ", ".join(str(r["seed"]) for r in rs)
        lines.append(f"| `{rs[0]['config']}` | {seeds} | " + " | ".join(cells) + " |")
    if all(len(v) >= 2 for v in by.values()):
        parts = []
        for key, name in (("exact_after", "exact match after"), ("loss_after", "loss after")):
            w = welch([r[key] for r in by["squash"]], [r[key] for r in by["qlora"]])
            parts.append(f"{name} t = {w['t']:+.2f}, p = {w['p']:.2g}")
        lines.append(f"\nsquash against QLoRA (Welch's t): {'; '.join(parts)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--checkpoint-dir", type=Path, required=True)
    r.add_argument("--seeds", type=int, nargs="+", default=[1234, 1235, 1236])
    r.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=sorted(CONFIGS))
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--set", nargs="*", default=[], help="more key=value overrides")
    r.add_argument("--work", type=Path, default=Path("/tmp/squash/main_job_runs"),
                   help="the runs' output_dirs (checkpoints, logs, training.png)")
    r.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "main_job")
    q = sub.add_parser("report")
    q.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "main_job")
    args = p.parse_args(argv)
    if args.cmd == "report":
        print(report(args.out))
        return 0
    for seed in args.seeds:
        for arm in args.configs:
            run_one(arm, seed, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
