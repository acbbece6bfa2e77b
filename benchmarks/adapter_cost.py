"""What an adapted linear's adapters cost in a training step, and what that cost is made of.

For every adapted linear of a model's layer (SmolLM2-135M: q, k, v, o, gate, up, down; OPT-350M:
q, k, v, out, fc1, fc2), at its real shape and ``--tokens`` tokens, one step of one module
(forward, then backward with a fixed output gradient) is timed, in interleaved rounds in this
process:

- **squash**: ``SparseLoRALinear`` on an NF4 base, ``--sparse-factor`` FFI at ``--sparsity``, at
  the rank whose adapter + gradient + AdamW bytes fit in dense rank ``--rank``'s over the whole
  model (what ``benchmarks/finetune.py`` compares), with its adapters on and off
  (``disabled``): the difference is what its adapters add to the step;
- **its ops one by one**: the same step's adapter computation as the tensor ops autograd runs for
  it, called directly without autograd and each timed (the factor products: forward of A and B,
  input and values gradients of both, FFI kernels for a sparse factor, matmuls for a dense one;
  the element-wise passes: the scaling of the rank-wide hidden and of its gradient, the sum with
  the base output, the sum of the two input gradients). They compute what the module computes,
  bit for bit (tested);
- **dense QLoRA**: torchtune's ``LoRALinear`` at rank ``--rank`` on an NF4 base (torchao's),
  adapters on and off: what dense LoRA's adapters add, for comparison.

The table splits the squash adapters' cost into factor products, element-wise passes and the rest
(the module's cost less both: dispatch and autograd bookkeeping per op, and the base product
running slower after the sparse kernels than after its own kind), per linear, per layer and per
model step (times the layer count). Times are medians over ``--rounds`` rounds of ``--reps``
steps; a round times every variant of every linear in turn, so a slow spell of the host hits
them alike.

    python benchmarks/adapter_cost.py                          # SmolLM2 shapes, 1024 tokens
    python benchmarks/adapter_cost.py --model opt350m --tokens 2048
"""

import argparse
import statistics

import torch

from common import DTYPES, OPT_350M, SMOLLM2_135M, machine_line, make_timer

LAYERS = {"smollm2": SMOLLM2_135M["num_layers"], "opt350m": OPT_350M["num_layers"]}
PRODUCTS = ("A forward", "B forward", "B grad input", "B grad values", "A grad input",
            "A grad values")
PASSES = ("scale", "add out", "scale grad", "add grad_x")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(LAYERS), default="smollm2")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per step (batch x length)")
    p.add_argument("--rank", type=int, default=16, help="dense LoRA's rank (squash: its bytes)")
    p.add_argument("--sparsity", type=float, default=0.9)
    p.add_argument("--sparse-factor", choices=("a", "b", "both"), default="both")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=5, help="steps timed per variant and round")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    for name in ("tokens", "rank", "rounds", "reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    return args


def linears(model: str) -> list:
    """``[(name, in, out)]`` of one layer's adapted linears, from the model's sizes."""
    m = SMOLLM2_135M if model == "smollm2" else OPT_350M
    d, f = m["embed_dim"], m["intermediate_dim"]
    if model == "opt350m":
        return [("q", d, d), ("k", d, d), ("v", d, d), ("out", d, d), ("fc1", d, f), ("fc2", f, d)]
    kv = m["num_kv_heads"] * d // m["num_heads"]
    return [("q", d, d), ("k", d, kv), ("v", d, kv), ("o", d, d), ("gate", d, f), ("up", d, f),
            ("down", f, d)]  # fmt: skip


def squash_rank(args) -> int:
    """The squash rank at dense rank ``args.rank``'s adapter state bytes over the whole model."""
    from squash.training import lora_adapter_memory, max_rank_within

    shapes = [(i, o) for _, i, o in linears(args.model)] * LAYERS[args.model]
    dtype = DTYPES[args.dtype]
    budget = lora_adapter_memory(shapes, args.rank, dtype=dtype).total_bytes
    return max_rank_within(budget, shapes, sparsity=args.sparsity,
                           sparse_factor=args.sparse_factor, dtype=dtype)  # fmt: skip


def build(args, d_in: int, d_out: int, rank: int, seed: int = 0) -> tuple:
    """``(squash module, dense QLoRA module)`` for one ``(d_in, d_out)`` linear, NF4 bases."""
    from torchtune import training
    from torchtune.modules.peft import LoRALinear

    from squash.modules import sparse_lora_linear
    from squash.nf4 import nf4_block_sizes

    dtype = DTYPES[args.dtype]
    g = torch.Generator().manual_seed(seed)
    block, scaler = nf4_block_sizes(f"a {d_out} x {d_in} weight", (d_out, d_in))
    with training.set_default_dtype(dtype):
        sq = sparse_lora_linear(d_in, d_out, rank, alpha=2.0 * rank, sparsity=args.sparsity,
                                sparse_factor=args.sparse_factor, quantize_base=True,
                                generator=g)  # fmt: skip
        dense = LoRALinear(d_in, d_out, args.rank, alpha=2.0 * args.rank, quantize_base=True,
                           block_size=block, scaler_block_size=scaler)  # fmt: skip
    with torch.no_grad():  # B starts at zero: give both adapters' outputs non-zero values
        for m in (sq, dense):
            for factor in (m.lora_a, m.lora_b):
                for t in factor.parameters():
                    t.copy_(torch.randn(t.shape, generator=g) * 0.05)
    return sq.to(args.device), dense.to(args.device)


def _factor(m) -> tuple:
    """``(values, indices)`` of an FFI factor, or ``(weight, None)`` of a dense one."""
    return (m.values, m.indices) if hasattr(m, "indices") else (m.weight, None)


def _fwd(x, factor):
    w, idx = _factor(factor)
    return torch.ops.squash.ffi_linear(x, w, idx) if idx is not None else x @ w.t()


def _grad_in(g, factor, in_features):
    w, idx = _factor(factor)
    if idx is None:
        return g @ w
    return torch.ops.squash.ffi_linear_grad_input(g, w, idx, in_features)


def _grad_val(g, x, factor):
    _, idx = _factor(factor)
    if idx is None:  # as autograd computes nn.Linear's weight gradient
        return (x.t() @ g).t()
    return torch.ops.squash.ffi_linear_grad_values(g, x, idx)


def adapter_ops(module, x, grad_out, base_out, base_grad_x, timer=None) -> dict:
    """The adapter part of ``module``'s step as the ops autograd runs for it, without autograd:
    returns the module's output, the input gradient and both factors' gradients (``timer(name,
    fn)`` runs and times each op when given)."""
    run = timer or (lambda name, fn: fn())
    a, b, s = module.lora_a, module.lora_b, module.scaling
    h = run("A forward", lambda: _fwd(x, a))
    hs = run("scale", lambda: h * s)
    y = run("B forward", lambda: _fwd(hs, b))
    out = run("add out", lambda: base_out + y)
    ghs = run("B grad input", lambda: _grad_in(grad_out, b, module.rank))
    grad_b = run("B grad values", lambda: _grad_val(grad_out, hs, b))
    gh = run("scale grad", lambda: ghs * s)
    gxa = run("A grad input", lambda: _grad_in(gh, a, module.in_dim))
    grad_a = run("A grad values", lambda: _grad_val(gh, x, a))
    grad_x = run("add grad_x", lambda: base_grad_x + gxa)
    return dict(out=out, grad_x=grad_x, grad_a=grad_a, grad_b=grad_b)


def module_step(module, x, grad_out) -> None:
    """Forward and backward of ``module`` (its parameters' and ``x``'s gradients dropped)."""
    module(x).backward(grad_out)
    x.grad = None
    for p in module.parameters():
        p.grad = None


def base_parts(module, x, grad_out) -> tuple:
    """The base path's output and input gradient, as the module computes them."""
    from squash.modules.sparse_lora import _dequantize

    with torch.no_grad():
        disabled, module.disabled = module.disabled, True
        try:
            out = module(x)
        finally:
            module.disabled = disabled
        return out, grad_out @ _dequantize(module.weight).to(grad_out.dtype)


def measure(args, rank: int) -> list:
    """Per linear: median milliseconds of each variant and of each op, over interleaved rounds."""
    dtype, dev = DTYPES[args.dtype], args.device
    cases = []
    for n, (name, d_in, d_out) in enumerate(linears(args.model)):
        sq, dense = build(args, d_in, d_out, rank, seed=n)
        gen = torch.Generator().manual_seed(100 + n)
        x = torch.randn(args.tokens, d_in, generator=gen, dtype=dtype).to(dev)
        g = torch.randn(args.tokens, d_out, generator=gen, dtype=dtype).to(dev)
        base_out, base_gx = base_parts(sq, x, g)
        cases.append(dict(name=name, shape=(d_in, d_out), sq=sq, dense=dense,
                          x=x.requires_grad_(), g=g, base=(base_out, base_gx),
                          t={k: [] for k in ("squash on", "squash off", "dense on", "dense off",
                                             *PRODUCTS, *PASSES)}))  # fmt: skip

    timed = make_timer(dev, events=True)

    def step(mod, disabled, c):
        def run():
            mod.disabled = disabled
            module_step(mod, c["x"], c["g"])

        return run

    for round_ in range(args.rounds + 1):  # round 0 warms up
        for c in cases:
            variants = [("squash on", step(c["sq"], False, c)),
                        ("squash off", step(c["sq"], True, c)),
                        ("dense on", step(c["dense"], False, c)),
                        ("dense off", step(c["dense"], True, c))]  # fmt: skip
            for label, fn in variants:
                for _ in range(args.reps):
                    ms = timed(fn)
                    if round_:
                        c["t"][label].append(ms)
            for _ in range(args.reps):
                ops = {}

                def op_timer(name, fn, ops=ops):
                    result = []
                    ops[name] = timed(lambda: result.append(fn()))
                    return result[0]

                with torch.no_grad():
                    adapter_ops(c["sq"], c["x"].detach(), c["g"], *c["base"], timer=op_timer)
                if round_:
                    for k, v in ops.items():
                        c["t"][k].append(v)
        print(f"  round {round_}/{args.rounds} done", flush=True)
    return [dict(name=c["name"], shape=c["shape"],
                 ms={k: statistics.median(v) for k, v in c["t"].items()})
            for c in cases]  # fmt: skip


def split(ms: dict) -> dict:
    """The squash adapters' cost and its parts, and dense QLoRA's adapters' cost (ms)."""
    cost = ms["squash on"] - ms["squash off"]
    products = sum(ms[k] for k in PRODUCTS)
    passes = sum(ms[k] for k in PASSES)
    return dict(cost=cost, products=products, passes=passes, rest=cost - products - passes,
                dense=ms["dense on"] - ms["dense off"], base=ms["squash off"])  # fmt: skip


def table(args, rank: int, results: list) -> str:
    layers = LAYERS[args.model]
    fmt = lambda v: f"{v:.2f}"  # noqa: E731
    lines = [
        f"# Adapter cost by linear: {args.model} shapes, {args.tokens} tokens, squash "
        f"{args.sparse_factor.upper() if args.sparse_factor != 'both' else 'A+B'} "
        f"{round(args.sparsity * 100)}% r={rank} against dense QLoRA r={args.rank}",
        f"# {machine_line(args.device, DTYPES[args.dtype])}",
        "",
        f"Milliseconds of one module step (forward + backward), medians of {args.rounds} "
        f"interleaved rounds of {args.reps} steps. squash adapters: its step with adapters on "
        "less off; factor products and element-wise passes: the same step's ops timed one by one; "
        "rest: the adapters' cost less both (per-op dispatch and autograd, the base product "
        "slowed after the sparse kernels). Dense QLoRA adapters: torchtune's LoRALinear on less "
        "off.",
        "",
        "| linear | in -> out | base step (adapters off) | squash adapters | factor products | "
        "element-wise | rest | dense QLoRA adapters |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    total = dict.fromkeys(("cost", "products", "passes", "rest", "dense", "base"), 0.0)
    for r in results:
        s = split(r["ms"])
        for k in total:
            total[k] += s[k]
        lines.append(f"| {r['name']} | {r['shape'][0]} -> {r['shape'][1]} | {fmt(s['base'])} | "
                     f"{fmt(s['cost'])} | {fmt(s['products'])} | {fmt(s['passes'])} | "
                     f"{fmt(s['rest'])} | {fmt(s['dense'])} |")  # fmt: skip

    def share(k):
        return f" ({100 * total[k] / total['cost']:.0f}%)" if total["cost"] > 0 else ""

    lines.append(f"| **a layer** | | {fmt(total['base'])} | {fmt(total['cost'])} | "
                 f"{fmt(total['products'])}{share('products')} | {fmt(total['passes'])}"
                 f"{share('passes')} | {fmt(total['rest'])}{share('rest')} | "
                 f"{fmt(total['dense'])} |")  # fmt: skip
    lines.append(f"| **x {layers} layers (ms a model step)** | | {total['base'] * layers:.0f} | "
                 f"{total['cost'] * layers:.0f} | {total['products'] * layers:.0f} | "
                 f"{total['passes'] * layers:.0f} | {total['rest'] * layers:.0f} | "
                 f"{total['dense'] * layers:.0f} |")  # fmt: skip
    ops = {k: sum(r["ms"][k] for r in results) for k in (*PRODUCTS, *PASSES)}
    lines += ["", "Per op, summed over a layer's linears (ms): " + ", ".join(
        f"{k} {v:.2f}" for k, v in ops.items()) + "."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None) -> str:
    args = parse_args(argv)
    rank = squash_rank(args)
    print(f"squash rank {rank} at dense rank {args.rank}'s adapter memory; timing...", flush=True)
    out = table(args, rank, measure(args, rank))
    print(out)
    return out


if __name__ == "__main__":
    main()
