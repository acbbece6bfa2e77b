"""benchmarks/profile_step.py: its FLOP count against a hand computation, from explicit shapes and
from a built model, and its classification of one profiled step (a dense base has no NF4 time, a
quantized one does, through squash's kernel)."""

import profile_step
import pytest
import torch


def test_step_flops_by_hand():
    got = profile_step.step_flops(
        tokens=10, base=[(4, 6)], adapters=[(4, 2, 0.5), (2, 6, 1.0)], head=[(6, 20)],
        attention=[(2, 5, 3, 2)],
    )  # fmt: skip
    # base: forward + input gradient, 2 x 2 x 10 x 4 x 6
    assert got["base matmul"] == 960
    # adapters: forward, input and weight gradient: 3 x 2 x 10 x (4 x 2 x 0.5 + 2 x 6)
    assert got["adapter ops"] == 240 + 720
    assert got["output head"] == 2 * 2 * 10 * 6 * 20
    # Q K^T and P V forward (2 products), 4 backward: 6 x 2 x batch 2 x 5 x 5 x 3 heads x 2
    assert got["attention"] == 3600
    assert got["total"] == 960 + 960 + 4800 + 3600


def test_model_flops_of_a_built_smollm2_layer_by_hand():
    args = profile_step.parse_args(["--model", "smollm2", "--layers", "1", "--adapter", "lora",
                                    "--rank", "2", "--batch", "2", "--seq-len", "3"])  # fmt: skip
    model, head_dim, rank = profile_step.build(args)
    assert (head_dim, rank) == (64, 2)
    got = profile_step.model_flops(model, 2, 3, head_dim)
    t, d, kv, f, v = 6, 576, 192, 1536, 49_152
    linears = [(d, d), (d, kv), (d, kv), (d, d), (d, f), (d, f), (f, d)]
    assert got["base matmul"] == sum(4 * t * i * o for i, o in linears)
    assert got["adapter ops"] == sum(6 * t * (i * 2 + 2 * o) for i, o in linears)
    assert got["output head"] == 4 * t * d * v  # tied embeddings
    assert got["attention"] == 12 * 2 * 3 * 3 * 9 * 64


def test_squash_adapter_density_counts_in_flops():
    args = profile_step.parse_args(["--model", "smollm2", "--layers", "1", "--adapter", "squash",
                                    "--rank", "16", "--sparse-factor", "both"])  # fmt: skip
    model, head_dim, rank = profile_step.build(args)
    got = profile_step.model_flops(model, 1, 1, head_dim)
    from squash.sparsity.ffi import fan_in_for

    d, kv, f = 576, 192, 1536
    linears = [(d, d), (d, kv), (d, kv), (d, d), (d, f), (d, f), (f, d)]
    want = sum(6 * (rank * fan_in_for(i, 0.9) + o * fan_in_for(rank, 0.9)) for i, o in linears)
    assert got["adapter ops"] == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize(
    "adapter, extra, nf4",
    [("lora", [], False), ("squash", [], True), ("qlora", [], True), ("squash-qlora", [], True),
     ("squash", ["--unquantized", "--head", "torchtune"], False)],
)  # fmt: skip
def test_profiled_step_puts_nf4_time_where_it_is(adapter, extra, nf4):
    args = profile_step.parse_args(["--model", "smollm2", "--layers", "1", "--adapter", adapter,
                                    "--batch", "1", "--seq-len", "16", "--steps", "1",
                                    "--warmup", "0", *extra])  # fmt: skip
    res = profile_step.profile(args)
    assert (res["ms"]["NF4 dequantize"] > 0) == nf4
    if adapter in ("squash", "squash-qlora") and nf4:  # squash's kernel; torchtune's: torchao's
        assert "squash::nf4_dequantize" in res["top"]["NF4 dequantize"]
        assert "aten::index" not in res["top"]["NF4 dequantize"]
    if adapter == "qlora":
        assert "aten::index" in res["top"]["NF4 dequantize"]
        assert not set(res["top"]["NF4 dequantize"]) & profile_step.MATMUL_OPS
    for kind in ("base matmul", "attention", "output head", "loss", "optimizer"):
        assert res["ms"][kind] > 0, kind
    assert "squash::ffi_linear" in res["top"]["adapter ops"] or adapter != "squash"
    # every backward FFI op is attributed to the adapters, none left unattributed
    assert not any(n.startswith("squash::") for n in res["top"].get("other", {}))
    (wall,), ((faults, system),) = res["walls"], res["host"]
    assert res["step_s"] == wall and faults >= 0 and system >= 0
    assert f"(wall s, minor page faults, system CPU s): {wall:.2f}, {faults}, {system:.2f}\n" in (
        profile_step.table(args, res)
    )


def test_host_counters_count_the_pages_of_a_fresh_block():
    """A fresh anonymous 64 MiB mapping written once, a byte a page, faults in at least one page
    per 2 MiB (one per 4 KiB page without huge pages); mmap is used rather than a tensor, whose
    memory the allocator may serve from blocks earlier tests freed."""
    import mmap

    n = 64 << 20
    block = mmap.mmap(-1, n)
    before = profile_step.host_counters()
    for i in range(0, n, mmap.PAGESIZE):
        block[i] = 1
    faults, system = profile_step.host_since(before)
    block.close()
    assert faults >= n // (2 << 20)
    assert system >= 0


def test_unquantized_and_head_options_build_what_they_say():
    from torchao.dtypes.nf4tensor import NF4Tensor
    from torchtune.modules import TiedLinear

    from squash.modules import FlatTiedLinear, SparseLoRALinear

    def built(*extra):
        args = profile_step.parse_args(["--model", "smollm2", "--layers", "1", *extra])
        return profile_step.build(args)[0]

    model = built()
    bases = [m.weight for m in model.modules() if isinstance(m, SparseLoRALinear)]
    assert len(bases) == 7 and all(isinstance(w, NF4Tensor) for w in bases)
    assert type(model.output) is FlatTiedLinear
    model = built("--unquantized", "--head", "torchtune")
    bases = [m.weight for m in model.modules() if isinstance(m, SparseLoRALinear)]
    assert len(bases) == 7 and not any(isinstance(w, NF4Tensor) for w in bases)
    assert type(model.output) is TiedLinear
