"""Where a fine-tuning step's time goes: one step (forward, backward, AdamW) under torch.profiler,
its time split by module kind, against the step's matmul floor.

Two models, random weights at real sizes (no download):

- ``opt350m``: OPT-350M shapes (hidden 1024, MLP 4096, vocabulary 50,272), ``--layers`` of its 24
  layers, adapters on q, k, v, output projections and both MLP linears.
- ``smollm2``: SmolLM2-135M shapes (Llama: hidden 576, 9 heads, 3 KV heads, MLP 1536, vocabulary
  49,152, tied embeddings), 30 layers, adapters on all seven linears. Where torchao's default
  NF4 blocks (64 x 256) do not divide a weight, the largest scaler block that does is used.

Adapters (``--adapter``): ``squash`` (FFI, ``--sparse-factor`` at ``--sparsity``, at the largest
rank whose adapter + gradient + AdamW bytes fit in dense LoRA's at ``--rank``), ``qlora``
(torchtune's dense LoRA at ``--rank``, torchao's NF4), ``squash-qlora`` (the same adapters with
squash's NF4 kernel: ``NF4LoRALinear``, what squash's ``qlora_*`` builders build) or ``lora``
(dense adapters, unquantized base);
``--unquantized`` keeps squash's (or QLoRA's) base weights dense, so that a pair of runs shows
what NF4 costs. The tied output head is computed as squash's builders compute it
(``FlatTiedLinear``: one 2-D matmul) in every row; ``--head torchtune`` keeps torchtune's
``TiedLinear`` (a batched matmul over each non-contiguous output chunk, slow on the CPU in bf16).

Kinds: every operator's own time (self time) goes to the innermost module kind it ran in; a
backward operator goes where the forward operator that made its autograd node ran (the
profiler's sequence numbers tie them):
NF4 dequantize (squash::nf4_dequantize, or torchao's dequantization ops) / base matmul (the
frozen linears' products) / adapter ops (lora_a, lora_b, scaling and sum) / attention (SDPA,
RoPE, reshapes) / norms and activations / output head (the vocabulary projection) / loss /
optimizer / other (embedding, autograd bookkeeping).

The matmul floor is the step's matmul FLOPs (``step_flops``: forward and input gradient of every
frozen linear, forward and both gradients of the adapters at their density, the attention
products, the head) over this device's dense matmul rate, measured here on a
``(tokens, hidden) x (hidden, 4 hidden)`` product.

Below the table: each timed step's wall time, minor page faults and system CPU time (the
process's ``getrusage`` counters): the memory a step takes from the kernel again after freeing
it, and what that cost. A host where a fault turns expensive shows it there.

    python benchmarks/profile_step.py --model smollm2 --batch 4 --seq-len 256
    python benchmarks/profile_step.py --model opt350m --layers 4 --seq-len 512
    python benchmarks/profile_step.py --device cuda --dtype bf16
"""

import argparse
import contextlib
import resource
import sys

import torch
from torch import nn

from common import (DTYPES, OPT_350M, SMOLLM2_135M, adapted_shapes, kernels, machine_line,
                    make_timer, sync)  # fmt: skip

SMOLLM2 = dict(SMOLLM2_135M, max_seq_len=2048)  # squash.models.smollm2's sizes
ATTN = ["q_proj", "k_proj", "v_proj", "output_proj"]
KINDS = ["NF4 dequantize", "base matmul", "adapter ops", "attention", "norms/activations",
         "output head", "loss", "optimizer", "other"]  # fmt: skip
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
              "aten::baddbmm", "aten::_mkldnn_matmul", "mkldnn::_linear_pointwise"}  # fmt: skip


# ---- FLOPs --------------------------------------------------------------------------------------
def step_flops(tokens, base, adapters, head, attention) -> dict:
    """Matmul FLOPs of one training step, by kind (multiply-adds count 2).

    Args:
        tokens (int): tokens in the batch (batch x sequence length).
        base (list[tuple[int, int]]): frozen linears ``(in, out)``: forward and input gradient.
        adapters (list[tuple[int, int, float]]): trainable factors ``(in, out, density)``
            (density 1 for dense, ``k / in`` for FFI): forward, input and weight gradient.
        head (list[tuple[int, int]]): frozen dense output projections ``(in, out)``.
        attention (list[tuple[int, int, int, int]]): per layer ``(batch, seq, heads, head_dim)``:
            ``Q K^T`` and ``P V`` over the full ``seq x seq`` forward, four products backward.

    Returns:
        dict[str, float]: ``base matmul``, ``adapter ops``, ``output head``, ``attention`` and
        ``total``.
    """
    out = {
        "base matmul": sum(2 * 2 * tokens * i * o for i, o in base),
        "adapter ops": sum(3 * 2 * tokens * i * o * d for i, o, d in adapters),
        "output head": sum(2 * 2 * tokens * i * o for i, o in head),
        "attention": sum(6 * 2 * b * s * s * h * hd for b, s, h, hd in attention),
    }
    out["total"] = sum(out.values())
    return out


def model_flops(model: nn.Module, batch: int, seq: int, head_dim: int) -> dict:
    """:func:`step_flops` of a torchtune decoder built by :func:`build`."""
    from torchtune.modules import MultiHeadAttention
    from torchtune.modules.peft import LoRALinear

    from squash.modules import FFILinear, SparseLoRALinear

    base, adapters, head, attention = [], [], [], []
    for name, m in model.named_modules():
        if isinstance(m, (LoRALinear, SparseLoRALinear)):
            base.append((m.in_dim, m.out_dim))
            for f in () if m.disabled else (m.lora_a, m.lora_b):  # disabled: no adapter work
                if isinstance(f, FFILinear):
                    adapters.append((f.in_features, f.out_features, f.fan_in / f.in_features))
                else:
                    adapters.append((f.in_features, f.out_features, 1.0))
        elif isinstance(m, nn.Linear) and "lora_" not in name:
            (head if name.endswith("output") else base).append((m.in_features, m.out_features))
        elif isinstance(m, MultiHeadAttention):
            attention.append((batch, seq, m.num_heads, head_dim))
    if getattr(model, "output", None) is not None and not isinstance(model.output, nn.Linear):
        head.append(tuple(model.tok_embeddings.weight.shape[::-1]))  # tied: x @ E^T
    return step_flops(batch * seq, base, adapters, head, attention)


def dense_rate(tokens: int, hidden: int, dtype, device: str, repeats: int = 5) -> float:
    """This device's dense matmul FLOP/s on ``(tokens, hidden) x (hidden, 4 hidden)``."""
    a = torch.randn(tokens, hidden, dtype=dtype, device=device)
    b = torch.randn(hidden, 4 * hidden, dtype=dtype, device=device)
    timed = make_timer(device)
    best = min(timed(lambda: a @ b) for _ in range(repeats + 1)) / 1e3  # seconds
    return 2 * tokens * hidden * 4 * hidden / best


# ---- the model ----------------------------------------------------------------------------------
def quantize_bases(model: nn.Module) -> None:
    """Put every adapted linear's base weight in NF4, block sizes chosen per weight as squash's
    builders choose them (``nf4_block_sizes``)."""
    from torchtune.modules.peft import LoRALinear

    from squash.modules import SparseLoRALinear
    from squash.nf4 import quantize_nf4

    for m in model.modules():
        if isinstance(m, (LoRALinear, SparseLoRALinear)):
            w = m.weight.detach()
            m.weight = nn.Parameter(quantize_nf4(w), requires_grad=False)
            m._quantize_base = True


def squash_rank(shapes, rank, sparsity, sparse_factor, dtype) -> int:
    from squash.training import lora_adapter_memory, max_rank_within

    budget = lora_adapter_memory(shapes, rank, dtype=dtype).total_bytes
    return max_rank_within(budget, shapes, sparsity=sparsity, sparse_factor=sparse_factor,
                           dtype=dtype)  # fmt: skip


def build(args):
    """``(model, head_dim, rank)`` on ``args.device`` in ``args.dtype``, adapters trainable."""
    from torchtune import training
    from torchtune.models.llama3_2._component_builders import lora_llama3_2
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    from squash.models.opt import lora_opt
    from squash.modules import flatten_tied_output, swap_lora_linear, use_squash_nf4_

    dtype = DTYPES[args.dtype]
    sizes = OPT_350M if args.model == "opt350m" else SMOLLM2
    cfg = dict(sizes, num_layers=args.layers or sizes["num_layers"])
    shapes = adapted_shapes(args.model, cfg["num_layers"])
    head_dim = cfg["embed_dim"] // cfg["num_heads"]
    rank = args.rank
    if args.adapter == "squash":
        rank = squash_rank(shapes, args.rank, args.sparsity, args.sparse_factor, dtype)
    with training.set_default_dtype(dtype), torch.device(args.device):
        common = dict(lora_rank=rank, lora_alpha=2 * rank, quantize_base=False)
        if args.model == "opt350m":
            model = lora_opt(ATTN, True, **cfg, **common)
        else:
            model = lora_llama3_2(ATTN, True, **cfg, **common)
            if args.head == "flat":
                flatten_tied_output(model)
    torch.manual_seed(0)
    if args.adapter == "squash":
        model = swap_lora_linear(model, sparsity=args.sparsity, sparse_factor=args.sparse_factor)
    if args.adapter in ("squash", "qlora", "squash-qlora") and not args.unquantized:
        quantize_bases(model)
        if args.adapter == "squash-qlora":
            use_squash_nf4_(model)
    model.to(args.device)
    set_trainable_params(model, get_adapter_params(model))
    model.set_num_output_chunks(8)
    return model, head_dim, rank


# ---- one profiled step --------------------------------------------------------------------------
def _kind_of_module(name: str, m: nn.Module):
    from torchtune.modules import MultiHeadAttention, RMSNorm
    from torchtune.modules.peft import LoRALinear

    from squash.modules import SparseLoRALinear

    if isinstance(m, (LoRALinear, SparseLoRALinear)):
        return "adapted"
    if name.split(".")[-1] in ("lora_a", "lora_b"):
        return "adapter ops"
    if isinstance(m, MultiHeadAttention):
        return "attention"
    if isinstance(m, (RMSNorm, nn.LayerNorm)) or name.endswith(("mlp", "activation")):
        return "norms/activations"
    if isinstance(m, nn.Linear):
        return "base matmul" if not name.endswith("output") else "output head"
    return None


@contextlib.contextmanager
def scoped(model: nn.Module):
    """Each module of a known kind runs its forward inside ``record_function("kind::<kind>")``."""
    handles = []
    for name, m in model.named_modules():
        kind = _kind_of_module(name, m)
        if kind is None:
            continue

        def pre(mod, inputs, kind=kind):
            mod._squash_scope = torch.autograd.profiler.record_function(f"kind::{kind}")
            mod._squash_scope.__enter__()

        def post(mod, inputs, output):
            # popped, so that no profiler object stays on the module (deepcopy refuses one)
            mod.__dict__.pop("_squash_scope").__exit__(None, None, None)

        handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    tied = getattr(model, "output", None)
    if tied is not None and not isinstance(tied, nn.Module):  # TiedLinear: a plain callable

        def head(h):
            with torch.autograd.profiler.record_function("kind::output head"):
                return tied(h)

        model.output = head
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        if tied is not None and not isinstance(tied, nn.Module):
            model.output = tied


def train_step(model, optimizer, tokens, device):
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], dim=1)
    loss_fn = CEWithChunkedOutputLoss(num_output_chunks=8)
    with torch.autograd.profiler.record_function("kind::other"):
        logits = model(tokens)
    with torch.autograd.profiler.record_function("kind::loss"):
        loss = loss_fn(logits, labels)
    loss.backward()
    with torch.autograd.profiler.record_function("kind::optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync(device)
    return loss.item()


def _is_dequant(ev) -> bool:
    """Whether an event is part of an NF4 dequantization: squash's op, or (torchao) any operator
    other than the matmul under torchao's LinearNF4 function or its backward node (NF4Tensor
    dequantizes in Python, so its own ``to`` is not recorded, only the operators it runs)."""
    e, matmul = ev, False
    while e is not None:
        if e.name == "squash::nf4_dequantize":
            return True
        matmul = matmul or e.name in MATMUL_OPS
        if e.name.startswith("LinearNF4"):
            return not matmul
        e = e.cpu_parent
    return False


def _scope(ev):
    """The innermost ``kind::`` scope around an event, or None."""
    e = ev.cpu_parent
    while e is not None:
        if e.name.startswith("kind::"):
            return e.name[len("kind::"):]
        e = e.cpu_parent
    return None


_CUSTOM_NODES = {"GeneratedBackwardFor_squash_nf4_linear": "adapted",
                 "GeneratedBackwardFor_squash_ffi_linear": "adapter ops"}  # fmt: skip


def classify(events, device: str) -> tuple:
    """Milliseconds by kind from a profiler's events (self time of every operator), and by kind
    and operator name."""
    use_cuda = device.startswith("cuda")
    ops = [e for e in events if not e.name.startswith("kind::")]
    fwd_kind = {}  # autograd sequence number -> the forward op's kind
    for e in ops:
        scope = _scope(e) if e.sequence_nr >= 0 else None
        if scope is not None:  # a forward operator that made an autograd node
            fwd_kind.setdefault(e.sequence_nr, scope)
    ms = dict.fromkeys(KINDS, 0.0)
    top = {}
    for e in ops:
        own = (e.self_device_time_total if use_cuda else e.self_cpu_time_total) / 1e3
        if own <= 0:
            continue
        scope, dequant = _scope(e), _is_dequant(e)
        if scope is None:  # backward: the autograd node (at or above it) that the forward made
            p = e
            while p is not None and p.sequence_nr < 0:
                p = p.cpu_parent
            if p is not None and p.name.startswith(tuple(_CUSTOM_NODES)):
                # torch.library's autograd nodes: numbered before their forward op is recorded
                scope = _CUSTOM_NODES[next(k for k in _CUSTOM_NODES if p.name.startswith(k))]
            elif p is not None and p.sequence_nr in fwd_kind:
                scope = fwd_kind[p.sequence_nr]
        if scope == "adapted":
            if dequant:
                scope = "NF4 dequantize"
            elif e.name in MATMUL_OPS:
                scope = "base matmul"
            else:
                scope = "adapter ops"
        elif dequant and scope in ("base matmul", None):
            scope = "NF4 dequantize"
        kind = scope if scope in ms else "other"
        ms[kind] += own
        top.setdefault(kind, {}).setdefault(e.name, 0.0)
        top[kind][e.name] += own
    return ms, top


def host_counters() -> tuple:
    """``(minor page faults, system CPU seconds)`` of this process so far (``getrusage``)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_minflt, ru.ru_stime


def host_since(before: tuple) -> tuple:
    """The :func:`host_counters` counted since ``before`` (an earlier reading of them)."""
    return tuple(now - then for then, now in zip(before, host_counters()))


def profile(args) -> dict:
    model, head_dim, rank = build(args)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(0)
    vocab = model.tok_embeddings.num_embeddings
    tokens = torch.randint(3, vocab, (args.batch, args.seq_len), generator=g).to(args.device)
    for _ in range(args.warmup):
        train_step(model, optimizer, tokens, args.device)
    walls, host = [], []
    timed = make_timer(args.device)
    for _ in range(args.steps):
        before = host_counters()
        walls.append(timed(lambda: train_step(model, optimizer, tokens, args.device)) / 1e3)
        host.append(host_since(before))
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with scoped(model), torch.profiler.profile(activities=activities) as prof:
        train_step(model, optimizer, tokens, args.device)
    ms, top = classify(prof.events(), args.device)
    flops = model_flops(model, args.batch, args.seq_len, head_dim)
    hidden = model.tok_embeddings.embedding_dim
    rate = dense_rate(args.batch * args.seq_len, hidden, DTYPES[args.dtype], args.device)
    return dict(ms=ms, top=top, step_s=min(walls), walls=walls, host=host, flops=flops, rate=rate,
                rank=rank)


def table(args, res) -> str:
    total = sum(res["ms"].values())
    from squash.nf4.ops import backend

    nf4_path = {"squash": f"{backend()} (squash.nf4.nf4_linear)",
                "qlora": "torchao (torchtune's LoRALinear: linear_nf4)", "lora": "none",
                "squash-qlora": f"{backend()} (squash's NF4LoRALinear)"}[args.adapter]
    if args.unquantized:
        nf4_path = "none (--unquantized: dense base weights)"
    adapter = args.adapter if args.adapter != "squash" else (
        f"squash A{'+B' if args.sparse_factor == 'both' else ''} {round(args.sparsity * 100)}%")
    lines = [
        f"# one step: {args.model}, {args.layers or SMOLLM2['num_layers']} layers, "
        f"{adapter} r={res['rank']}, {args.batch} x {args.seq_len} tokens"
        + (f", {args.head} head" if args.model == "smollm2" else ""),
        f"# {machine_line(args.device, DTYPES[args.dtype])}",
        f"# squash kernels: {kernels(args.device)}; NF4 path: "
        f"{nf4_path}",
        "",
        "| kind | ms | share | matmul GFLOP |",
        "|---|---:|---:|---:|",
    ]
    for k in KINDS:
        gf = res["flops"].get(k)
        gf = f"{gf / 1e9:.1f}" if gf is not None else ""
        lines.append(f"| {k} | {res['ms'][k]:.1f} | {100 * res['ms'][k] / total:.1f}% | {gf} |")
    floor = res["flops"]["total"] / res["rate"]
    lines += [
        f"| **profiled step** | {total:.1f} | 100% | {res['flops']['total'] / 1e9:.1f} |",
        "",
        f"step without profiler (fastest of {args.steps}): {res['step_s'] * 1e3:.1f} ms",
        f"dense matmul rate here: {res['rate'] / 1e9:.0f} GFLOP/s; matmul floor "
        f"{floor * 1e3:.1f} ms; step / floor = {res['step_s'] / floor:.2f}",
        "timed steps (wall s, minor page faults, system CPU s): "
        + "; ".join(f"{w:.2f}, {f}, {s:.2f}" for w, (f, s) in zip(res["walls"], res["host"])),
    ]
    if args.top:
        lines.append("")
        for k in KINDS:
            ops = sorted(res["top"].get(k, {}).items(), key=lambda kv: -kv[1])[: args.top]
            lines.append(f"{k}: " + ", ".join(f"{n} {v:.1f}" for n, v in ops))
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["smollm2", "opt350m"], default="smollm2")
    p.add_argument("--layers", type=int, default=None, help="default: 30 (SmolLM2), 4 (OPT)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--adapter", choices=["squash", "qlora", "squash-qlora", "lora"],
                   default="squash")
    p.add_argument("--rank", type=int, default=16, help="dense LoRA's rank (squash: its bytes)")
    p.add_argument("--head", choices=["flat", "torchtune"], default="flat",
                   help="SmolLM2's tied head: squash's FlatTiedLinear or torchtune's TiedLinear")
    p.add_argument("--unquantized", action="store_true",
                   help="squash/qlora on dense base weights (what NF4 costs: against the NF4 row)")
    p.add_argument("--sparsity", type=float, default=0.9)
    p.add_argument("--sparse-factor", choices=["a", "b", "both"], default="both")
    p.add_argument("--steps", type=int, default=2, help="timed steps without the profiler")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--top", type=int, default=0, help="list each kind's N costliest operators")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on GPU")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("fp32" if args.device == "cpu" else "bf16")
    if args.layers is None:
        args.layers = 4 if args.model == "opt350m" else SMOLLM2["num_layers"]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    print(table(args, profile(args)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
