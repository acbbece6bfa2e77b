"""The learning curves' report: a markdown table per task (each arm at its best learning rate
at the final step and at each seed's best validation point, Welch's t against QLoRA r=16 on the
same data, the curves, the base arms) and a PNG per task, from the run files
``quality_curves.py work`` writes. ``python benchmarks/quality_curves.py report`` runs it."""

import functools
import math
import shutil
import statistics
from pathlib import Path

import torch
from omegaconf import OmegaConf

from squash.training.memory import base_memory

from common import has_matplotlib, mean_std, pyplot, save_png, welch
from quality_curves_plan import (
    BASES, FULL, LEVERS, ROOT, arms, final, finished, load_records, recipe_config,
)


def rows(records: list, steps: int) -> dict:
    """Finished runs grouped as ``{(arm, frac): {"sweep": {lr: record of seed 0}, "best": lr,
    "seeds": [records at the best lr, seed order]}}``; the best lr is the sweep's lowest final
    validation loss (for a row that was not swept, its one lr)."""
    out = {}
    for r in records:
        if finished(r, steps):
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
    from squash.assembly.model_setup import build_adapter_model

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
    fig, axes = pyplot().subplots(1, 2, figsize=(11, 5))
    colors = {"qlora_r16": "tab:blue", "squash": "tab:red", "squash_a": "tab:orange",
              "lora_dense": "tab:gray"}  # fmt: skip
    for (key, frac), row in sorted(groups.items()):
        if key not in colors:
            continue
        n = len(row["seeds"])
        label = (row["seeds"][0]["arm"]["name"] + ("" if frac == 1.0 else f", {frac:g} of the data")
                 + f" ({n} seed{'s' * (n != 1)})")  # fmt: skip
        ls = "-" if frac == 1.0 else "--"
        for ax, metric in zip(axes, ("loss", "exact_match")):
            x, m, lo, hi = curve(row["seeds"], "test", metric)
            ax.plot(x, m, ls, color=colors[key], label=label)
            ax.fill_between(x, lo, hi, color=colors[key], alpha=0.15)
    axes[0].set(xlabel="step (batch 8)", ylabel="test loss per answer token", yscale="log")
    axes[1].set(xlabel="step (batch 8)", ylabel="test exact match")
    # below both panels, where it hides no curve; two columns
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8)
    fig.suptitle(f"SmolLM2-135M-Instruct, task {task}: QLoRA r=16 against squash at equal memory")
    fig.tight_layout(rect=(0, 0.05 + 0.035 * math.ceil(len(labels) / 2), 1, 1))
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
