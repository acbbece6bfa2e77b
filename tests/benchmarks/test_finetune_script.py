"""benchmarks/finetune.py on a one-layer OPT-350M slice and a one-layer SmolLM2 slice: its table's
memory columns agree with squash's memory arithmetic from shapes (the script measures the built
models), its ranks are the largest that fit, its matmul floor is the step's FLOPs counted here by
hand divided by the rate it prints, and its ratio columns are the quotients of its other columns
(no timing is asserted). The recipe rows are checked on logs written here by hand."""

import json
import re
import subprocess
import sys
from pathlib import Path

import finetune as ft
import pytest
import torch

from squash.training import lora_adapter_memory, max_rank_within

REPO = Path(__file__).resolve().parents[2]


# one layer of each: (in, out) of the adapted linears, of the other frozen linears (OPT's
# project_in and project_out), the output head's input size (tied: the embedding width), heads,
# head dim, table file
FAMILIES = {
    "opt350m": ([(1024, 1024)] * 4 + [(1024, 4096), (4096, 1024)], [(512, 1024), (1024, 512)],
                512, 16, 64, "finetune_cpu_fp32_1layers.md"),
    "smollm2": ([(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536),
                 (1536, 576)], [], 576, 9, 64, "finetune_cpu_fp32_smollm2_1layers.md"),
}  # fmt: skip
T, VOCAB = 32, 1024  # tokens a step (1 x 32), vocabulary of the random model


def _step_flops(shapes, other, head_in, heads, head_dim, rank, factor):
    """Matmul FLOPs of one step by hand: frozen linears forward + input gradient (2 products),
    adapter factors forward + input + weight gradient (3) at their fan-in (none when ``factor``
    is ``"off"``), the output head (2), attention (Q K^T and P V forward, four products
    backward)."""
    k = lambda n: max(1, round(0.1 * n))  # fan-in at 90% sparsity
    total = sum(4 * T * i * o for i, o in shapes + other) + 4 * T * head_in * VOCAB
    total += 12 * T * T * heads * head_dim
    for i, o in shapes if factor != "off" else []:
        a_in = k(i) if factor in ("a", "both") else i
        b_in = k(rank) if factor == "both" else rank
        total += 6 * T * rank * a_in + 6 * T * o * b_in
    return total


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_finetune_table_agrees_with_the_memory_arithmetic(tmp_path, family):
    shapes, other, head_in, heads, head_dim, name = FAMILIES[family]
    cmd = [sys.executable, str(REPO / "benchmarks" / "finetune.py"), "--model", family,
           "--layers", "1", "--batch", "1", "--seq-len", str(T), "--steps", "3",
           "--vocab-size", str(VOCAB), "--no-recipes", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (table,) = tmp_path.glob(name)
    text = table.read_text()
    rate = float(re.search(r"dense matmul rate \(([\d.]+) GFLOP/s", text).group(1)) * 1e9
    rows = [line.split("|")[1:-1] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| row")]
    budget = lora_adapter_memory(shapes, 16, dtype=torch.float32).total_bytes
    r_both = max_rank_within(budget, shapes, sparsity=0.9, sparse_factor="both", dtype=torch.float32)
    r_a = max_rank_within(budget, shapes, sparsity=0.9, sparse_factor="a", dtype=torch.float32)
    assert lora_adapter_memory(shapes, r_both + 1, sparsity=0.9, sparse_factor="both",
                               dtype=torch.float32).total_bytes > budget
    expected = {
        "torchtune QLoRA r=16": (16, None), "squash's QLoRA r=16": (16, None),
        "squash r=16, A 90%": (16, "a"),
        f"squash r={r_a}, A 90%": (r_a, "a"), f"squash r={r_both}, A+B 90%": (r_both, "both"),
        f"squash r={r_both}, A+B 90%, mask update": (r_both, "both"),
        f"bound: squash r={r_both}, A+B 90%, adapters off": (r_both, "off"),
        "LoRA r=16, no quantization": (16, None),
    }
    main = [r for r in rows if not r[0].strip().startswith("...")]
    assert [r[0].strip() for r in main] == list(expected)
    base_mem = lora_adapter_memory(shapes, 16, dtype=torch.float32)
    base_peak, base_step = float(main[0][4]), float(main[0][6].split()[0])
    for row in main:
        rank, factor = expected[row[0].strip()]
        sparse = {None: None, "off": "both"}.get(factor, factor)  # off: the A+B model's adapters
        mem = lora_adapter_memory(shapes, rank, sparsity=0.9 if sparse else None,
                                  sparse_factor=sparse or "a", dtype=torch.float32)
        assert int(row[1].replace(",", "")) == mem.trainable_params
        assert float(row[2]) == pytest.approx(mem.total_bytes / 1024**2, abs=0.05)
        # the ratio of the unrounded byte counts (known exactly here), to the printed 2 decimals
        assert float(row[3]) == pytest.approx(mem.total_bytes / base_mem.total_bytes, abs=0.0051)
        assert float(row[5]) == pytest.approx(float(row[4]) / base_peak, abs=0.01)
        # step seconds are printed to 2 decimals: check the quotients against the intervals the
        # rounding leaves (h = half a printed unit)
        step, h = float(row[6].split()[0]), 0.005
        lo, hi = (step - h) / (base_step + h), (step + h) / max(base_step - h, 1e-9)
        assert lo - h <= float(row[7]) <= hi + h
        assert 32 / (step + h) - 0.5 <= float(row[8]) <= 32 / max(step - h, 1e-9) + 0.5
        # the floor, from FLOPs counted by hand and the printed rate (2 decimals of GFLOP/s)
        floor = _step_flops(shapes, other, head_in, heads, head_dim, rank, factor) / rate
        assert float(row[9]) == pytest.approx(floor, rel=0.01)
        # step / floor of the unrounded step: inside the interval the printed step leaves
        lo, hi = (step - h) / float(row[9]), (step + h) / float(row[9])
        assert lo * 0.999 - 0.005 <= float(row[10]) <= hi * 1.001 + 0.005
    update = [r for r in rows if r[0].strip().startswith("...")]
    assert len(update) == 1 and float(update[0][4]) > 0
    # round by round (the arithmetic is checked by hand in test_round_lines_by_hand): a line a
    # row after the first, a ratio a timed round
    per_round = dict(re.findall(r"^- (.+): ([\d., ]+)$", text, flags=re.M))
    assert list(per_round) == list(expected)[1:]
    # the mask row's update step (round 2 of 3, --mask-every 2) is not among its ratios
    mask = f"squash r={r_both}, A+B 90%, mask update"
    assert all(len(v.split(", ")) == (2 if k == mask else 3) for k, v in per_round.items())
    # every row's steps, system time and page faults (formatting checked in test_host_lines_by_hand)
    host = dict(re.findall(r"^- (.+?): ((?:[\d.]+ s / \d+k(?: \(mask update\))?(?:, )?)+)$", text,
                           flags=re.M))  # fmt: skip
    assert list(host) == list(expected)
    assert all(len(v.split(", ")) == 3 for v in host.values())
    assert host[mask].split(", ")[1].endswith("(mask update)")
    # beside the table: its numbers as JSON (the rounds' seconds added), the step-time PNG
    numbers = json.loads(table.with_suffix(".json").read_text())
    assert [(r["label"], r["step_s"]) for r in numbers["rows"]] == \
        [(r[0].strip(), float(r[6].split()[0])) for r in main]  # fmt: skip
    assert [len(r["rounds_s"]) for r in numbers["rows"]] == [3] * len(main)
    assert table.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_round_lines_by_hand():
    timed = [{"label": "base", "rounds": [2.0, 4.0, 3.0]},
             {"label": "fast", "rounds": [1.0, 3.0, 2.7]},
             {"label": "slow", "rounds": [2.5, 4.0, 3.3]},
             {"label": "mask", "rounds": [3.0, None, 6.0]}]  # round 2: a mask-update step
    assert ft.round_lines(timed) == [
        "Step over the first row's (base), round by round:", "",
        "- fast: 0.50, 0.75, 0.90", "- slow: 1.25, 1.00, 1.10", "- mask: 1.50, 2.00",
    ]  # fmt: skip


def test_host_lines_by_hand():
    timed = [{"label": "base", "rounds": [2.0, 4.0], "host": [(236283, 0.644), (1499, 0.0)]},
             {"label": "mask", "rounds": [3.0, None], "host": [(500, 1.004), (12000, 0.12)]}]
    assert ft.host_lines(timed) == [
        "System CPU s / minor page faults of each row's step, round by round:", "",
        "- base: 0.64 s / 236k, 0.00 s / 1k", "- mask: 1.00 s / 0k, 0.12 s / 12k (mask update)",
    ]  # fmt: skip


def _disk_log(log_dir, tokens_per_s):
    """A torchtune ``DiskLogger`` file: ``Step N | name:value ...`` a line."""
    log_dir.mkdir(parents=True)
    lines = [f"Step {i + 1} | loss:2.5 lr:0.0001 tokens_per_second_per_gpu:{t}"
             for i, t in enumerate(tokens_per_s)]
    (log_dir / "log_1.txt").write_text("\n".join(lines) + "\n")


def test_recipe_rows_from_the_logs(tmp_path):
    # Step 1 warms up and is left out; a run's tokens/s is the median of the rest.
    _disk_log(tmp_path / "a", [10.0, 300.0, 340.0, 320.0])
    steps = ft.logged_steps(tmp_path / "a")
    assert [float(v["tokens_per_second_per_gpu"]) for v in steps] == [300.0, 340.0, 320.0]
    mib = 1024**2
    runs = {
        ("torchtune QLoRA", "lora_finetune_single_device"): [
            {"tokens_per_s": 400.0, "peak": 100 * mib}, {"tokens_per_s": 300.0, "peak": 120 * mib},
            {"tokens_per_s": 350.0, "peak": 110 * mib}],
        ("squash's QLoRA", "squash_finetune"): [
            {"tokens_per_s": 480.0, "peak": 80 * mib}, {"tokens_per_s": 330.0, "peak": 85 * mib},
            {"tokens_per_s": 385.0, "peak": 81 * mib}],
        ("squash, A+B", "squash_finetune"): [
            {"tokens_per_s": 440.0, "peak": 90 * mib}, {"tokens_per_s": 270.0, "peak": 95 * mib},
            {"tokens_per_s": 420.0, "peak": 99 * mib}],
    }  # fmt: skip
    torchtune, dense_row, squash_row = ft.recipe_lines(runs)
    # median [min-max] over the rounds, the largest peak, each / torchtune per round by hand
    assert torchtune.startswith("| `tune run lora_finetune_single_device` (torchtune QLoRA) |")
    assert "| 120 (whole process) |" in torchtune and "350 [300-400] (its log)" in torchtune
    assert "of torchtune's" not in torchtune
    assert dense_row.startswith("| `tune run squash_finetune` (squash's QLoRA) |")
    assert "| 85 (whole process) |" in dense_row and "385 [330-480] (its log)" in dense_row
    assert "(1.20, 1.10, 1.10 of torchtune's, per round)" in dense_row
    assert squash_row.startswith("| `tune run squash_finetune` (squash, A+B) |")
    assert "| 99 (whole process) |" in squash_row and "420 [270-440] (its log)" in squash_row
    assert "(1.10, 0.90, 1.20 of torchtune's, per round)" in squash_row


def test_a_log_without_timed_steps_is_an_error(tmp_path):
    _disk_log(tmp_path / "a", [10.0])
    with pytest.raises(RuntimeError, match="no step after the first"):
        ft.logged_steps(tmp_path / "a")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_baseline_row_is_torchtunes_own_qlora_on_the_same_tensors(tmp_path, family):
    """The ``torchtune QLoRA`` row holds torchtune's own ``LoRALinear`` (quantized base) and
    ``FrozenNF4Linear`` wherever squash's QLoRA row of the same base and seed holds squash's NF4
    classes, on the same NF4 weights, and its loss and every adapter gradient equal squash's (the
    same math through torchao's ``linear_nf4``)."""
    from torchtune.modules.low_precision import FrozenNF4Linear
    from torchtune.modules.peft import LoRALinear

    from squash.nf4 import NF4Linear, NF4LoRALinear

    args = ft.parse_args(["--model", family, "--layers", "1", "--vocab-size", str(VOCAB),
                          "--no-recipes", "--seq-len", str(T), "--batch", "1"])  # fmt: skip
    base = ft.base_state_dict(args, ft.write_random_checkpoint(args, tmp_path / "ckpt"))
    (_, torchtune_kw, _), (_, squash_kw, _) = ft.rows(args)[:2]
    models = []
    for kw in (torchtune_kw, squash_kw):
        torch.manual_seed(0)
        models.append(ft.build(args, kw, base)[0])
    tt, sq = (dict(m.named_modules()) for m in models)
    swapped = {n: type(m) for n, m in sq.items() if type(m) in (NF4LoRALinear, NF4Linear)}
    assert swapped and not any(type(m) in (NF4LoRALinear, NF4Linear) for m in tt.values())
    for n, cls in swapped.items():
        assert type(tt[n]) is (LoRALinear if cls is NF4LoRALinear else FrozenNF4Linear), n
        w_tt, w_sq = tt[n].weight, sq[n].weight
        blocks = (w_tt.block_size, w_tt.scaler_block_size)
        assert blocks == (w_sq.block_size, w_sq.scaler_block_size), n
        assert torch.equal(w_tt.get_original_weight(), w_sq.get_original_weight()), n
    batch = ft.make_batch(args)
    losses, grads = [], []
    for m in models:
        logits = torch.cat(m(batch), dim=1)  # the output chunks
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                                 batch[:, 1:].flatten())  # fmt: skip
        loss.backward()
        losses.append(loss)
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    torch.testing.assert_close(losses[0], losses[1])
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], msg=n)
