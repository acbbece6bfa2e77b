"""Adapter training memory: squash (FFI-sparse LoRA) at 4x the rank vs QLoRA, as markdown tables.

    python benchmarks/memory.py [--rank 8] [--sparsity 0.9]

Counts the trainable state only (adapter parameters, gradients, AdamW moments in the parameter
dtype (bf16) plus the fp32 ``step`` scalars, FFI indices); the frozen NF4 base, activations and
allocator slack are the same for all settings and left out. The first table measures built tiny
Llama 3.2 models (torchtune's ``lora_llama3_2`` component builder, QLoRA adapter placement of
torchtune's 1B config: q, v, output projections and the MLP); the second computes the real
Llama 3.2 1B shapes analytically, without building the model.
"""

import argparse

import torch
from torchtune.models.llama3_2 import lora_llama3_2
from torchtune.training import set_default_dtype

from squash.modules import swap_lora_linear
from squash.training import adapted_shapes, adapter_memory, lora_adapter_memory, max_rank_within

LORA_ATTN = ["q_proj", "v_proj", "output_proj"]  # torchtune's llama3_2/1B_qlora_single_device
TINY = dict(vocab_size=1024, num_layers=4, num_heads=8, num_kv_heads=2, embed_dim=256,
            max_seq_len=256, intermediate_dim=1024)  # fmt: skip
LLAMA3_2_1B = dict(num_layers=16, num_heads=32, num_kv_heads=8, embed_dim=2048,
                   intermediate_dim=8192)  # fmt: skip


def llama_shapes(num_layers, num_heads, num_kv_heads, embed_dim, intermediate_dim, **_):
    """``(in, out)`` of the adapted linears: q, v, output_proj, w1, w2, w3 in every layer."""
    kv_dim = num_kv_heads * (embed_dim // num_heads)
    layer = [(embed_dim, embed_dim), (embed_dim, kv_dim), (embed_dim, embed_dim),
             (embed_dim, intermediate_dim), (intermediate_dim, embed_dim),
             (embed_dim, intermediate_dim)]  # fmt: skip
    return layer * num_layers


def settings(rank, sparsity):
    return [
        (f"QLoRA r={rank}", rank, None, "a"),
        (f"squash r={4 * rank}, A {sparsity:.0%} sparse", 4 * rank, sparsity, "a"),
        (f"squash r={4 * rank}, A+B {sparsity:.0%} sparse", 4 * rank, sparsity, "both"),
    ]


def table(rows, budget, shapes):
    head = (
        "| setting | trainable params | params+grads+AdamW | FFI indices | total | vs QLoRA "
        "| mask-update extra | largest rank in QLoRA's bytes |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for name, sparsity, factor, mem in rows:
        best = max_rank_within(budget, shapes, sparsity=sparsity, sparse_factor=factor)
        lines.append(
            f"| {name} | {mem.trainable_params:,} | {_mib(mem.total_bytes - mem.index_bytes)} "
            f"| {_mib(mem.index_bytes)} | {_mib(mem.total_bytes)} "
            f"| {mem.total_bytes / budget:.2f}x | {_mib(mem.mask_update_bytes)} | {best} |"
        )
    return "\n".join(lines)


def _mib(n):
    return f"{n / 2**20:.3f} MiB" if n < 2**30 else f"{n / 2**30:.3f} GiB"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=8, help="QLoRA rank r (squash uses 4r)")
    parser.add_argument("--rank-1b", type=int, default=64, help="QLoRA rank for the 1B table")
    parser.add_argument("--sparsity", type=float, default=0.9)
    args = parser.parse_args()

    rows = []
    for name, rank, sparsity, factor in settings(args.rank, args.sparsity):
        torch.manual_seed(0)
        with set_default_dtype(torch.bfloat16):
            model = lora_llama3_2(LORA_ATTN, apply_lora_to_mlp=True, lora_rank=rank,
                                  lora_alpha=2.0 * rank, quantize_base=True, **TINY)  # fmt: skip
            if sparsity is not None:
                swap_lora_linear(model, sparsity=sparsity, sparse_factor=factor)
        rows.append((name, sparsity, factor, adapter_memory(model)))
    shapes = adapted_shapes(model)
    assert shapes == llama_shapes(**TINY)
    print(f"## Tiny Llama 3.2 ({TINY}), bf16, measured on built models\n")
    print(table(rows, rows[0][-1].total_bytes, shapes))

    shapes = llama_shapes(**LLAMA3_2_1B)
    rows = [
        (name, sparsity, factor,
         lora_adapter_memory(shapes, rank, sparsity=sparsity, sparse_factor=factor))
        for name, rank, sparsity, factor in settings(args.rank_1b, args.sparsity)
    ]  # fmt: skip
    print(f"\n## Llama 3.2 1B ({LLAMA3_2_1B}), bf16, computed from shapes\n")
    print(table(rows, rows[0][-1].total_bytes, shapes))


if __name__ == "__main__":
    main()
