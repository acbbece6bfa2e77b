"""benchmarks/main_job.py: what it reads from a run's output and the table it prints, against
hand-computed values."""

import json

import pytest

import main_job

OUTPUT = """Held-out loss before training: 0.7764, after: 0.0048 (-99.4%)
  expected answer:        2091-12-01
  answer before training: December 1, 2091
  answer after training:  2091-12-01
  exact match: 47/50 held-out samples (before: 1)
"""


def test_parse_output_reads_the_printed_numbers():
    assert main_job.parse_output(OUTPUT) == {
        "loss_before": 0.7764, "loss_after": 0.0048, "exact_before": 1, "exact_after": 47,
        "of": 50, "answer_after": "2091-12-01",
    }  # fmt: skip
    with pytest.raises(ValueError, match="no exact"):
        main_job.parse_output(OUTPUT.replace("exact match", "match"))


def test_report_is_the_mean_and_sample_std_over_seeds(tmp_path):
    for seed, (after, loss, wall) in zip((1, 2, 3), ((40, 0.01, 100.0), (45, 0.02, 110.0),
                                                     (50, 0.03, 120.0))):  # fmt: skip
        run = {"arm": "squash", "config": "configs/smollm2_135m.yaml", "seed": seed,
               "exact_before": 0, "exact_after": after, "of": 50, "loss_before": 0.7,
               "loss_after": loss, "wall_s": wall}  # fmt: skip
        (tmp_path / f"squash_s{seed}.json").write_text(json.dumps(run))
    table = main_job.report(tmp_path)
    # after: 80%, 90%, 100% -> mean 90, sample std 10; loss 0.02 +/- 0.01; wall 110 +/- 10
    row = table.splitlines()[2]
    assert row == ("| `configs/smollm2_135m.yaml` | 1, 2, 3 | 0% +/- 0 (0, 0, 0 of 50) | "
                   "90% +/- 10 (40, 45, 50 of 50) | 0.7000 +/- 0.0000 | 0.0200 +/- 0.0100 | "
                   "110 +/- 10 |")  # fmt: skip
    assert len(table.splitlines()) == 3  # no QLoRA runs, no QLoRA row, no comparison


def test_report_compares_squash_with_qlora_by_welch(tmp_path):
    from scipy import stats

    hits = {"squash": [50, 50, 49], "qlora": [47, 48, 49]}
    for arm, values in hits.items():
        for seed, h in enumerate(values):
            run = {"arm": arm, "config": arm, "seed": seed, "exact_before": 0, "exact_after": h,
                   "of": 50, "loss_before": 0.7, "loss_after": 0.01 * (seed + 1) + (arm == "qlora") * 0.005,
                   "wall_s": 1.0}  # fmt: skip
            (tmp_path / f"{arm}_s{seed}.json").write_text(json.dumps(run))
    last = main_job.report(tmp_path).splitlines()[-1]
    ref = stats.ttest_ind(hits["squash"], hits["qlora"], equal_var=False)
    assert f"exact match after t = {ref.statistic:+.2f}, p = {ref.pvalue:.2g}" in last
    ref = stats.ttest_ind([0.01, 0.02, 0.03], [0.015, 0.025, 0.035], equal_var=False)
    assert f"loss after t = {ref.statistic:+.2f}, p = {ref.pvalue:.2g}" in last
