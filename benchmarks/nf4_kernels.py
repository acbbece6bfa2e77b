"""Time squash's NF4 dequantization against torchao's, side by side in one process.

For each weight shape (with torchao's blocks, or the largest scaler block that divides):
``NF4Tensor.get_original_weight()`` against ``squash.nf4.nf4_dequantize`` (equal bit for bit,
checked here too), and the base linear of an adapted layer, forward and input gradient, through
torchao's ``linear_nf4`` against ``squash.nf4.nf4_linear``, with the dense ``F.linear`` on the
unquantized weight for scale. Calls run in interleaved rounds after a warm-up (load from
elsewhere hits all alike); each entry is the median, with the range over rounds. Prints a
markdown table: milliseconds and the ratio torchao / squash (> 1: squash faster); on a GPU also
the dequantization's GB/s (bytes read + written).

    python benchmarks/nf4_kernels.py                   # SmolLM2 and OPT-350M shapes, fp32
    python benchmarks/nf4_kernels.py --dtype bf16 --tokens 1024
    python benchmarks/nf4_kernels.py --device cuda --dtype bf16
"""

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from common import DTYPES, kernels, machine_line, make_timer

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (1024, 1024), (4096, 1024)]


def bench(shape, dtype, device, tokens, rounds):
    from torchao.dtypes.nf4tensor import linear_nf4

    from squash.nf4 import quantize_nf4
    from squash.nf4 import nf4_dequantize, nf4_linear

    w = (torch.randn(shape) * 0.02).to(dtype=dtype, device=device)
    q = quantize_nf4(w)
    same = torch.equal(q.get_original_weight(), nf4_dequantize(q))
    x = torch.randn(tokens, shape[1], dtype=dtype, device=device, requires_grad=True)
    g = torch.randn(tokens, shape[0], dtype=dtype, device=device)

    def step(fn, weight):
        def run():
            y = fn(x, weight)
            (gx,) = torch.autograd.grad(y, x, g)
            return gx

        return run

    calls = {
        "dequant torchao": q.get_original_weight,
        "dequant squash": lambda: nf4_dequantize(q),
        "linear torchao": step(lambda x, w: linear_nf4(input=x, weight=w), q),
        "linear squash": step(nf4_linear, q),
        "linear dense": step(F.linear, w),
    }
    samples = {k: [] for k in calls}
    timed = make_timer(device)
    for r in range(rounds + 1):
        for k, fn in calls.items():
            ms = timed(fn)
            if r:  # round 0: warm-up
                samples[k].append(ms)
    return same, samples


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--tokens", type=int, default=1024, help="rows of x in the linear rows")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    dtype = DTYPES[args.dtype]
    from squash.nf4 import nf4_block_sizes
    from squash.ops import ensure_loaded

    ensure_loaded("cpu" if args.device == "cpu" else "cuda")
    print(f"# NF4: squash vs torchao ({args.device}, {args.tokens} tokens in the linear rows)")
    print(f"# {machine_line(args.device, dtype)}; squash kernels: {kernels(args.device)}")
    print("\n| shape | blocks | bitwise equal | dequant torchao ms | dequant squash ms | x | "
          "linear fwd+grad_x torchao ms | squash ms | x | dense ms | squash / dense |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for shape in SHAPES:
        same, s = bench(shape, dtype, args.device, args.tokens, args.rounds)
        med = {k: statistics.median(v) for k, v in s.items()}

        def rng(k):
            return f"{med[k]:.2f} [{min(s[k]):.2f}-{max(s[k]):.2f}]"

        blocks = "x".join(map(str, nf4_block_sizes("weight", tuple(shape))))
        line = (f"| {shape[0]}x{shape[1]} | {blocks} | {same} | {rng('dequant torchao')} | "
                f"{rng('dequant squash')} | {med['dequant torchao'] / med['dequant squash']:.1f} | "
                f"{rng('linear torchao')} | {rng('linear squash')} | "
                f"{med['linear torchao'] / med['linear squash']:.2f} | {rng('linear dense')} | "
                f"{med['linear squash'] / med['linear dense']:.2f} |")  # fmt: skip
        if args.device.startswith("cuda"):
            n = shape[0] * shape[1]
            gbs = (n / 2 + n * torch.finfo(dtype).bits / 8) / (med["dequant squash"] / 1e3) / 1e9
            line += f" {gbs:.0f} GB/s |"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
