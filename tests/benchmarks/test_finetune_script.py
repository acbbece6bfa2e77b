"""benchmarks/finetune.py on a one-layer OPT-350M slice: its table's memory columns agree with
squash's memory arithmetic from shapes (the script measures the built models), its ranks are the
largest that fit, and its ratio columns are the quotients of its other columns (no timing is
asserted)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from squash.training import lora_adapter_memory, max_rank_within

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_finetune_table_agrees_with_the_memory_arithmetic(tmp_path):
    cmd = [sys.executable, str(REPO / "benchmarks" / "finetune.py"), "--layers", "1",
           "--batch", "1", "--seq-len", "32", "--steps", "3", "--vocab-size", "1024",
           "--no-recipes", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (table,) = tmp_path.glob("finetune_cpu_fp32_1layers.md")
    rows = [line.split("|")[1:-1] for line in table.read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| row")]
    shapes = [(1024, 1024)] * 4 + [(1024, 4096), (4096, 1024)]
    budget = lora_adapter_memory(shapes, 16, dtype=torch.float32).total_bytes
    r_both = max_rank_within(budget, shapes, sparsity=0.9, sparse_factor="both", dtype=torch.float32)
    r_a = max_rank_within(budget, shapes, sparsity=0.9, sparse_factor="a", dtype=torch.float32)
    assert lora_adapter_memory(shapes, r_both + 1, sparsity=0.9, sparse_factor="both",
                               dtype=torch.float32).total_bytes > budget
    expected = {
        "torchtune QLoRA r=16": (16, None), "squash r=16, A 90%": (16, "a"),
        f"squash r={r_a}, A 90%": (r_a, "a"), f"squash r={r_both}, A+B 90%": (r_both, "both"),
        f"squash r={r_both}, A+B 90%, mask update": (r_both, "both"),
        "LoRA r=16, no quantization": (16, None),
    }
    main = [r for r in rows if not r[0].strip().startswith("...")]
    assert [r[0].strip() for r in main] == list(expected)
    base_mem = lora_adapter_memory(shapes, 16, dtype=torch.float32)
    base_peak, base_step = float(main[0][4]), float(main[0][6].split()[0])
    for row in main:
        rank, factor = expected[row[0].strip()]
        mem = lora_adapter_memory(shapes, rank, sparsity=0.9 if factor else None,
                                  sparse_factor=factor or "a", dtype=torch.float32)
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
    update = [r for r in rows if r[0].strip().startswith("...")]
    assert len(update) == 1 and float(update[0][4]) > 0
