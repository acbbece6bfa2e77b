"""How much of NF4's perplexity loss does a corrected 4-bit base win back, at how many bits?

On SmolLM2-135M-Instruct (the HF checkpoint, transformers, float32), every linear of the decoder
layers (q, k, v, o, gate, up, down; not the tied embedding / output) is replaced by the dense
weight of one base, and held-out perplexity is measured:

- ``fp32``: the checkpoint;
- ``nf4``: torchao NF4, squash's block sizes (64; scaler blocks as squash picks per shape);
- ``nf4_b32``: NF4 with blocks of 32, the bits-matched control (+0.125 bit of int8 scalers);
- ``outliers_<criterion>_<pct>``: :func:`squash.nf4.split_outliers` at 0.25/0.5/1/2% of each
  row, by NF4 error magnitude or by SpQR's sensitivity (error^2 times the input's second moment
  from calibration windows of the fp32 model), bfloat16 values, 2 select-remove-quantize rounds;
- ``outliers_<criterion>+scale_<pct>``: the same with ``scale_aware=True`` (a block's absmax
  entry also scored by what the block's finer scale saves; one selection round);
- ``loftq_r16_i<T>``: :func:`squash.nf4.loftq_factors` rank 16, ``T`` iterations, the NF4 base
  plus ``B A`` (factors rounded to bfloat16) as LoftQ initializes a QLoRA model before training.
- ``loftq_squash_r143_i1``: LoftQ at squash's rank at QLoRA r=16's adapter memory (143, both
  factors 90% sparse, as ``configs/smollm2_135m.yaml``), one iteration, the step
  ``init: loftq`` takes for a ``SparseLoRALinear``: :func:`squash.nf4.loftq` with
  :func:`squash.modules.svd_factors` (FFI factors, values rounded to bfloat16).

Each corrected base is evaluated through its dense weight ``dequant(NF4) + S`` (equal to the
module's ``nf4_linear + ffi_linear`` forward to float rounding: ``tests/nf4/test_outliers.py``).

Bits per parameter are counted from the tensors over those linears' weights: NF4's packed codes,
int8 scalers, per-scaler-block float32 factors, mean and code book (``nf4_bytes``); outliers at
16 bits a value plus 16 an index (int16); LoftQ's factors at 16 bits an entry (a sparse factor's
entries 16 bits a value plus its index's width).

Text: calibration on the train split of squash's Python Language Reference text
(:mod:`squash.datasets.pydoc_text`), evaluation on its test split (documents never seen in
calibration) and, to measure the calibration domain's pull, on an out-of-domain text: the
Unicode names test split rendered one character a line (``U+00C0 À LATIN CAPITAL LETTER A WITH
GRAVE``). Windows of ``--seq-len`` tokens, every token after a window's first predicted.
Gap closed = (ppl_nf4 - ppl_x) / (ppl_nf4 - ppl_fp32).

Writes ``benchmarks/results/nf4_bases.json`` after every arm and, at the end, a dated section
in ``docs/benchmarks/nf4.md``.
"""

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks" / "nf4.md"
CHECKPOINT = Path.home() / ".cache" / "squash-tests" / "smollm2-135m-instruct"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FRACTIONS = (0.0025, 0.005, 0.01, 0.02)

from squash.nf4.quantize import nf4_bytes  # noqa: E402
from squash.nf4 import (  # noqa: E402
    SecondMoment,
    corrected_base,
    loftq_factors,
    quantize_blocks,
    split_outliers,
)
from squash.nf4.ops import nf4_dequantize  # noqa: E402
from squash.nf4.loftq import loftq  # noqa: E402
from squash.modules import svd_factors  # noqa: E402
from squash.sparsity import fan_in_for, ffi_to_dense, index_dtype  # noqa: E402

from common import cpu_flags, cpu_model, pyplot, save_png  # noqa: E402


# ---- text ---------------------------------------------------------------------------------------
def unicode_text(split: str = "test") -> str:
    """The Unicode names split as text (``all``: the three), one ``U+XXXX <char> NAME`` line a
    character."""
    from squash.datasets.unicode_names import SPLITS, unicode_name_pairs

    pairs = [p for s in SPLITS for p in unicode_name_pairs(s)] if split == "all" else (
        unicode_name_pairs(split))  # fmt: skip
    return "\n".join(f"U+{ord(c):04X} {c} {n}" for c, n in pairs)


def windows(ids: list, seq_len: int, count: int) -> torch.Tensor:
    """The first ``count`` non-overlapping windows of ``seq_len`` tokens, ``(count, seq_len)``."""
    n = min(count, len(ids) // seq_len)
    if n < 1:
        raise ValueError(f"text of {len(ids)} tokens holds no window of {seq_len}")
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


# ---- perplexity ---------------------------------------------------------------------------------
@torch.no_grad()
def perplexity(model, tokens: torch.Tensor, batch: int = 8) -> dict:
    """Mean NLL per predicted token over windows ``(n, s)`` and its exp."""
    nll, n = 0.0, 0
    for start in range(0, len(tokens), batch):
        t = tokens[start : start + batch]
        logits = model(input_ids=t).logits[:, :-1].float()  # (b, s - 1, vocab)
        logp = torch.log_softmax(logits, dim=-1)
        nll -= float(logp.gather(-1, t[:, 1:, None]).sum())
        n += t[:, 1:].numel()
    return {"loss": nll / n, "perplexity": math.exp(nll / n), "tokens": n}


def linears(model) -> dict:
    """``{name: nn.Linear}`` of the decoder layers' projections."""
    return {name: m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in PROJECTIONS}


@torch.no_grad()
def second_moments(model, tokens: torch.Tensor, batch: int = 8) -> dict:
    """``{name: (in,)}`` mean ``x_j^2`` of each projection's input over the calibration tokens."""
    stats, hooks = {}, []
    for name, m in linears(model).items():
        stats[name] = SecondMoment(m.in_features)
        hooks.append(m.register_forward_pre_hook(lambda _m, a, s=stats[name]: s.update(a[0])))
    try:
        for start in range(0, len(tokens), batch):
            model(input_ids=tokens[start : start + batch])
    finally:
        for h in hooks:
            h.remove()
    return {k: v.value().float() for k, v in stats.items()}


# ---- bases --------------------------------------------------------------------------------------
def base_weight(arm: dict, name: str, w: torch.Tensor, moments: dict):
    """``(dense weight, bits)`` of one projection under ``arm``."""
    kind = arm["kind"]
    if kind == "nf4":
        base = quantize_blocks(w, name, arm.get("block_size"))
        return nf4_dequantize(base), nf4_bytes(base) * 8
    if kind == "outliers":
        base, out = split_outliers(w, arm["fraction"], arm["criterion"], moments.get(name),
                                   scale_aware=arm.get("scale_aware", False),
                                   name=name)  # fmt: skip
        bits = nf4_bytes(base) * 8
        if out is not None:
            bits += 8 * (out.values.numel() * out.values.element_size()
                         + out.indices.numel() * out.indices.element_size())  # fmt: skip
        return corrected_base(base, out), bits
    if kind == "loftq":
        base, a, b = loftq_factors(w, arm["rank"], arm["iterations"], name=name)
        a, b = a.bfloat16(), b.bfloat16()
        bits = nf4_bytes(base) * 8 + 8 * (a.numel() * 2 + b.numel() * 2)
        return nf4_dequantize(base) + b.float() @ a.float(), bits
    if kind == "loftq_squash":
        return squash_loftq_weight(w, arm["rank"], arm["sparsity"], arm["iterations"], name)
    raise ValueError(f"unknown arm kind {kind!r}")


def squash_loftq_weight(w: torch.Tensor, rank: int, sparsity: float, iterations: int, name: str):
    """``(dequant(NF4) + B A, bits)``: LoftQ with squash's sparse step (both factors FFI at
    ``sparsity``), the factors' values rounded to bfloat16, indices at their FFI width."""
    fan_a, fan_b = fan_in_for(w.shape[1], sparsity), fan_in_for(rank, sparsity)

    def step(error):
        state, rest = svd_factors(error, rank=rank, scaling=1.0, fan_in_a=fan_a, fan_in_b=fan_b)
        return state, (error.double() - rest).float()

    result = loftq(w, iterations, step, name=name)
    f = result.factors
    a = ffi_to_dense(f["lora_a.values"].bfloat16().float(), f["lora_a.indices"], w.shape[1])
    b = ffi_to_dense(f["lora_b.values"].bfloat16().float(), f["lora_b.indices"], rank)
    bits = nf4_bytes(result.base) * 8
    for factor, width in (("lora_a", w.shape[1]), ("lora_b", rank)):
        n = f[f"{factor}.values"].numel()
        bits += n * (16 + torch.iinfo(index_dtype(width)).bits)
    return nf4_dequantize(result.base) + b @ a, bits


def arms(fractions=FRACTIONS, loftq_iterations=(1, 5)) -> list:
    """Every arm, the headline ones (1% outliers, LoftQ with one iteration) first, so a run cut
    short has them."""
    out = [dict(name="fp32", kind="fp32"),
           dict(name="nf4", kind="nf4"),
           dict(name="nf4_b32", kind="nf4", block_size=32)]  # fmt: skip
    ordered = sorted(fractions, key=lambda f: (f != 0.01, f))
    for f in ordered:
        for criterion in ("sensitivity", "magnitude"):
            out.append(dict(name=f"outliers_{criterion}_{100 * f:g}%", kind="outliers",
                            fraction=f, criterion=criterion))  # fmt: skip
        if f == 0.01:
            out.append(dict(name="loftq_r16_i1", kind="loftq", rank=16, iterations=1))
    for t in loftq_iterations:
        if t != 1:
            out.append(dict(name=f"loftq_r16_i{t}", kind="loftq", rank=16, iterations=t))
    out.append(dict(name="loftq_squash_r143_i1", kind="loftq_squash", rank=143, sparsity=0.9,
                    iterations=1))  # fmt: skip
    for f in ordered:  # scale-aware selection (removal gains), added after the first run
        for criterion in ("sensitivity", "magnitude"):
            out.append(dict(name=f"outliers_{criterion}+scale_{100 * f:g}%", kind="outliers",
                            fraction=f, criterion=criterion, scale_aware=True))  # fmt: skip
    return out


@torch.no_grad()
def evaluate_arm(model, arm: dict, evals: dict, moments: dict, originals: dict) -> dict:
    """Perplexity of ``model`` with each projection replaced by ``arm``'s base (restored after)."""
    t0 = time.perf_counter()
    bits = numel = 0
    mods = linears(model)
    try:
        if arm["kind"] != "fp32":
            for name, m in mods.items():
                w, b = base_weight(arm, name, originals[name], moments)
                m.weight.copy_(w)
                bits += b
                numel += w.numel()
        prep = time.perf_counter() - t0
        scores = {k: perplexity(model, v) for k, v in evals.items()}
    finally:
        for name, m in mods.items():
            m.weight.copy_(originals[name])
    return dict(arm, bits_per_param=(bits / numel if numel else 32.0), scores=scores,
                prepare_s=prep, wall_s=time.perf_counter() - t0)  # fmt: skip


def gap_closed(x: float, fp32: float, nf4: float) -> float:
    return (nf4 - x) / (nf4 - fp32)


# ---- report -------------------------------------------------------------------------------------
def host() -> dict:
    flags = cpu_flags()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile", "fma") if f in flags]
    return dict(cpu=cpu_model(), isa=isa, threads=torch.get_num_threads(), torch=torch.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).strftime(
                    "%Y-%m-%d %H:%M UTC"))  # fmt: skip


def table(res: dict) -> str:
    by = {a["name"]: a for a in res["arms"]}
    sets = list(res["eval_windows"])
    head = "| base | bits/param | " + " | ".join(
        f"{s} ppl | {s} gap closed" for s in sets) + " |"  # fmt: skip
    lines = [head, "|" + "---|" * (2 + 2 * len(sets))]
    for a in res["arms"]:
        cells = [a["name"], f"{a['bits_per_param']:.3f}"]
        for s in sets:
            p = a["scores"][s]["perplexity"]
            cells.append(f"{p:.3f}")
            if "fp32" in by and "nf4" in by:
                fp, q = by["fp32"]["scores"][s]["perplexity"], by["nf4"]["scores"][s]["perplexity"]
                cells.append(f"{100 * gap_closed(p, fp, q):.1f}%")
            else:
                cells.append("")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(res: dict) -> str:
    h = res["host"]
    w = res["eval_windows"]
    return "\n".join([
        f"## {h['date']}: {h['cpu']}",
        "",
        f"Host: {h['cpu']} ({', '.join(h['isa'])}), {h['threads']} thread, torch {h['torch']}; "
        f"wall time {res['wall_s'] / 60:.1f} min (`benchmarks/nf4_bases.py`"
        + (f"; runs started {', '.join(h['runs'])}, the later with `--append`" if "runs" in h
           else "") + ").",
        f"SmolLM2-135M-Instruct, float32; calibration {res['calibration_windows']} windows of "
        f"{res['seq_len']} tokens of the pydoc train split; evaluation: "
        + ", ".join(f"{k} {v} windows" for k, v in w.items())
        + ". Bits per parameter over the decoder projections' weights, counted from the "
        "tensors (NF4 codes, scalers and factors; outliers 16-bit value + 16-bit index; LoftQ "
        "factors 16 bits an entry, a sparse factor's 16-bit value + its index). Gap closed = "
        "(ppl_nf4 - ppl) / (ppl_nf4 - ppl_fp32).",
        "",
        table(res),
        "",
    ])  # fmt: skip


def plot(res: dict, path: Path) -> None:
    """Perplexity against bits per parameter, one panel per evaluation text, fp32 as a line."""
    sets = list(res["eval_windows"])
    fig, axes = pyplot().subplots(1, len(sets), figsize=(6 * len(sets), 4.5), squeeze=False)
    styles = {"nf4": ("k", "s"), "outliers": (None, "o"), "loftq": (None, "^"),
              "loftq_squash": (None, "v")}
    for ax, s in zip(axes[0], sets):
        series = {}
        for a in res["arms"]:
            p = a["scores"][s]["perplexity"]
            if a["kind"] == "fp32":
                ax.axhline(p, color="grey", ls="--", label="fp32")
                continue
            if a["kind"] == "outliers":
                key = f"outliers {a['criterion']}" + (" +scale" if a.get("scale_aware") else "")
            else:
                key = "NF4, blocks 64 and 32" if a["kind"] == "nf4" else a["name"]
            series.setdefault(key, []).append((a["bits_per_param"], p, a["kind"]))
        for i, (key, pts) in enumerate(sorted(series.items())):
            pts.sort()
            color, marker = styles[pts[0][2]]
            if pts[0][2] != "nf4":
                color = f"C{i % 10}"
            ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], marker=marker, color=color,
                    label=key)  # fmt: skip
        ax.set_xlabel("bits per parameter (decoder projections)")
        ax.set_ylabel(f"{s} perplexity")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"SmolLM2-135M-Instruct: NF4 bases before fine-tuning ({res['host']['date']})")
    fig.tight_layout()
    save_png(fig, path)


def write_json(res: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))


def write_doc(res: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = ("# A corrected 4-bit base: NF4 + FFI outliers against LoftQ\n\n"
              "Held-out perplexity of SmolLM2-135M-Instruct with its decoder projections on "
              "each base, before any fine-tuning (`python benchmarks/nf4_bases.py`). One "
              "section per run, newest last.\n\n")  # fmt: skip
    old = path.read_text() if path.exists() else header
    path.write_text(old.rstrip("\n") + "\n\n" + markdown(res))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", type=Path, default=CHECKPOINT)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--calibration-windows", type=int, default=32)
    p.add_argument("--eval-windows", type=int, default=40)
    p.add_argument("--ood-windows", type=int, default=40)
    p.add_argument("--ood-split", default="test", choices=("test", "validation", "train", "all"),
                   help="Unicode names split for the out-of-domain text (test: 9 windows of 256)")
    p.add_argument("--arms", nargs="*", help="arm names to run (default: all)")
    p.add_argument("--json", type=Path, default=RESULTS / "nf4_bases.json")
    p.add_argument("--plot", default=str(ROOT / "docs" / "benchmarks" / "nf4_bases.png"),
                   help="PNG of perplexity against bits (empty: none)")
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: print the table of --json, write --doc and --plot")
    p.add_argument("--append", action="store_true",
                   help="keep the arms already in --json (same text settings) and run the rest")
    p.add_argument("--doc", default=str(DOC), help="markdown page to append to (empty: none)")
    args = p.parse_args(argv)
    if args.report_only:
        return report(json.loads(args.json.read_text()), args)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(0)
    t0 = time.perf_counter()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from squash.datasets.pydoc_text import pydoc_text

    tok = AutoTokenizer.from_pretrained(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()

    def enc(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    calib = windows(enc(pydoc_text("train")), args.seq_len, args.calibration_windows)
    evals = {"pydoc_test": windows(enc(pydoc_text("test")), args.seq_len, args.eval_windows),
             "unicode_ood": windows(enc(unicode_text(args.ood_split)), args.seq_len,
                                    args.ood_windows)}  # fmt: skip
    originals = {k: m.weight.detach().clone() for k, m in linears(model).items()}
    moments = second_moments(model, calib)
    res = dict(model=str(args.checkpoint.name), seq_len=args.seq_len,
               calibration_windows=len(calib), ood_split=args.ood_split,
               eval_windows={k: len(v) for k, v in evals.items()}, host=host(),
               arms=[])  # fmt: skip
    if args.append and args.json.exists():
        old = json.loads(args.json.read_text())
        same = ("seq_len", "calibration_windows", "eval_windows")
        if {k: old[k] for k in same} != {k: res[k] for k in same} or old.get(
                "ood_split", "test") != res["ood_split"]:
            raise ValueError(f"--append: {args.json} was measured on other windows")
        res["arms"], t0 = old["arms"], t0 - old.get("wall_s", 0.0)
        res["host"]["runs"] = old["host"].get("runs", [old["host"]["date"]]) + [res["host"]["date"]]
    done = {a["name"] for a in res["arms"]}
    todo = [a for a in arms()
            if (not args.arms or a["name"] in args.arms) and a["name"] not in done]
    for arm in todo:
        r = evaluate_arm(model, arm, evals, moments, originals)
        res["arms"].append(r)
        res["wall_s"] = time.perf_counter() - t0
        print(f"{r['name']:<28} {r['bits_per_param']:.3f} bits  "
              + "  ".join(f"{k} {v['perplexity']:.3f}" for k, v in r["scores"].items())
              + f"  ({r['wall_s']:.0f} s)", flush=True)  # fmt: skip
        write_json(res, args.json)
    return report(res, args)


def report(res: dict, args) -> dict:
    """Print the table of ``res``; write its doc section and plot where ``args`` asks."""
    print(table(res))
    if args.doc:
        write_doc(res, Path(args.doc))
    if args.plot:
        plot(res, Path(args.plot))
    return res


if __name__ == "__main__":
    sys.exit(main() and 0)
