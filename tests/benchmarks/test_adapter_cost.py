"""benchmarks/adapter_cost.py: the ops it times one by one compute what SparseLoRALinear's
autograd computes, bit for bit; its split and table add up by hand; its rank is finetune.py's."""

import re

import adapter_cost
import pytest
import torch


@pytest.mark.parametrize("factor", ["both", "a", "b"])
def test_adapter_ops_equal_the_modules_autograd(factor):
    args = adapter_cost.parse_args(["--sparse-factor", factor, "--sparsity", "0.75"])
    sq, _ = adapter_cost.build(args, 64, 96, rank=12, seed=3)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 5, 64, generator=gen).reshape(10, 64).requires_grad_()
    g = torch.randn(10, 96, generator=gen)
    out = sq(x)
    out.backward(g)
    grads = {n: p.grad for n, p in sq.named_parameters() if p.requires_grad}

    base_out, base_gx = adapter_cost.base_parts(sq, x, g)
    with torch.no_grad():
        got = adapter_cost.adapter_ops(sq, x.detach(), g, base_out, base_gx)
    assert torch.equal(got["out"], out)
    assert torch.equal(got["grad_x"], x.grad)
    a_name = "lora_a.values" if factor in ("a", "both") else "lora_a.weight"
    b_name = "lora_b.values" if factor in ("b", "both") else "lora_b.weight"
    assert torch.equal(got["grad_a"], grads[a_name])
    assert torch.equal(got["grad_b"], grads[b_name])
    # and not trivially: the adapter changes the output and the input gradient
    assert not torch.equal(out, base_out) and not torch.equal(x.grad, base_gx)


def test_timed_ops_are_the_ones_named():
    args = adapter_cost.parse_args([])
    sq, _ = adapter_cost.build(args, 64, 96, rank=12)
    x, g = torch.randn(4, 64), torch.randn(4, 96)
    names = []
    with torch.no_grad():
        adapter_cost.adapter_ops(sq, x, g, *adapter_cost.base_parts(sq, x, g),
                                 timer=lambda n, fn: names.append(n) or fn())  # fmt: skip
    assert sorted(names) == sorted(adapter_cost.PRODUCTS + adapter_cost.PASSES)


def test_split_by_hand():
    ms = {"squash on": 10.0, "squash off": 6.0, "dense on": 9.0, "dense off": 6.5}
    ms.update({k: 0.25 for k in adapter_cost.PRODUCTS})  # 1.5 in all
    ms.update({k: 0.5 for k in adapter_cost.PASSES})  # 2.0 in all
    s = adapter_cost.split(ms)
    assert s == dict(cost=4.0, products=1.5, passes=2.0, rest=0.5, dense=2.5, base=6.0)


def test_table_adds_up_by_hand():
    args = adapter_cost.parse_args(["--model", "opt350m"])  # 24 layers
    def ms(on, off, k, p):
        d = {"squash on": on, "squash off": off, "dense on": 3.0, "dense off": 2.0}
        d.update({n: k / 6 for n in adapter_cost.PRODUCTS})
        d.update({n: p / 4 for n in adapter_cost.PASSES})
        return d
    results = [dict(name="q", shape=(8, 8), ms=ms(5.0, 3.0, 1.2, 0.4)),
               dict(name="fc1", shape=(8, 32), ms=ms(9.0, 6.0, 1.8, 0.6))]  # fmt: skip
    text = adapter_cost.table(args, 40, results)
    layer = next(ln for ln in text.splitlines() if ln.startswith("| **a layer**"))
    cells = [c.strip() for c in layer.strip("|").split("|")]
    # base 3 + 6, cost 2 + 3, kernels 1.2 + 1.8 (60%), passes 0.4 + 0.6 (20%), rest 1 (20%),
    # dense 1 + 1
    assert cells[2:] == ["9.00", "5.00", "3.00 (60%)", "1.00 (20%)", "1.00 (20%)", "2.00"]
    step = next(ln for ln in text.splitlines() if ln.startswith("| **x 24 layers"))
    assert [c.strip() for c in step.strip("|").split("|")][2:] == \
        ["216", "120", "72", "24", "24", "48"]  # fmt: skip
    assert re.search(r"\| q \| 8 -> 8 \| 3.00 \| 2.00 \| 1.20 \| 0.40 \| 0.40 \| 1.00 \|", text)


def test_rank_is_finetunes_equal_memory_rank():
    import finetune

    args = adapter_cost.parse_args([])
    ft = finetune.parse_args(["--model", "smollm2", "--layers", "30", "--no-recipes"])
    label = next(label for label, kw, _ in finetune.rows(ft) if kw.get("sparse_factor") == "both")
    assert label.startswith(f"squash r={adapter_cost.squash_rank(args)}, A+B")
    assert adapter_cost.squash_rank(args) == 143  # the README's SmolLM2 rank in fp32


def test_a_short_run_prints_every_linear(capsys):
    text = adapter_cost.main(["--tokens", "8", "--rounds", "1", "--reps", "1"])
    for name, d_in, d_out in adapter_cost.linears("smollm2"):
        assert re.search(rf"^\| {name} \| {d_in} -> {d_out} \|", text, re.M)
    assert "x 30 layers" in text and "CPU" in text
