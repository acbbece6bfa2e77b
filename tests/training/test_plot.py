"""squash.training.plot: reading a run's DiskLogger files (checked against hand-written logs and
what torchtune's DiskLogger itself writes) and the picture drawn from them (its line data)."""

import os
import sys

import pytest

from squash.training import plot

# two starts of one run: the first killed after step 5 (its last line cut short), the second
# resumed from a step-3 checkpoint, evaluating before its first step as a recipe does
FIRST = (
    "Step 0 | heldout_loss:3.5 heldout_exact_match_pct:0.0 \n"
    "Step 1 | loss:2.0 lr:0.0 grad_norm:tensor(0.5) \n"
    "Step 2 | loss:1.5 lr:0.001 \n"
    "Step 3 | loss:1.25 lr:0.002 \n"
    "Step 4 | loss:1.0 lr:0.003 \n"
    "Step 5 | loss:0.75 lr:0.004 \n"
    "Step 6 | loss:0.7"
)
SECOND = (
    "Step 3 | heldout_loss:2.5 heldout_exact_match_pct:25.0 \n"
    "Step 4 | loss:1.125 lr:0.003 \n"
    "Step 5 | loss:0.875 lr:0.004 \n"
    "Step 6 | loss:0.5 lr:0.005 \n"
    "Step 6 | heldout_loss:2.0 heldout_exact_match_pct:62.5 \n"
)


def test_parse_log_reads_each_number_and_skips_a_cut_line_and_non_numbers():
    assert plot.parse_log(FIRST) == [
        (0, {"heldout_loss": 3.5, "heldout_exact_match_pct": 0.0}),
        (1, {"loss": 2.0, "lr": 0.0}),  # grad_norm:tensor(0.5) is no number
        (2, {"loss": 1.5, "lr": 0.001}),
        (3, {"loss": 1.25, "lr": 0.002}),
        (4, {"loss": 1.0, "lr": 0.003}),
        (5, {"loss": 0.75, "lr": 0.004}),
    ]  # "Step 6 | loss:0.7" has no newline: the killed run may have cut 0.7xxx short
    assert plot.parse_log("Writing logs\nStep x | loss:1 \nStep 2 | \n") == []


def test_a_resumed_run_continues_the_killed_one_from_where_it_logs_again():
    series = plot.merge_logs([FIRST, SECOND])
    assert series == {
        "loss": {1: 2.0, 2: 1.5, 3: 1.25, 4: 1.125, 5: 0.875, 6: 0.5},
        "lr": {1: 0.0, 2: 0.001, 3: 0.002, 4: 0.003, 5: 0.004, 6: 0.005},
        "heldout_loss": {0: 3.5, 3: 2.5, 6: 2.0},
        "heldout_exact_match_pct": {0: 0.0, 3: 25.0, 6: 62.5},
    }
    # a later start that logs from step 1 again (a fresh run after one that saved nothing)
    # replaces everything of the earlier one, the held-out point of step 0 included
    again = "Step 0 | heldout_loss:9.0 \nStep 1 | loss:4.0 lr:0.0 \n"
    assert plot.merge_logs([FIRST, again]) == {
        "loss": {1: 4.0}, "lr": {1: 0.0}, "heldout_loss": {0: 9.0},
        "heldout_exact_match_pct": {0: 0.0},
    }  # fmt: skip


def test_log_files_are_read_in_the_order_the_run_started_them(tmp_path):
    # log_99 started before log_100 (unix seconds), though it sorts after it as text
    (tmp_path / "log_100.txt").write_text(SECOND)
    (tmp_path / "log_99.txt").write_text(FIRST)
    (tmp_path / "notes.md").write_text("Step 1 | loss:100.0 \n")  # not a log file
    assert [p.name for p in plot.log_files(tmp_path)] == ["log_99.txt", "log_100.txt"]
    assert plot.read_logs(tmp_path) == plot.merge_logs([FIRST, SECOND])


def test_disk_loggers_own_lines_are_read_back_exactly(tmp_path):
    from torchtune.training.metric_logging import DiskLogger

    logger = DiskLogger(log_dir=str(tmp_path), filename="log_1.txt")
    logged = {1: {"loss": 6.929374679158111, "lr": 0.0}, 2: {"loss": 6.9268, "lr": 2e-3},
              3: {"mask_update/replaced_per_row": 3.5, "loss": 1e-7, "lr": -1.5e-05}}  # fmt: skip
    for step, payload in logged.items():
        logger.log_dict(payload, step=step)
    logger.log("loss", 0.25, step=4)
    logger.close()
    series = plot.read_logs(tmp_path)
    assert series["loss"] == {1: 6.929374679158111, 2: 6.9268, 3: 1e-7, 4: 0.25}
    assert series["lr"] == {1: 0.0, 2: 2e-3, 3: -1.5e-05}
    assert series["mask_update/replaced_per_row"] == {3: 3.5}


def test_log_dir_of_follows_the_config_copy_and_falls_back_to_logs(tmp_path):
    assert plot.log_dir_of(tmp_path) == tmp_path / "logs"
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "torchtune_config.yaml").write_text(
        "output_dir: /where/it/ran\nmetric_logger:\n"
        "  _component_: torchtune.training.metric_logging.DiskLogger\n"
        "  log_dir: ${output_dir}/elsewhere\n"
    )
    assert plot.log_dir_of(tmp_path) == tmp_path / "elsewhere"
    (tmp_path / "torchtune_config.yaml").write_text("metric_logger:\n  log_dir: ${oops:x}\n")
    assert plot.log_dir_of(tmp_path) == tmp_path / "logs"


def _lines(fig):
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
            for ax in fig.axes for line in ax.get_lines()}  # fmt: skip


def test_the_picture_plots_the_logged_values():
    pytest.importorskip("matplotlib")
    series = plot.merge_logs([FIRST, SECOND])
    assert _lines(plot.figure(series)) == {
        "training loss": ([1, 2, 3, 4, 5, 6], [2.0, 1.5, 1.25, 1.125, 0.875, 0.5]),
        "held-out loss": ([0, 3, 6], [3.5, 2.5, 2.0]),
        "held-out exact match": ([0, 3, 6], [0.0, 25.0, 62.5]),
        "learning rate": ([1, 2, 3, 4, 5, 6], [0.0, 0.001, 0.002, 0.003, 0.004, 0.005]),
    }
    fig = plot.figure({"loss": {1: 2.0}, "lr": {1: 0.1}})  # no held-out block: two panels
    assert len(fig.axes) == 2 and set(_lines(fig)) == {"training loss", "learning rate"}


def test_write_picture_replaces_the_png_atomically(tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "logs").mkdir()
    with pytest.raises(ValueError, match="no logged steps"):
        plot.write_picture(tmp_path)
    (tmp_path / "logs" / "log_1.txt").write_text(FIRST)
    stale = tmp_path / ".training.png.999999999-abc"  # a killed draw's (no such process)
    stale.write_bytes(b"half")
    path = plot.write_picture(tmp_path)
    assert path == tmp_path / "training.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs", "training.png"]
    first = path.read_bytes()
    assert plot.write_picture(tmp_path).read_bytes() == first  # the same logs, the same bytes


def test_training_plot_logs_each_evaluation_and_draws(tmp_path):
    pytest.importorskip("matplotlib")
    from torchtune.training.metric_logging import DiskLogger

    logger = DiskLogger(log_dir=str(tmp_path / "logs"))
    picture = plot.TrainingPlot(tmp_path, logger)
    picture.draw()  # nothing logged yet: nothing drawn
    assert not (tmp_path / "training.png").exists()
    picture.evaluated({"loss": 3.25, "tokens": 40.0, "answer": "x"}, step=0)
    logger.log_dict({"loss": 2.5, "lr": 0.01}, step=1)
    picture.evaluated({"loss": 2.75, "exact_match": 3, "exact_match_of": 8, "answer": "y"}, 1)
    logger.close()
    text = logger.path_to_log_file().read_text()
    assert text.splitlines() == [
        "Step 0 | heldout_loss:3.25 ",
        "Step 1 | loss:2.5 lr:0.01 ",
        "Step 1 | heldout_loss:2.75 heldout_exact_match_pct:37.5 ",
    ]
    drawn = (tmp_path / "training.png").read_bytes()  # the last draw showed every line logged
    assert plot.write_picture(tmp_path).read_bytes() == drawn
    os.replace(tmp_path / "training.png", tmp_path / "drawn.png")
    picture.draw()  # nothing logged since the last draw: not redrawn
    assert not (tmp_path / "training.png").exists()


def test_without_matplotlib_a_run_is_told_once_and_draws_nothing(tmp_path, monkeypatch, capsys):
    from torchtune.training.metric_logging import DiskLogger

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    logger = DiskLogger(log_dir=str(tmp_path / "logs"))
    capsys.readouterr()
    picture = plot.TrainingPlot(tmp_path, logger)
    picture.evaluated({"loss": 3.25}, step=0)
    logger.log_dict({"loss": 2.5, "lr": 0.01}, step=1)
    picture.draw()
    picture.draw()
    logger.close()
    out, err = capsys.readouterr()
    assert out.splitlines() == [plot.HINT] and err == ""
    assert 'pip install "squash[plot]"' in plot.HINT
    assert not (tmp_path / "training.png").exists()
    assert plot.read_logs(tmp_path / "logs") == {  # the run logs as before
        "heldout_loss": {0: 3.25}, "loss": {1: 2.5}, "lr": {1: 0.01}
    }


def test_a_picture_that_fails_to_draw_is_a_warning(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from torchtune.training.metric_logging import DiskLogger

    logger = DiskLogger(log_dir=str(tmp_path / "logs"))
    picture = plot.TrainingPlot(tmp_path / "gone", logger)  # output_dir removed under the run
    logger.log_dict({"loss": 2.5}, step=1)
    picture.draw()
    logger.close()
    assert capsys.readouterr().err.startswith("training.png: not drawn: ")


def test_squash_plot_names_what_is_missing_and_draws_from_the_logs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from squash.cli import main

    assert main(["plot", str(tmp_path / "nowhere")]) == 1
    assert capsys.readouterr().err == f"squash plot: no such directory: {tmp_path / 'nowhere'}\n"
    assert main(["plot", str(tmp_path)]) == 1
    assert capsys.readouterr().err == (
        f"squash plot: no logged steps in {tmp_path / 'logs'} (the run's DiskLogger files)\n"
    )
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "log_1.txt").write_text(FIRST)
    (tmp_path / "logs" / "log_2.txt").write_text(SECOND)
    assert main(["plot", str(tmp_path)]) == 0
    assert capsys.readouterr().out == (
        f"Wrote {tmp_path / 'training.png'} (6 logged steps, 3 held-out evaluations, from "
        f"{tmp_path / 'logs'})\n"
    )
    assert (tmp_path / "training.png").read_bytes()[:4] == b"\x89PNG"
