"""The benchmark scripts run end to end on this machine: the GPU check takes its CPU path when no
GPU is present, and the kernel table's columns agree with each other (no timing is asserted)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from squash.sparsity import fan_in_for

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: gpu_check.sh times it")
@pytest.mark.slow
def test_gpu_check_without_gpu_checks_cpu_path_and_exits_3():
    run = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--no-timing"],
        capture_output=True, text=True, timeout=600, check=False,
        # the script runs `python`: the interpreter running these tests, activated or not
        env=dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"),
    )
    out = run.stdout + run.stderr
    assert run.returncode == 3, out[-3000:]
    assert "no CUDA/ROCm GPU present" in out
    # 4 shapes x 3 dtypes x 2 index dtypes, each compared with the reference and the dense product,
    # and the bad-index check (a ValueError on the CPU as on the GPU: one contract).
    # And the NF4 dequantization, 3 shapes x 3 dtypes, bit for bit against torchao.
    assert len(re.findall(r"^\s+PASS\s", out, re.M)) == 25 + 9, out[-3000:]
    assert len(re.findall(r"^\s+PASS\s+nf4 ", out, re.M)) == 9, out[-3000:]
    assert not re.search(r"^\s+FAIL\s", out, re.M)


@pytest.mark.slow
def test_ffi_kernels_table_is_consistent(tmp_path):
    table = tmp_path / "table.md"
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "ffi_kernels.py"), "--tokens", "16",
         "--in-features", "64", "--out-features", "8", "--sparsity", "0.5", "0.9",
         "--repeats", "3", "--budget", "0.2", "--out", str(table)],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    text, _, phase_text = table.read_text().partition("## FFI time by phase")
    rows = [
        [c.strip().strip("*") for c in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if re.match(r"^\| \d", line)
    ]
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [("64", "8", "16", "50%"), ("64", "8", "16", "90%")]
    for r in rows:
        assert int(r[4]) == fan_in_for(64, int(r[3].rstrip("%")) / 100)
        # Each ratio is dense ms / FFI ms of its own row, up to the rounding of the printed values.
        for dense, ffi, ratio in ((5, 6, 7), (8, 9, 10), (11, 12, 13), (14, 15, 16)):
            (d, ed), (f, ef), (q, eq) = _printed(r[dense]), _printed(r[ffi]), _printed(r[ratio])
            assert (d - ed) / (f + ef) - eq <= q <= (d + ed) / (f - ef) + eq, r
        # The totals are the sums of the three ops.
        for total, parts in ((14, (5, 8, 11)), (15, (6, 9, 12))):
            value, err = _printed(r[total])
            printed = [_printed(r[i]) for i in parts]
            assert abs(value - sum(v for v, _ in printed)) <= err + sum(e for _, e in printed), r


    # The phase table: each op of each sparsity once; the phases' thread time fits in the call's
    # wall time x threads (they never overlap within a thread), and the share column is its sum.
    phases = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in phase_text.splitlines()
        if re.match(r"^\| \d", line)
    ]
    if "FFI backend: native" in text:  # the reference has no phases to time
        assert [(r[3], r[4]) for r in phases] == [
            (s, op) for s in ("50%", "90%") for op in ("fwd", "grad_in", "grad_val")
        ]
        for r in phases:
            shares = [int(c.split("(")[1].rstrip("%)")) for c in r[6:10]]
            assert 0 <= int(r[10].rstrip("%")) <= 101 and all(0 <= v <= 101 for v in shares), r
            assert abs(sum(shares) - int(r[10].rstrip("%"))) <= 3, r


def _printed(text: str) -> tuple[float, float]:
    """A printed number and half a unit of its last digit."""
    decimals = len(text.split(".")[1]) if "." in text else 0
    return float(text), 0.5 * 10.0**-decimals


@pytest.mark.parametrize(
    "script, sibling, other",
    [("quality", "quality_smollm2", "opt_2layer"), ("distill", "distill_smollm2", "opt_tiny")],
)
def test_model_flag_anywhere_hands_the_other_arguments_to_the_smollm2_script(
    monkeypatch, script, sibling, other
):
    """``--model smollm2`` in any position runs the sibling script on exactly the other arguments,
    in their order; an unknown model exits as argparse does, naming the choices."""
    import importlib

    main, sib = importlib.import_module(script).main, importlib.import_module(sibling)
    seen = []
    monkeypatch.setattr(sib, "main", lambda argv: seen.append(list(argv)))
    main(["--quick", "--model", "smollm2", "--seeds", "2"])
    main(["--model=smollm2", "--quick"])
    assert seen == [["--quick", "--seeds", "2"], ["--quick"]]
    with pytest.raises(SystemExit) as e:
        main(["--model", "llama"])
    assert e.value.code == 2
    # the default model's own parser also takes the flag (it shows in --help)
    with pytest.raises(SystemExit) as e:
        main(["--model", other, "--help"])
    assert e.value.code == 0 and seen == [["--quick", "--seeds", "2"], ["--quick"]]
