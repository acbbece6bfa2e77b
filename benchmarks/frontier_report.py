"""The frontier's report: a table per task (each arm at its best learning rate: best-point test
loss and exact match, the general-text loss at that point, against adapter memory), the headline
(the smallest budget of each method that matches QLoRA r=16 within its seeds' spread) and a PNG
per task. ``python benchmarks/frontier.py report`` runs it."""

import math
import statistics
from pathlib import Path

from common import has_matplotlib, mean_std, pyplot, save_png, welch
from frontier_plan import LINE_NAMES, LINES, arms
from quality_curves_plan import ROOT, final, finished, load_done

MIB = 1024**2


def best_point(rec: dict) -> dict:
    """The point with the lowest validation loss after step 0 (the earliest of equals)."""
    trained = [p for p in rec["points"] if p["step"] > 0] or rec["points"]
    return min(trained, key=lambda p: (p["val"]["loss"], p["step"]))


def groups(done: dict, steps: int, by_key: dict) -> dict:
    """Finished full-data runs of the frontier's arms as ``{arm: {"sweep": {lr: seed-0 record},
    "best": lr, "seeds": [records at the best lr, seed order]}}``; the best lr is the sweep's
    lowest final validation loss."""
    out = {}
    for r in done.values():
        key = r["arm"]["key"]
        if key in by_key and r["frac"] == 1.0 and finished(r, steps):
            out.setdefault(key, {"by_lr": {}})["by_lr"].setdefault(r["lr"], []).append(r)
    for g in out.values():
        g["sweep"] = {lr: r for lr, rs in g["by_lr"].items() for r in rs if r["seed"] == 0}
        pool = g["sweep"] or {lr: rs[0] for lr, rs in g["by_lr"].items()}
        g["best"] = min(pool, key=lambda lr: (final(pool[lr])["val"]["loss"], lr))
        g["seeds"] = sorted(g["by_lr"][g["best"]], key=lambda r: r["seed"])
    return out


def forget_at(rec: dict, point: dict) -> float:
    """The general-text loss at ``point`` of ``rec``: scored there, or (``rec["best"]``) on the
    kept state of the best validation point, which must be that point; None if neither."""
    if "forget" in point:
        return point["forget"]["loss"]
    best = rec.get("best")
    if best is None:
        return None
    if best["step"] != point["step"]:
        raise ValueError(f"{rec['id']}: the general text was scored at step {best['step']}, the "
                         f"best validation point is step {point['step']}")
    return best["forget"]["loss"]


def nf4_base(done: dict) -> dict:
    """Step 0 of an adapter run that recorded the general text: the frozen NF4 base (None
    before one)."""
    return next((r["points"][0] for r in done.values() if r["points"] and not r["arm"].get("full")
                 and "forget" in r["points"][0]), None)  # fmt: skip


def _pm(values: list, fmt: str = ".3f") -> str:
    m, s = mean_std(values)
    return f"{m:{fmt}} +/- {s:{fmt}}" if len(values) > 1 else f"{m:{fmt}}"


def summary(g: dict, by_key: dict) -> dict:
    """Per finished arm: its seeds' best-point test losses, exact matches and general-text
    losses (seeds that recorded one), and the steps kept."""
    out = {}
    for key, row in g.items():
        pts = [best_point(r) for r in row["seeds"]]
        forgets = [forget_at(r, p) for r, p in zip(row["seeds"], pts)]
        out[key] = dict(
            arm=by_key[key], lr=row["best"], sweep=row["sweep"],
            loss=[p["test"]["loss"] for p in pts], em=[p["test"]["exact_match"] for p in pts],
            forget=[f for f in forgets if f is not None],
            # the rise of each seed's general-text loss over its own step 0 (full fine-tuning
            # starts from the fp32 base, the adapters from NF4)
            rise=[f - r["points"][0]["forget"]["loss"]
                  for f, r in zip(forgets, row["seeds"]) if f is not None],
            steps=[p["step"] for p in pts],
        )  # fmt: skip
    return out


def headline(s: dict) -> list:
    """Per line, the smallest budget whose mean best-point test loss is at most QLoRA r=16's
    mean plus its seeds' standard deviation (a match within the spread, or better), with its
    bytes as a fraction of r=16's and Welch's t against r=16; lines without a match say so."""
    ref = s.get("qlora_r16")
    if ref is None or len(ref["loss"]) < 2:
        return ["(the headline waits for QLoRA r=16's seeds)"]
    m16, s16 = mean_std(ref["loss"])
    lines = [f"QLoRA r=16: {m16:.3f} +/- {s16:.3f} over {len(ref['loss'])} seeds; a budget "
             f"matches where its mean is at most {m16 + s16:.3f}."]  # fmt: skip
    for line in LINES:
        keys = sorted((k for k in s if s[k]["arm"]["line"] == line),
                      key=lambda k: s[k]["arm"]["budget"])  # fmt: skip
        ok = [k for k in keys if statistics.fmean(s[k]["loss"]) <= m16 + s16]
        if not ok:
            lines.append(f"- {LINE_NAMES[line]}: no finished budget matches.")
            continue
        a = s[ok[0]]
        w = welch(a["loss"], ref["loss"])
        t = "" if math.isnan(w["t"]) else f", t = {w['t']:+.2f} (p = {w['p']:.2g})"
        smaller = [k for k in keys if s[k]["arm"]["budget"] < a["arm"]["budget"]]
        lines.append(f"- {LINE_NAMES[line]}: {a['arm']['name']} at {a['arm']['vs_qlora_r16']:.3f}x "
                     f"r=16's bytes, {_pm(a['loss'])} ({len(a['loss'])} seed(s){t})"
                     + (f"; the next smaller budget, {s[smaller[-1]]['arm']['name']}, "
                        f"{_pm(s[smaller[-1]]['loss'])}" if smaller else "") + ".")  # fmt: skip
    return lines


def task_report(task: str, done: dict, size: dict) -> tuple:
    by_key = arms(size["steps"])
    s = summary(groups(done, size["steps"], by_key), by_key)
    lines = [f"### {task}", ""]
    if not s:
        return lines + ["No finished run yet.", ""], s
    base = nf4_base(done)
    floor = (f"The floor, the frozen NF4 base (step 0): test loss {base['test']['loss']:.3f}, "
             f"exact match {base['test']['exact_match']:.3f}, general-text loss "
             f"{base['forget']['loss']:.3f}." if base else "")  # fmt: skip
    lines += [floor, "",
              "Each arm at its best learning rate (lowest final validation loss of its sweep), "
              "test loss and exact match at each seed's best validation point, mean +/- sample "
              "std over seeds; general-text loss at the same point (its rise over the base's "
              "is what the fine-tune cost elsewhere):", "",
              "| method | arm | adapter MiB | x QLoRA r=16 | lr sweep: final val loss | best lr | "
              "seeds | steps kept | test loss | test exact match | general-text loss | rise over step 0 |",
              "|---|---|---:|---:|---|---:|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    order = sorted(s, key=lambda k: ((LINES + ("full",)).index(s[k]["arm"]["line"]),
                                     s[k]["arm"]["adapter_bytes"]))  # fmt: skip
    for key in order:
        a = s[key]
        sweep = "; ".join((f"**{lr:.0e}: {final(r)['val']['loss']:.3f}**" if lr == a["lr"] else
                           f"{lr:.0e}: {final(r)['val']['loss']:.3f}")
                          for lr, r in sorted(a["sweep"].items()))  # fmt: skip
        forget = _pm(a["forget"]) if a["forget"] else "n/a"
        rise = f"{statistics.fmean(a['rise']):+.3f}" if a["rise"] else "n/a"
        lines.append(f"| {LINE_NAMES[a['arm']['line']]} | {a['arm']['name']} | "
                     f"{a['arm']['adapter_bytes'] / MIB:.1f} | {a['arm']['vs_qlora_r16']:.3f} | "
                     f"{sweep} | {a['lr']:.0e} | {len(a['loss'])} | "
                     f"{', '.join(map(str, a['steps']))} | {_pm(a['loss'])} | {_pm(a['em'])} | "
                     f"{forget} | {rise} |")  # fmt: skip
    lines += ["", "The headline, from this table:", ""] + headline(s) + [""]
    return lines, s


def plot(path: Path, s: dict, task: str) -> None:
    """Best-point test loss (left) and the general-text loss's rise (right) against adapter MiB, log
    scale, one line per method with the seeds' range as whiskers; full fine-tuning a star."""
    fig, axes = pyplot().subplots(1, 2, figsize=(11, 4.8))
    style = {"qlora": ("tab:blue", "o"), "squash": ("tab:red", "s"),
             "squash_a": ("tab:orange", "^"), "full": ("black", "*")}  # fmt: skip
    for line in LINES + ("full",):
        keys = sorted((k for k in s if s[k]["arm"]["line"] == line),
                      key=lambda k: s[k]["arm"]["adapter_bytes"])  # fmt: skip
        if not keys:
            continue
        color, marker = style[line]
        for ax, metric in zip(axes, ("loss", "rise")):
            pts = [(s[k]["arm"]["adapter_bytes"] / MIB, s[k][metric]) for k in keys if s[k][metric]]
            if not pts:
                continue
            x = [p[0] for p in pts]
            m = [statistics.fmean(p[1]) for p in pts]
            err = [[mi - min(p[1]) for mi, p in zip(m, pts)], [max(p[1]) - mi for mi, p in zip(m, pts)]]
            ax.errorbar(x, m, yerr=err, color=color, marker=marker, capsize=3,
                        ms=12 if line == "full" else 5, ls="none" if line == "full" else "-",
                        label=LINE_NAMES[line])  # fmt: skip
    axes[0].set(xscale="log", xlabel="adapter + gradient + AdamW MiB (log)",
                ylabel="test loss per answer token at the best validation point")  # fmt: skip
    axes[1].set(xscale="log", xlabel="adapter + gradient + AdamW MiB (log)",
                ylabel="general-text loss at that point, rise over step 0")  # fmt: skip
    axes[1].axhline(0.0, color="gray", ls="--", label="the model before fine-tuning")
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M-Instruct, task {task}: quality against adapter memory "
                 "(seeds' range as whiskers)")  # fmt: skip
    fig.tight_layout()
    save_png(fig, path)


def regime_report(task: str, done: dict, size: dict) -> list:
    """The markdown of one regime candidate: each arm at its best rate (best-point test loss
    per token over its seeds, the general text's rise), dense r=128 against QLoRA r=16 in pooled
    seed standard deviations, and what share of that gap squash at r=16's memory captures."""
    import regime_plan

    by_key = regime_plan.arms(size["steps"])
    s = summary(groups(done, size["steps"], by_key), by_key)
    lines = [f"### {task} (regime candidate)", ""]
    if not s:
        return lines + ["No finished run yet.", ""]
    lines += ["| arm | memory x QLoRA r=16 | lr sweep: final val loss | best lr | seeds | steps kept "
              "| test loss per token | general-text rise over step 0 |",
              "|---|---:|---|---:|---:|---|---:|---:|"]  # fmt: skip
    for key in [k for k in by_key if k in s]:
        a = s[key]
        sweep = "; ".join((f"**{lr:.0e}: {final(r)['val']['loss']:.3f}**" if lr == a["lr"] else
                           f"{lr:.0e}: {final(r)['val']['loss']:.3f}")
                          for lr, r in sorted(a["sweep"].items()))  # fmt: skip
        rise = f"{statistics.fmean(a['rise']):+.3f}" if a["rise"] else "n/a"
        lines.append(f"| {a['arm']['name']} | {a['arm']['vs_qlora_r16']:.2f} | {sweep} | "
                     f"{a['lr']:.0e} | {len(a['loss'])} | {', '.join(map(str, a['steps']))} | "
                     f"{_pm(a['loss'])} | {rise} |")  # fmt: skip
    dense, r16 = s.get("qlora_r128"), s.get("qlora_r16")
    if dense and r16:
        sds, pays = regime_plan.rank_pays(dense["loss"], r16["loss"])
        gap = statistics.fmean(r16["loss"]) - statistics.fmean(dense["loss"])
        lines += ["", f"Dense r=128 against QLoRA r=16: {gap:+.4f} nats"
                  + ("" if sds is None else f", {sds:.1f} pooled seed SDs: rank "
                     + ("pays" if pays else "does not pay") + f" (threshold {regime_plan.PAYS_SDS:g})")
                  + "."]  # fmt: skip
        for key in regime_plan.SQUASH:
            if key in s and gap != 0:
                got = statistics.fmean(r16["loss"]) - statistics.fmean(s[key]["loss"])
                lines.append(f"- {s[key]['arm']['name']}: {got:+.4f} nats below QLoRA r=16, "
                             f"{got / gap:.0%} of dense's gain.")  # fmt: skip
    return lines + [""]


def report(results: Path, curves: Path, tasks: list, size: dict, png_dir: Path = None) -> str:
    """The markdown of every task (and a PNG per task beside ``results``; with ``png_dir``, a
    copy of each as ``png_dir/frontier_<task>.png``)."""
    import shutil

    rel = results.relative_to(ROOT) if results.is_relative_to(ROOT) else results
    lines = ["# The quality-per-byte frontier", "",
             f"Written by `python benchmarks/frontier.py report` from the run files in `{rel}/` "
             "(and, for the sweeps of the arms at QLoRA r=16's budget, the learning curves').", ""]  # fmt: skip
    import regime_plan

    for task in tasks:
        if task in regime_plan.CANDIDATES:
            steps = regime_plan.SIZE["steps"]
            lines += regime_report(task, load_done(results / task, steps), regime_plan.SIZE)
            continue
        done = {**load_done(curves / task, size["steps"]), **load_done(results / task, size["steps"])}
        text, s = task_report(task, done, size)
        lines += text
        if s and has_matplotlib():
            png = results / f"{task}.png"
            plot(png, s, task)
            if png_dir is not None:
                png_dir.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(png, png_dir / f"frontier_{task}.png")
            lines += [f"![{task}]({png.name})", ""]
        elif s:
            lines += ["(no plot: matplotlib is not installed; `pip install -e .[plot]`)", ""]
    return "\n".join(lines)
