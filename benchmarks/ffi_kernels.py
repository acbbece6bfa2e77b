"""Time squash's FFI kernels against torch's dense matmul on LoRA-factor shapes.

For every shape (tokens T, in_features, out_features) and sparsity this times, in one process:

- forward:        ``torch.ops.squash.ffi_linear(x, values, indices)``   vs ``x @ W.T``
- input gradient: ``torch.ops.squash.ffi_linear_grad_input(g, ...)``    vs ``g @ W``
- values gradient: ``torch.ops.squash.ffi_linear_grad_values(g, x, ...)`` vs ``g.T @ x``

and prints a markdown table (also written under ``benchmarks/results/``) with the milliseconds of
each and the ratio dense / FFI (> 1: FFI is faster). All calls run under ``torch.inference_mode()``
so both sides go straight to their kernels. The dense calls of a shape and the FFI calls of all
its sparsities are timed in interleaved rounds (after a warm-up round), so a burst of load from
other processes hits both sides alike; each entry is the median over the rounds. On CUDA the
calls are timed with CUDA events.

    python benchmarks/ffi_kernels.py                 # full grid, ~5 minutes on 2 CPU cores
    python benchmarks/ffi_kernels.py --quick         # headline rows, under a minute
    python benchmarks/ffi_kernels.py --tokens 2048 --in-features 1024 --out-features 256 \\
        --sparsity 0.6 0.9 --dtype bfloat16 --repeats 20
    python benchmarks/ffi_kernels.py --device cuda --quick
"""

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

import squash
from squash.sparsity import fan_in_for, random_ffi_indices

from common import machine_line, make_timer

FULL_GRID = {
    "in_features": [1024, 4096],
    "out_features": [64, 256, 1024],
    "tokens": [1, 256, 2048, 8192],
    "sparsity": [0.5, 0.6, 0.75, 0.9, 0.95, 0.99],
}
QUICK_GRID = {
    "in_features": [1024],
    "out_features": [256],
    "tokens": [1, 256, 2048],
    "sparsity": [0.6, 0.9],
}
OPS = ("fwd", "grad_in", "grad_val")
RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="a few headline rows (under a minute)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"]
    )
    p.add_argument("--tokens", type=int, nargs="+", help="token counts T (x is (T, in))")
    p.add_argument("--in-features", type=int, nargs="+")
    p.add_argument("--out-features", type=int, nargs="+")
    p.add_argument("--sparsity", type=float, nargs="+", help="fractions of zeros, e.g. 0.9")
    p.add_argument("--repeats", type=int, help="timed rounds per shape (default: adaptive, 3-200)")
    p.add_argument("--budget", type=float, default=3.0,
                   help="seconds of timed rounds to aim for per shape when --repeats is not given")
    p.add_argument("--out", type=Path, help="markdown file (default: under benchmarks/results/)")
    p.add_argument("--no-phases", action="store_true", help="skip the CPU phase table")
    return p.parse_args(argv)


def bench_shape(tokens, in_features, out_features, sparsities, dtype, device, repeats, budget):
    """Median ms of the dense ops and of the FFI ops at every sparsity for one shape.

    Returns:
        tuple[dict, dict, int]: ``{op: ms}`` for dense, ``{sparsity: {op: ms}}`` for FFI, and
        the number of timed rounds.
    """
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, in_features, generator=gen).to(device=device, dtype=dtype)
    g = torch.randn(tokens, out_features, generator=gen).to(device=device, dtype=dtype)
    w = torch.randn(out_features, in_features, generator=gen).to(device=device, dtype=dtype)
    calls = {
        ("dense", "fwd"): lambda: x @ w.T,
        ("dense", "grad_in"): lambda: g @ w,
        ("dense", "grad_val"): lambda: g.T @ x,
    }
    for s in sparsities:
        k = fan_in_for(in_features, s)
        idx = random_ffi_indices(out_features, in_features, k, generator=gen, device=device)
        val = torch.randn(out_features, k, generator=gen).to(device=device, dtype=dtype)
        calls[(s, "fwd")] = lambda val=val, idx=idx: torch.ops.squash.ffi_linear(x, val, idx)
        calls[(s, "grad_in")] = lambda val=val, idx=idx: torch.ops.squash.ffi_linear_grad_input(
            g, val, idx, in_features
        )
        calls[(s, "grad_val")] = lambda idx=idx: torch.ops.squash.ffi_linear_grad_values(g, x, idx)

    timed = make_timer(device, events=True)
    samples = {key: [] for key in calls}
    with torch.inference_mode():
        round_s = sum(timed(fn) for fn in calls.values()) / 1e3  # warm-up: caches, allocator
        if repeats is None:
            # A few more warm-up rounds for fast shapes; then about `budget` seconds of rounds.
            for _ in range(min(5, int(0.2 / max(round_s, 1e-6)))):
                for fn in calls.values():
                    timed(fn)
            rounds = max(3, min(200, math.ceil(budget / max(round_s, 1e-6))))
        else:
            rounds = repeats
        for _ in range(rounds):
            for key, fn in calls.items():
                samples[key].append(timed(fn))
    med = {key: statistics.median(v) for key, v in samples.items()}
    dense = {op: med[("dense", op)] for op in OPS}
    ffi = {s: {op: med[(s, op)] for op in OPS} for s in sparsities}
    return dense, ffi, rounds


PHASES = ("tile transposes in", "tile transposes out", "gather FMAs", "CSC build")
PHASE_HEADER = ("| in | out | T | sparsity | op | ms / call | " + " | ".join(PHASES)
                + " | timed share |")  # fmt: skip


def phase_rows(tokens, in_features, out_features, sparsities, dtype, calls_per_op=5) -> list:
    """Where the CPU kernel's time goes: per op, the thread time of each phase (ms per call, and
    its share of the op's wall time x threads), from the kernel's own phase timers
    (``squash_ffi_cpu_phases``); run apart from the timed rounds, so their clock reads do not
    touch the ratios. Empty where no native CPU kernel is loaded."""
    import ctypes

    lib = squash.ops._loader.cpu_library()
    if lib is None or not hasattr(lib, "squash_ffi_cpu_phases"):
        return []
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, in_features, generator=gen).to(dtype=dtype)
    g = torch.randn(tokens, out_features, generator=gen).to(dtype=dtype)
    buf = (ctypes.c_int64 * 4)()
    threads = torch.get_num_threads()
    timed = make_timer("cpu")
    rows = []
    for s in sparsities:
        k = fan_in_for(in_features, s)
        idx = random_ffi_indices(out_features, in_features, k, generator=gen)
        val = torch.randn(out_features, k, generator=gen).to(dtype=dtype)
        ops = {
            "fwd": lambda: torch.ops.squash.ffi_linear(x, val, idx),
            "grad_in": lambda: torch.ops.squash.ffi_linear_grad_input(g, val, idx, in_features),
            "grad_val": lambda: torch.ops.squash.ffi_linear_grad_values(g, x, idx),
        }
        with torch.inference_mode():
            for op, fn in ops.items():
                fn()  # warm-up, untimed
                lib.squash_ffi_cpu_phases(1)
                lib.squash_ffi_cpu_phase_ns(buf)  # zero the counters
                wall = timed(lambda: [fn() for _ in range(calls_per_op)]) / calls_per_op
                lib.squash_ffi_cpu_phases(0)
                lib.squash_ffi_cpu_phase_ns(buf)
                ns = list(buf)
                ns[2] -= ns[1]  # the gather's row blocks include their transposes out
                per = [v / calls_per_op / 1e6 for v in ns]
                share = 100 * sum(per) / (wall * threads)
                cells = " | ".join(f"{fmt_ms(v)} ({100 * v / (wall * threads):.0f}%)" for v in per)
                rows.append(f"| {in_features} | {out_features} | {tokens} | {round(s * 100)}% | "
                            f"{op} | {fmt_ms(wall)} | {cells} | {share:.0f}% |")  # fmt: skip
    return rows


def fmt_ms(ms: float) -> str:
    return f"{ms:.3f}" if ms < 10 else f"{ms:.1f}"


HEADER = (
    "| in | out | tokens | sparsity | k | dense fwd | FFI fwd | fwd x | dense grad_in "
    "| FFI grad_in | grad_in x | dense grad_val | FFI grad_val | grad_val x | dense total "
    "| FFI total | total x |"
)


def row(in_f, out_f, tokens, s, dense, ffi) -> str:
    cells = [str(in_f), str(out_f), str(tokens), f"{s:.0%}", str(fan_in_for(in_f, s))]
    for op in OPS:
        cells += [fmt_ms(dense[op]), fmt_ms(ffi[op]), f"{dense[op] / ffi[op]:.2f}"]
    d, f = sum(dense.values()), sum(ffi.values())
    cells += [fmt_ms(d), fmt_ms(f), f"**{d / f:.2f}**"]
    return "| " + " | ".join(cells) + " |"


def main(argv=None) -> int:
    args = parse_args(argv)
    grid = dict(QUICK_GRID if args.quick else FULL_GRID)
    for name in grid:
        if getattr(args, name) is not None:
            grid[name] = getattr(args, name)
    dtype = getattr(torch, args.dtype)
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda: no CUDA/ROCm device is available", file=sys.stderr)
        return 2

    # Load the kernels once (a JIT build on first use) and say which backend serves the device.
    tiny = torch.zeros(1, 4, device=device, dtype=dtype)
    torch.ops.squash.ffi_linear(
        tiny, torch.ones(2, 1, device=device, dtype=dtype),
        torch.zeros(2, 1, device=device, dtype=torch.int16),
    )
    st = squash.ops.status()[torch.device(device).type]
    backend = st["backend"]
    if "isa" in st:
        backend += f", ISA {st['isa']} ({st.get('vector_bytes', '?')}-byte vectors)"
    elif "arch" in st:
        backend += f", arch {st['arch']}"
    lines = [
        f"# FFI kernels vs dense matmul ({device})",
        "",
        f"Machine: {machine_line(device, dtype)}; FFI backend: {backend}.",
        "",
        (
            "Milliseconds per call, median over interleaved rounds (dense and FFI side by side, "
            "after warm-up), under `torch.inference_mode()`. `x` columns: dense / FFI (> 1: FFI "
            "faster). Dense: `x @ W.T`, `g @ W`, `g.T @ x`; FFI: `torch.ops.squash.ffi_linear`, "
            "`ffi_linear_grad_input`, `ffi_linear_grad_values`. Total: the three summed."
        ),
        "",
        HEADER,
        "|" + "---|" * (HEADER.count("|") - 1),
    ]
    print("\n".join(lines), flush=True)
    start = time.perf_counter()
    for in_f in grid["in_features"]:
        for out_f in grid["out_features"]:
            for tokens in grid["tokens"]:
                dense, ffi, _ = bench_shape(
                    tokens, in_f, out_f, grid["sparsity"], dtype, device, args.repeats, args.budget
                )
                for s in grid["sparsity"]:
                    lines.append(row(in_f, out_f, tokens, s, dense, ffi[s]))
                    print(lines[-1], flush=True)
    elapsed = time.perf_counter() - start
    lines += ["", f"Whole table: {elapsed:.0f} s."]
    print(lines[-1])

    if torch.device(device).type == "cpu" and not args.no_phases:
        phases = [
            phase_rows(tokens, in_f, out_f, grid["sparsity"], dtype)
            for in_f in grid["in_features"]
            for out_f in grid["out_features"]
            for tokens in grid["tokens"]
            if tokens > 8  # fewer tokens skip the tiles: a direct gather, no phases
        ]
        phases = [r for rows_ in phases for r in rows_]
        if phases:
            head = [
                "",
                f"## FFI time by phase ({torch.get_num_threads()} threads)",
                "",
                "Thread milliseconds per call of each phase, timed inside the kernel, and its "
                "share of the call's wall time x threads; the rest (timed share < 100%) is "
                "scheduling, allocation and argument checks. Gather FMAs: the gather "
                "multiply-adds of the row blocks (forward, input gradient) or the dot products "
                "(values gradient).",
                "",
                PHASE_HEADER,
                "|" + "---|" * (PHASE_HEADER.count("|") - 1),
            ]
            lines += head + phases
            print("\n".join(head + phases), flush=True)

    dev = torch.device(device).type
    suffix = "" if args.dtype == "float32" else f"_{args.dtype}"
    suffix += "_quick" if args.quick else ""
    out = args.out or RESULTS / f"ffi_kernels_{dev}{suffix}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
