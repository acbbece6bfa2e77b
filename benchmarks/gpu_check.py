"""Build, check and time squash's FFI GPU kernels on this machine's CUDA or ROCm GPU.

Run from anywhere (the shell wrapper is the documented entry point)::

    benchmarks/gpu_check.sh                 # build, check, time; table to benchmarks/results/
    benchmarks/gpu_check.sh --budget 120    # stop timing after 120 s in all
    benchmarks/gpu_check.sh --no-timing     # build and correctness checks only

Steps: (1) build the kernels through the real loader (``import squash`` and one op call on a
CUDA tensor); (2) check forward, grad_input and grad_values against ``squash.ops.reference``
and the dense float64 product for fp32, bf16 and fp16, int16 and int32 indices, fan-in 1, a
3-D input and shapes off every tile, and that bad indices raise ``ValueError``; (3) time FFI
against the dense product (``torch.nn.functional.linear``: cuBLAS / hipBLAS) in bf16 with CUDA
events (median), forward and forward + backward, for in 1024/4096, out 64/256/1024, tokens
1/256/2048/8192 and sparsity 50..99 %; the table goes to ``benchmarks/results/gpu_<device>.md``.

Exit codes: 0 every correctness check passed on the GPU; 1 a correctness check failed;
2 the native GPU kernels did not build or load (the reason is printed); 3 no CUDA/ROCm GPU is
present (the same correctness checks ran on the CPU path instead, and passed).
"""

import argparse
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import squash
from squash.ops import _loader, reference
from squash.sparsity import fan_in_for, ffi_to_dense, random_ffi_indices

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float64: 1e-10}
CHECK_SHAPES = [
    # (leading shape, in, out, k)
    ((33,), 64, 16, 7),
    ((5,), 40, 8, 1),  # fan-in 1, few tokens
    ((2, 7), 96, 20, 10),  # 3-D input
    ((300,), 257, 65, 26),  # sizes off every tile
    ((4, 512), 1024, 256, 103),  # 16-byte vector paths
    ((1100,), 4096, 64, 410),  # LoRA-A-like: few rows, split kernels
    ((2, 300), 64, 1024, 6),  # LoRA-B-like: narrow in
]
CPU_SHAPES = CHECK_SHAPES[:4]
TIMING_IN = (1024, 4096)
TIMING_OUT = (64, 256, 1024)
TIMING_TOKENS = (1, 256, 2048, 8192)
TIMING_SPARSITY = (0.5, 0.75, 0.9, 0.95, 0.99)
TARGET = (4096, 1024, 8192, 0.9)  # forward >= 2x dense, forward + backward >= 1.5x
GPU = "cuda"  # ROCm builds of torch call their GPU "cuda" too


def log(msg: str = "") -> None:
    print(msg, flush=True)


# ---- correctness ---------------------------------------------------------------------------------
def _inputs(lead, in_features, out_features, k, dtype, index_dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, in_features, generator=g).to(dtype)
    values = torch.randn(out_features, k, generator=g).to(dtype)
    indices = random_ffi_indices(out_features, in_features, k, generator=g).to(index_dtype)
    grad_out = torch.randn(*lead, out_features, generator=g).to(dtype)
    return x.to(device), values.to(device), indices.to(device), grad_out.to(device)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max error over (max |want| + 1): low-precision results are one rounding of the fp32 sum."""
    want = want.double()
    return (got.double() - want).abs().max().item() / (want.abs().max().item() + 1.0)


def check_case(lead, in_features, out_features, k, dtype, index_dtype, device) -> tuple[bool, str]:
    x, values, indices, grad_out = _inputs(
        lead, in_features, out_features, k, dtype, index_dtype, device
    )
    xr, vr = x.clone().requires_grad_(True), values.clone().requires_grad_(True)
    y = torch.ops.squash.ffi_linear(xr, vr, indices)
    y.backward(grad_out)
    gx = torch.ops.squash.ffi_linear_grad_input(grad_out, values, indices, in_features)
    gv = torch.ops.squash.ffi_linear_grad_values(grad_out, x, indices)

    w = ffi_to_dense(values.double(), indices, in_features)  # dense float64 on the same device
    dense = {
        "y": x.double() @ w.T,
        "gx": grad_out.double() @ w,
        "gv": torch.gather(grad_out.double().reshape(-1, out_features).T
                           @ x.double().reshape(-1, in_features), 1, indices.long()),
    }  # fmt: skip
    ref = {
        "y": reference.ffi_linear(x, values, indices),
        "gx": reference.ffi_linear_grad_input(grad_out, values, indices, in_features),
        "gv": reference.ffi_linear_grad_values(grad_out, x, indices),
    }
    got = {"y": y, "gx": gx, "gv": gv}
    errs, ok = [], True
    for name in ("y", "gx", "gv"):
        e = max(_rel_err(got[name], ref[name]), _rel_err(got[name], dense[name]))
        ok &= got[name].shape == ref[name].shape and got[name].dtype == dtype
        ok &= e <= TOL[dtype]
        errs.append(f"{name} {e:.1e}")
    # Autograd must give the same gradients as the direct op calls.
    ok &= _rel_err(xr.grad, gx) <= TOL[dtype] and _rel_err(vr.grad, gv) <= TOL[dtype]
    return ok, ", ".join(errs)


def check_bad_indices(device) -> tuple[bool, str]:
    x, values, indices, _ = _inputs((40,), 64, 16, 5, torch.float32, torch.int16, device)
    problems = []
    for what, fix in (("out of range", lambda i: i.__setitem__((3, 2), 64)),
                      ("duplicate", lambda i: i.__setitem__((4, 1), int(i[4, 0])))):  # fmt: skip
        bad = indices.clone()
        fix(bad)
        try:
            torch.ops.squash.ffi_linear(x, values, bad)
            problems.append(f"{what}: no error")
        except ValueError as err:
            log(f"    {what}: ValueError: {str(err).splitlines()[0][:120]}")
    return not problems, "; ".join(problems) or "ValueError raised"


def run_checks(device: str, shapes) -> bool:
    log(f"\n== correctness on {device} ==")
    all_ok = True
    for lead, i, o, k in shapes:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for index_dtype in (torch.int16, torch.int32):
                ok, msg = check_case(lead, i, o, k, dtype, index_dtype, device)
                all_ok &= ok
                types = f"{str(dtype)[6:]}, {str(index_dtype)[6:]}"
                name = f"x{tuple(lead) + (i,)} -> {o}, k={k}, {types}"
                log(f"  {'PASS' if ok else 'FAIL'}  {name:<52} {msg}")
    ok, msg = check_bad_indices(device)  # one index contract on every backend
    all_ok &= ok
    log(f"  {'PASS' if ok else 'FAIL'}  bad indices: {msg}")
    return all_ok


NF4_SHAPES = [((1024, 1024), 64, 256), ((576, 576), 64, 64), ((6, 4), 6, 4)]


def run_nf4_checks(device: str) -> bool:
    """squash's NF4 dequantization on ``device`` against torchao's get_original_weight(), bit for
    bit, for fp32, bf16 and fp16 weights."""
    from torchao.dtypes.nf4tensor import to_nf4

    from squash.nf4 import nf4_dequantize

    log(f"\n== NF4 dequantize on {device}: bit for bit against torchao ==")
    all_ok = True
    for shape, block, scaler_block in NF4_SHAPES:
        for dtype, view in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16),
                            (torch.float16, torch.int16)):  # fmt: skip
            w = to_nf4((torch.randn(shape) * 0.02).to(dtype=dtype, device=device), block,
                       scaler_block)  # fmt: skip
            want, got = w.get_original_weight(), nf4_dequantize(w)
            ok = got.shape == want.shape and torch.equal(got.view(view), want.view(view))
            all_ok &= ok
            name = f"{shape} blocks {block}x{scaler_block}, {str(dtype)[6:]}"
            log(f"  {'PASS' if ok else 'FAIL'}  nf4 {name}")
    return all_ok


def nf4_timing() -> list[str]:
    """bf16 NF4 dequantization GB/s (bytes read + written) against a device copy's GB/s, and
    squash against torchao, on an 8192 x 8192 weight (torchao's blocks)."""
    from torchao.dtypes.nf4tensor import to_nf4

    from squash.nf4 import nf4_dequantize

    w = to_nf4(torch.randn(8192, 8192, device=GPU, dtype=torch.bfloat16) * 0.02)
    n = w.numel()
    dense = w.get_original_weight()
    copy_ms = _median_ms(lambda: dense.clone())
    sq_ms = _median_ms(lambda: nf4_dequantize(w))
    ao_ms = _median_ms(w.get_original_weight)
    copy_gbs = 2 * n * 2 / copy_ms / 1e6
    sq_gbs = (n / 2 + n * 2) / sq_ms / 1e6
    return ["", "| NF4 dequantize, 8192 x 8192 bf16 | ms | GB/s | x copy rate |",
            "|---|---:|---:|---:|",
            f"| device copy (clone) | {copy_ms:.3f} | {copy_gbs:.0f} | 1.00 |",
            f"| squash nf4_dequantize | {sq_ms:.3f} | {sq_gbs:.0f} | {sq_gbs / copy_gbs:.2f} |",
            f"| torchao get_original_weight | {ao_ms:.3f} | {(n / 2 + n * 2) / ao_ms / 1e6:.0f} | "
            f"{(n / 2 + n * 2) / ao_ms / 1e6 / copy_gbs:.2f} |"]  # fmt: skip


# ---- timing --------------------------------------------------------------------------------------
def _median_ms(fn, min_time_s: float = 0.03) -> float:
    fn()  # warm-up (and first-call work such as index validation)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = time.perf_counter() - t0
    reps = max(5, min(50, int(min_time_s / max(once, 1e-6))))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def time_shape(in_features, out_features, tokens, sparsity) -> dict:
    dtype, device = torch.bfloat16, GPU
    k = fan_in_for(in_features, sparsity)
    g = torch.Generator().manual_seed(0)
    indices = random_ffi_indices(out_features, in_features, k, generator=g).to(device)
    values = (torch.randn(out_features, k, generator=g) * 0.02).to(device, dtype)
    w = ffi_to_dense(values, indices, in_features)  # same nonzeros, dense
    x = torch.randn(tokens, in_features, generator=g).to(device, dtype)
    grad = torch.randn(tokens, out_features, generator=g).to(device, dtype)
    xg, vg, wg = (t.clone().requires_grad_(True) for t in (x, values, w))

    def ffi_fwd():
        torch.ops.squash.ffi_linear(x, values, indices)

    def dense_fwd():
        torch.nn.functional.linear(x, w)

    def ffi_fwd_bwd():
        xg.grad = vg.grad = None
        torch.ops.squash.ffi_linear(xg, vg, indices).backward(grad)

    def dense_fwd_bwd():
        xg.grad = wg.grad = None
        torch.nn.functional.linear(xg, wg).backward(grad)

    out = {"k": k}
    for name, fn in (("ffi_f", ffi_fwd), ("dense_f", dense_fwd), ("ffi_fb", ffi_fwd_bwd),
                     ("dense_fb", dense_fwd_bwd)):  # fmt: skip
        out[name] = _median_ms(fn)
    return out


def run_timing(budget_end: float) -> tuple[list[str], list[str]]:
    shapes = [(i, o, t, s) for i in TIMING_IN for o in TIMING_OUT for t in TIMING_TOKENS
              for s in TIMING_SPARSITY]  # fmt: skip
    shapes.sort(key=lambda shape: shape != TARGET)  # the target shape first
    header = ("| in | out | tokens | sparsity | k | FFI fwd ms | dense fwd ms | fwd speed-up "
              "| FFI fwd+bwd ms | dense fwd+bwd ms | fwd+bwd speed-up |")  # fmt: skip
    rows = [header, "|" + "---|" * 11]
    notes = []
    log("\n== timing (bf16; speed-up = dense ms / FFI ms) ==")
    log(header)
    for n, (i, o, t, s) in enumerate(shapes):
        if time.monotonic() > budget_end:
            notes.append(f"time budget spent: {len(shapes) - n} of {len(shapes)} shapes not timed")
            break
        r = time_shape(i, o, t, s)
        row = (f"| {i} | {o} | {t} | {s:.2f} | {r['k']} | {r['ffi_f']:.4f} | {r['dense_f']:.4f} "
               f"| {r['dense_f'] / r['ffi_f']:.2f}x | {r['ffi_fb']:.4f} | {r['dense_fb']:.4f} "
               f"| {r['dense_fb'] / r['ffi_fb']:.2f}x |")  # fmt: skip
        rows.append(row)
        log(row)
        if (i, o, t, s) == TARGET:
            f_ok, fb_ok = r["dense_f"] / r["ffi_f"] >= 2.0, r["dense_fb"] / r["ffi_fb"] >= 1.5
            notes.append(
                f"target ({i} -> {o}, {t} tokens, sparsity {s}, bf16): forward "
                f"{r['dense_f'] / r['ffi_f']:.2f}x (goal 2x: {'met' if f_ok else 'missed'}), "
                f"forward + backward {r['dense_fb'] / r['ffi_fb']:.2f}x "
                f"(goal 1.5x: {'met' if fb_ok else 'missed'})"
            )
            log(notes[-1])
    return rows, notes


# ---- main ----------------------------------------------------------------------------------------
def environment() -> list[str]:
    lines = [
        (
            f"torch {torch.__version__} (CUDA {torch.version.cuda}, HIP {torch.version.hip}), "
            f"python {platform.python_version()}, squash {squash.__version__}"
        )
    ]
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        arch = getattr(p, "gcnArchName", f"sm_{p.major}{p.minor}")
        lines.append(f"GPU: {p.name} ({arch}, {p.multi_processor_count} SMs/CUs, "
                     f"{p.total_memory / 2**30:.0f} GiB)")  # fmt: skip
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=270.0,
                        help="seconds for the whole run; timing stops when they are spent")
    parser.add_argument("--no-timing", action="store_true", help="build and check only")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()  # fmt: skip
    budget_end = time.monotonic() + args.budget
    for line in environment():
        log(line)

    if not torch.cuda.is_available():
        cpu = "native" if _loader.ensure_loaded("cpu") else "reference"
        log(f"\nno CUDA/ROCm GPU present: checking the CPU path instead (CPU kernels: {cpu})")
        ok = run_checks("cpu", CPU_SHAPES)
        ok &= run_nf4_checks("cpu")
        log(f"\nCPU path {'passed' if ok else 'FAILED'}; no GPU check ran (exit code "
            f"{3 if ok else 1}: 3 = no GPU, CPU path passed)")  # fmt: skip
        return 3 if ok else 1

    log("\n== build (loader: kernels/ffi_cuda.cu through torch.utils.cpp_extension) ==")
    t0 = time.monotonic()
    idx = torch.tensor([[0, 1, 2], [3, 5, 7]], dtype=torch.int16, device=GPU)
    torch.ops.squash.ffi_linear(torch.randn(4, 8, device=GPU), torch.randn(2, 3, device=GPU), idx)
    torch.cuda.synchronize()
    status = _loader.status()["cuda"]["backend"]
    log(f"cuda kernels: {status} ({time.monotonic() - t0:.1f} s)")
    if status != "native":
        log(f"native GPU kernels unavailable: {_loader._state.get('cuda') or _loader.mode()}")
        return 2

    ok = run_checks(GPU, CHECK_SHAPES)
    ok &= run_nf4_checks(GPU)
    log(f"\ncorrectness on the GPU: {'PASSED' if ok else 'FAILED'}")
    if args.no_timing:
        rows, notes = [], ["timing skipped (--no-timing)"]
    else:
        rows, notes = run_timing(budget_end)
        rows += nf4_timing()

    name = re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(0).lower()).strip("_")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu_{name}.md"
    text = [f"# FFI GPU kernels on {torch.cuda.get_device_name(0)}", "",
            ("Written by `benchmarks/gpu_check.sh`; times are CUDA-event medians in ms, bf16, "
             "dense = `torch.nn.functional.linear` on the same nonzeros."), "",
            *[f"- {line}" for line in environment()],
            f"- correctness checks: {'passed' if ok else 'FAILED'}",
            *[f"- {n}" for n in notes], "", *rows, ""]  # fmt: skip
    path.write_text("\n".join(text))
    log(f"\nwrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
