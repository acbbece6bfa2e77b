"""The numbers of a ``benchmarks/finetune.py`` results file, read back, and its step-time picture.

``parse_markdown`` reads the markdown the script writes (its table, the step over the first row's
round by round, each step's system time and page faults) into the dict that the script also writes
as JSON beside the markdown; ``plot`` draws each row's step time (median, whiskers min-max of the
rounds) against torchtune's QLoRA (the first row, a dashed line) with each row's matmul floor (a
black tick) and its step over QLoRA's, round by round (median [min-max]), written beside the bar.
Regenerate a picture from a stored results file, without timing anything (the ``plot`` extra):

    python benchmarks/finetune.py plot benchmarks/results/FILE.md --png docs/benchmarks/NAME.png
"""

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from common import has_matplotlib, pyplot, save_png

NUM = r"\d[\d,]*(?:\.\d+)?"
SPREAD = re.compile(rf"({NUM}) \[({NUM})-({NUM})\]")
# the table's columns; an "x" column is the ratio of the column before it, "<key>_x"
COLUMNS = {"row": "label", "adapter params": "adapter_params",
           "adapter+grad+AdamW MiB": "adapter_mib", "peak MiB": "peak_mib", "step s": "step_s",
           "tokens/s": "tokens_per_s", "floor s": "floor_s", "step / floor": "step_over_floor"}
NO_MATPLOTLIB = "no PNG: matplotlib is not installed (`pip install -e .[plot]`)"


def _num(text: str):
    """The first number of a cell (an int where it has no decimals; ``None`` for an empty one)."""
    m = re.search(NUM, text)
    if m is None:
        return None
    v = m.group().replace(",", "")
    return float(v) if "." in v else int(v)


def _row(keys: list, cells: list) -> dict:
    row = {}
    for key, cell in zip(keys, cells):
        cell = cell.strip()
        spread = SPREAD.match(cell)
        if key == "label":
            row[key] = cell
        elif spread:  # "median [min-max]": <key>, <key>_min, <key>_max; step_min, step_max
            stem = "step" if key == "step_s" else key
            med, lo, hi = (_num(v) for v in spread.groups())
            row.update({key: med, f"{stem}_min": lo, f"{stem}_max": hi})
        elif cell:
            row[key] = _num(cell)
        normal = re.search(rf"\(({NUM}) of its normal step\)", cell)
        if normal:
            row[f"{key}_of_normal_step"] = float(normal.group(1))
        per = re.search(r"\(([\d., ]+) of torchtune's, per round\)", cell)
        if per:
            row["per_round_x"] = [float(v) for v in per.group(1).split(",")]
    return row


def parse_markdown(text: str) -> dict:
    """The numbers of a results file: ``rows`` (the timed rows, each with its ``update`` step where
    it has one, ``rounds_x``, its step over the first row's round by round, and ``host``, each
    step's system CPU s and thousands of minor page faults) and ``recipes`` (the ``tune run``
    rows)."""
    lines = text.splitlines()
    out = {"date": None, "machine": lines[2] if len(lines) > 2 else "",
           "setup": lines[3] if len(lines) > 3 else "", "rows": [], "recipes": []}  # fmt: skip
    m = re.search(r"\((\d{4}-\d{2}-\d{2})\)", lines[0] if lines else "")
    out["date"] = m and m.group(1)
    for name, pattern in (("rounds", r"median of (\d+) interleaved rounds"),
                          ("tokens_per_step", r"= (\d+) tokens a step"),
                          ("dense_rate_gflops", rf"\(({NUM}) GFLOP/s")):  # fmt: skip
        m = re.search(pattern, out["setup"])
        out[name] = m and _num(m.group(1))
    keys, section = None, None
    by_label = {}
    for line in lines:
        cells = line.strip().strip("|").split("|")
        if line.startswith("| row |"):
            keys = []
            for c in (c.strip() for c in cells):
                keys.append(f"{keys[-1]}_x" if c == "x" else COLUMNS.get(c, c))
        elif line.startswith("|") and keys and not set(line) <= set("|-: "):  # not |---|
            row = _row(keys, cells)
            if row["label"].startswith("`tune run"):
                out["recipes"].append(row)
            elif row["label"].startswith("..."):
                out["rows"][-1]["update"] = row
            else:
                out["rows"].append(row)
                by_label[row["label"]] = row
        elif line.startswith("Step over the first row's"):
            section = "rounds_x"
        elif line.startswith("System CPU s"):
            section = "host"
        elif line.startswith("- ") and section:
            label, _, values = line[2:].rpartition(": ")
            if section == "rounds_x":
                by_label[label]["rounds_x"] = [float(v) for v in values.split(",")]
            else:
                by_label[label]["host"] = [
                    {"system_s": float(s), "faults_k": float(f), "mask_update": bool(u)}
                    for s, f, u in re.findall(r"([\d.]+) s / (\d+)k( \(mask update\))?", values)
                ]  # fmt: skip
    return out


def ratio_to_baseline(results: dict) -> list:
    """Each row's step over the first row's: ``(label, median over medians, per-round median,
    min, max)``; the per-round values are ``None`` where the file has no round-by-round lines,
    and 1.0 for the first row."""
    base = results["rows"][0]["step_s"]
    out = []
    for i, r in enumerate(results["rows"]):
        rounds = [1.0] if i == 0 else r.get("rounds_x")
        per = (statistics.median(rounds), min(rounds), max(rounds)) if rounds else (None,) * 3
        out.append((r["label"], r["step_s"] / base, *per))
    return out


def _color(label: str) -> str:
    if label.startswith("torchtune"):
        return "tab:blue"
    if label.startswith("bound"):
        return "tab:gray"
    if label.startswith("LoRA"):
        return "silver"
    return "tab:cyan" if "QLoRA" in label else "tab:red"


def plot(results: dict, path: Path):
    """Draw the step-time picture to ``path`` and return the figure (closed; its artists keep
    their data): horizontal bars of the rows' median step, whiskers min-max, the ``gid``
    ``floor`` line through the rows' matmul floors, the ``gid`` ``baseline`` line at the first
    row's median."""
    plt = pyplot()
    rows = results["rows"]
    y = list(range(len(rows)))
    med = [r["step_s"] for r in rows]
    lo = [m - r.get("step_min", m) for m, r in zip(med, rows)]
    hi = [r.get("step_max", m) - m for m, r in zip(med, rows)]
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(rows) + 2))
    ax.barh(y, med, xerr=[lo, hi], color=[_color(r["label"]) for r in rows], capsize=3,
            label=f"step s: median, whiskers min-max of {results['rounds'] or '?':g} rounds")
    floors = [r.get("floor_s") for r in rows]
    if all(f is not None for f in floors):
        ax.plot(floors, y, "|", color="k", markersize=22, markeredgewidth=2.5, gid="floor",
                label="matmul floor: the step's matmul FLOPs / dense rate (same process)")
    ax.axvline(med[0], ls="--", color="tab:blue", gid="baseline",
               label=f"{rows[0]['label']}, median")
    right = max(m + h for m, h in zip(med, hi))
    for yi, (_, x, pm, pmin, pmax) in zip(y, ratio_to_baseline(results)):
        text = f"{x:.2f}x" if pm is None else f"{pm:.2f}x [{pmin:.2f}-{pmax:.2f}]"
        text = "1.00x (baseline)" if yi == 0 else text
        ax.text(right * 1.02, yi, text, va="center", fontsize=8)
    ax.set_yticks(y, [r["label"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, right * 1.3)
    per = "per-round median [range]" if len(rows) > 1 and rows[1].get("rounds_x") else "medians"
    ax.set_xlabel(f"step s (forward, backward, AdamW); right: x {rows[0]['label']}, {per}")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.4, -0.12), ncol=2,
              frameon=False)  # fmt: skip
    setup = results["setup"].split("; ")
    dtype = re.search(r"dtype (\w+)", results["machine"])
    host = ", ".join([results["machine"].split(";")[0], *(dtype.groups() if dtype else ())])
    ax.set_title(f"{setup[0]}\n{'; '.join(setup[1:2] + [host])}, {results['date']}",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    save_png(fig, path)
    return fig


def write_png(results: dict, path: Path):
    """``plot``, or one line saying that matplotlib is missing (then ``None``)."""
    if not has_matplotlib():
        print(NO_MATPLOTLIB)
        return None
    return plot(results, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="finetune.py plot", description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, help="a finetune.py results file, .md or .json")
    p.add_argument("--png", type=Path, default=None, help="default: beside the results file")
    p.add_argument("--json", type=Path, default=None, help="also write the numbers read here")
    args = p.parse_args(argv)
    if args.results.suffix == ".json":
        results = json.loads(args.results.read_text())
    else:
        results = parse_markdown(args.results.read_text())
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    png = args.png or args.results.with_suffix(".png")
    if write_png(results, png) is not None:
        print(f"written to {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
