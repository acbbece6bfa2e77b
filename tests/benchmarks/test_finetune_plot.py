"""benchmarks/finetune_plot.py on a results file written here by hand in the format
benchmarks/finetune.py writes: the numbers it reads are the table's, its ratios to the first row
are the ones worked out here, the picture draws those numbers (read back from the figure's
artists), ``finetune.py plot`` and the script's own writer put the JSON and the PNG where they
say, and without matplotlib only the PNG is skipped, with one line saying why."""

import json
import sys

import finetune as ft
import finetune_plot as fp
import pytest

SETUP = ("SmolLM2-135M shapes, 2 of 30 layers, adapters on q, k, v, output, w1, w2, w3; "
         "1 x 32 = 32 tokens a step; AdamW; step = forward + backward + optimizer step, "
         "median of 3 interleaved rounds (min-max in brackets); peak = peak resident memory; "
         "x = ratio to the first row; floor = the step's matmul FLOPs / this host's dense "
         "matmul rate (100.00 GFLOP/s, 32 x 576 x 2304, measured in this process).")
HEAD = ["row", "adapter params", "adapter+grad+AdamW MiB", "x", "peak MiB", "x", "step s", "x",
        "tokens/s", "floor s", "step / floor"]
ROWS = [
    ["torchtune QLoRA r=16", "1,234,567", "20.0", "1.00", "4000", "1.00", "8.00 [7.00-9.00]",
     "1.00", "4", "5", "1.60"],
    ["squash r=143, A+B 90%", "900", "19.5", "0.98", "3000", "0.75", "6.00 [5.00-8.00]", "0.75",
     "5", "4.8", "1.25"],
    ["squash r=143, A+B 90%, mask update", "900", "19.5", "0.98", "3000", "0.75",
     "6.40 [6.00-6.80]", "0.80", "5", "4.8", "1.33"],
    ["... its mask-update step", "", "", "", "3300", "0.83 (1.10 of its normal step)", "12.00",
     "1.50", "3", "", ""],
    ["bound: squash r=143, A+B 90%, adapters off", "900", "19.5", "0.98", "2000", "0.50",
     "4.00 [3.50-4.50]", "0.50", "8", "4.5", "0.89"],
    ["`tune run lora_finetune_single_device` (torchtune QLoRA)", "", "", "",
     "5000 (whole process)", "", "", "", "100 [90-110] (its log)", "", ""],
    ["`tune run squash_finetune` (squash, A+B)", "", "", "", "5000 (whole process)", "", "", "",
     "120 [100-130] (its log) (1.20, 1.10, 1.30 of torchtune's, per round)", "", ""],
]  # fmt: skip


def _table(head, rows):
    return "\n".join("| " + " | ".join(r) + " |" for r in [head, ["---"] * len(head), *rows])


MACHINE = "CPU Test, 2 logical cores, 2 torch threads; torch 2.13; dtype float32; FFI kernels: avx2"
TABLE = f"""# Fine-tuning step: squash vs torchtune QLoRA (2026-01-02)

{MACHINE}
{SETUP}

{_table(HEAD, ROWS)}

Step over the first row's (torchtune QLoRA r=16), round by round:

- squash r=143, A+B 90%: 0.70, 0.80, 0.90
- squash r=143, A+B 90%, mask update: 0.85, 0.75
- bound: squash r=143, A+B 90%, adapters off: 0.50, 0.40, 0.60

System CPU s / minor page faults of each row's step, round by round:

- torchtune QLoRA r=16: 0.50 s / 40k, 1.00 s / 80k, 0.25 s / 20k
- squash r=143, A+B 90%, mask update: 0.10 s / 5k, 0.30 s / 25k (mask update), 0.05 s / 0k
"""
# an older file: no floor columns, no round-by-round lines
OLD = f"""# Fine-tuning step: squash vs torchtune QLoRA (2026-12-01)

CPU Old, 2 logical cores, 2 torch threads; torch 2.13; dtype float32; FFI kernels: avx512
OPT-350M shapes, 4 of 24 layers; 4 x 512 = 2048 tokens a step; median of 3 interleaved rounds

{_table(HEAD[:9], [["torchtune QLoRA r=16", "1,179,648", "18.0", "1.00", "2409", "1.00",
                    "5.00 [4.00-6.00]", "1.00", "409"],
                   ["squash r=144, A+B 90%", "1,046,016", "18.0", "1.00", "2452", "1.02",
                    "4.00 [3.00-4.50]", "0.80", "512"]])}
"""  # fmt: skip


def test_parser_reads_the_tables_numbers():
    r = fp.parse_markdown(TABLE)
    assert (r["date"], r["rounds"], r["tokens_per_step"], r["dense_rate_gflops"]) == \
        ("2026-01-02", 3, 32, 100.0)  # fmt: skip
    assert (r["machine"], r["setup"]) == (MACHINE, SETUP)
    base, both, mask, bound = r["rows"]
    assert base == {"label": "torchtune QLoRA r=16", "adapter_params": 1234567, "adapter_mib": 20.0,
                    "adapter_mib_x": 1.0, "peak_mib": 4000, "peak_mib_x": 1.0, "step_s": 8.0,
                    "step_min": 7.0, "step_max": 9.0, "step_s_x": 1.0, "tokens_per_s": 4,
                    "floor_s": 5, "step_over_floor": 1.6,
                    "host": [{"system_s": 0.5, "faults_k": 40, "mask_update": False},
                             {"system_s": 1.0, "faults_k": 80, "mask_update": False},
                             {"system_s": 0.25, "faults_k": 20, "mask_update": False}]}  # fmt: skip
    assert (both["label"], both["step_s"], both["step_min"], both["step_max"], both["floor_s"]) == \
        ("squash r=143, A+B 90%", 6.0, 5.0, 8.0, 4.8)  # fmt: skip
    assert both["rounds_x"] == [0.7, 0.8, 0.9] and "host" not in both
    assert mask["rounds_x"] == [0.85, 0.75]
    assert [h["mask_update"] for h in mask["host"]] == [False, True, False]
    assert mask["update"] == {"label": "... its mask-update step", "peak_mib": 3300,
                              "peak_mib_x": 0.83, "peak_mib_x_of_normal_step": 1.1, "step_s": 12.0,
                              "step_s_x": 1.5, "tokens_per_s": 3}  # fmt: skip
    assert (bound["step_s"], bound["rounds_x"]) == (4.0, [0.5, 0.4, 0.6])
    tt, sq = r["recipes"]
    assert (tt["peak_mib"], tt["tokens_per_s"], tt["tokens_per_s_min"], tt["tokens_per_s_max"]) \
        == (5000, 100, 90, 110) and "per_round_x" not in tt  # fmt: skip
    assert (sq["tokens_per_s"], sq["per_round_x"]) == (120, [1.2, 1.1, 1.3])


def test_ratios_to_the_first_row_are_worked_out_by_hand():
    got = fp.ratio_to_baseline(fp.parse_markdown(TABLE))
    expected = [  # step / 8.00; per round: median, min, max of the round-by-round line
        ("torchtune QLoRA r=16", 1.0, 1.0, 1.0, 1.0),
        ("squash r=143, A+B 90%", 0.75, 0.8, 0.7, 0.9),
        ("squash r=143, A+B 90%, mask update", 0.8, 0.8, 0.75, 0.85),
        ("bound: squash r=143, A+B 90%, adapters off", 0.5, 0.5, 0.4, 0.6),
    ]
    assert [g[0] for g in got] == [e[0] for e in expected]
    for g, e in zip(got, expected):
        assert g[1:] == pytest.approx(e[1:], abs=1e-12), g
    ((_, x, *per),) = fp.ratio_to_baseline(fp.parse_markdown(OLD))[1:]
    assert x == pytest.approx(0.8) and per == [None, None, None]  # no round-by-round lines


def _drawn(fig):
    """(bar widths, whiskers' (left, right), floor ticks' x, baseline x, texts) of the figure."""
    ax = fig.axes[0]
    (bars,) = [c for c in ax.containers if hasattr(c, "patches")]
    whiskers = [tuple(seg[:, 0]) for seg in bars.errorbar.lines[2][0].get_segments()]
    floor = [list(line.get_xdata()) for line in ax.lines if line.get_gid() == "floor"]
    (base,) = [line.get_xdata()[0] for line in ax.lines if line.get_gid() == "baseline"]
    texts = [t.get_text() for t in ax.texts]
    return [p.get_width() for p in bars.patches], whiskers, floor, base, texts


def test_plot_draws_the_parsed_values(tmp_path):
    pytest.importorskip("matplotlib")
    results = fp.parse_markdown(TABLE)
    fig = fp.plot(results, tmp_path / "step.png")
    assert (tmp_path / "step.png").read_bytes()[:4] == b"\x89PNG"
    widths, whiskers, floor, base, texts = _drawn(fig)
    assert widths == [8.0, 6.0, 6.4, 4.0] and base == 8.0
    assert sum(whiskers, ()) == pytest.approx((7.0, 9.0, 5.0, 8.0, 6.0, 6.8, 3.5, 4.5))
    assert floor == [[5, 4.8, 4.8, 4.5]]
    assert texts == ["1.00x (baseline)", "0.80x [0.70-0.90]", "0.80x [0.75-0.85]",
                     "0.50x [0.40-0.60]"]  # fmt: skip
    widths, _, floor, base, texts = _drawn(fp.plot(fp.parse_markdown(OLD), tmp_path / "old.png"))
    assert (widths, floor, base, texts) == ([5.0, 4.0], [], 5.0, ["1.00x (baseline)", "0.80x"])


def test_finetune_plot_command_redraws_from_markdown_or_json(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    md = tmp_path / "finetune_cpu_fp32_test.md"
    md.write_text(TABLE)
    assert ft.main(["plot", str(md), "--json", str(tmp_path / "n.json")]) == 0
    assert md.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"  # default: beside it
    assert json.loads((tmp_path / "n.json").read_text()) == fp.parse_markdown(TABLE)
    png = tmp_path / "docs" / "step.png"
    assert ft.main(["plot", str(tmp_path / "n.json"), "--png", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert f"written to {png}" in capsys.readouterr().out


def _timed():
    """What ``time_rows`` returns, as much of it as ``write_results`` reads."""
    rounds = [[8.0, 9.0, 7.0], [5.6, 7.2, 6.0], [6.8, None, 6.0], [4.0, 3.5, 4.5]]
    labels = [r["label"] for r in fp.parse_markdown(TABLE)["rows"]]
    return [{"label": label, "rounds": s} for label, s in zip(labels, rounds)]


def test_the_script_writes_json_and_png_beside_its_markdown(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    ft.write_results(tmp_path, "finetune_cpu_fp32_test.md", TABLE, _timed())
    assert (tmp_path / "finetune_cpu_fp32_test.md").read_text() == TABLE
    got = json.loads((tmp_path / "finetune_cpu_fp32_test.json").read_text())
    expected = fp.parse_markdown(TABLE)
    for row, t in zip(expected["rows"], _timed()):
        row["rounds_s"] = t["rounds"]
    assert got == expected
    assert (tmp_path / "finetune_cpu_fp32_test.png").read_bytes()[:4] == b"\x89PNG"
    assert "finetune_cpu_fp32_test.json, finetune_cpu_fp32_test.png" in capsys.readouterr().out


def test_without_matplotlib_only_the_png_is_skipped_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert fp.write_png(fp.parse_markdown(TABLE), tmp_path / "x.png") is None
    assert capsys.readouterr().out == fp.NO_MATPLOTLIB + "\n" and not (tmp_path / "x.png").exists()
    ft.write_results(tmp_path, "finetune_cpu_fp32_test.md", TABLE, _timed())
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ft.finetune_plot.NO_MATPLOTLIB and len(out) == 2, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["finetune_cpu_fp32_test.json",
                                                          "finetune_cpu_fp32_test.md"]  # fmt: skip
    assert ft.main(["plot", str(tmp_path / "finetune_cpu_fp32_test.json")]) == 0
    assert capsys.readouterr().out == fp.NO_MATPLOTLIB + "\n"
