"""``output_dir/training.png`` of real ``tune run`` runs of the tiny OPT (finished, killed and
resumed, without matplotlib) and ``squash plot`` redrawing it: the plotted values against what the
run logged (read by tests.helpers.logged) and printed."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from squash.training import plot
from tests.helpers import QUICK, REPO, TINY_CONFIG, TUNE, logged

SQUASH = str(Path(sys.executable).with_name("squash"))
# a held-out block on the tiny OPT's own data: loss and exact match of 4 greedy answers
HELDOUT = [
    "heldout.dataset._component_=torchtune.datasets.alpaca_dataset",
    "heldout.dataset.source=json",
    "heldout.dataset.data_files=${squash_asset:tiny_opt}/alpaca_tiny.json",
    "heldout.dataset.split=train[:8]",
    "heldout.dataset.train_on_input=False",  # answers after a prompt
    "heldout.exact_match_samples=4",
    "heldout.max_new_tokens=3",
]
STEPS = ["epochs=2", "max_steps_per_epoch=4"]


def _squash_plot(output_dir: Path, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([SQUASH, "plot", str(output_dir)], capture_output=True, text=True,
                          timeout=300, env=env)  # fmt: skip


def _lines(output_dir: Path):
    """``{label: {x: y}}`` of the lines in the figure drawn from ``output_dir``'s logs."""
    fig = plot.figure(plot.read_logs(plot.log_dir_of(output_dir)))
    lines = [line for ax in fig.axes for line in ax.get_lines()]
    assert len({line.get_label() for line in lines}) == len(lines)  # one line each
    return {
        line.get_label(): dict(zip(line.get_xdata().tolist(), line.get_ydata().tolist()))
        for line in lines
    }


def _redrawn_equals_the_runs_picture(output_dir: Path, steps: int = 8) -> None:
    drawn = (output_dir / "training.png").read_bytes()
    (output_dir / "training.png").unlink()
    proc = _squash_plot(output_dir)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"Wrote {output_dir / 'training.png'} ({steps} logged steps")
    assert (output_dir / "training.png").read_bytes() == drawn  # the run drew all it logged


@pytest.mark.slow
def test_a_finished_run_draws_what_it_logged_and_printed(run, tmp_path):
    proc = run(tmp_path, *STEPS, *HELDOUT)
    pytest.importorskip("matplotlib")
    lines = _lines(tmp_path)
    assert lines["training loss"] == logged(tmp_path, "loss")
    assert sorted(lines["training loss"]) == list(range(1, 9))
    assert lines["learning rate"] == logged(tmp_path, "lr")
    # held-out: before the first step and after the last, as the run printed them
    before, after = map(float, re.search(
        r"Held-out loss before training: ([\d.]+), after: ([\d.]+)", proc.stdout).groups())  # fmt: skip
    heldout = lines["held-out loss"]
    assert sorted(heldout) == [0, 8]
    assert (round(heldout[0], 4), round(heldout[8], 4)) == (before, after)
    matched, of = map(int, re.search(r"exact match: (\d+)/(\d+)", proc.stdout).groups())
    assert lines["held-out exact match"] == {0: pytest.approx(100.0 * matched / of),
                                             8: pytest.approx(100.0 * matched / of)}  # fmt: skip
    # one bar for both epochs, one for the held-out answers; the run ends naming its outputs
    # (no squash chat: the tiny OPT's tokenizer has no chat template)
    totals = set(re.findall(r"\| *\d+/(\d+) \[[^\]]*step", proc.stderr))  # the training bar's
    assert totals == {"8"} and "| 8/8 [" in proc.stderr
    assert "held-out answers: 100%" in proc.stderr
    assert proc.stdout.rstrip().endswith(f"Checkpoint: {tmp_path}/epoch_1\n"
        f"Picture:    {tmp_path}/training.png\nLogs:       {tmp_path}/logs\nNext:\n"
        f"  squash export {tmp_path}/epoch_1 --format gguf --dtype q8_0 --output-dir {tmp_path}/gguf")  # fmt: skip
    _redrawn_equals_the_runs_picture(tmp_path)


@pytest.mark.slow
def test_a_killed_and_resumed_run_draws_one_continuous_curve(run, tmp_path):
    keys = [*STEPS, "save_every_n_steps=3", "keep_last_n=5"]
    cmd = [TUNE, "run", "squash_finetune", "--config", str(TINY_CONFIG),
           f"output_dir={tmp_path}", *QUICK, *keys]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (tmp_path / "step_3" / "checkpoint.json").exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before step 3"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "epoch_1").exists()  # killed, not finished
    proc = run(tmp_path, *keys, "resume_from_checkpoint=True")
    assert "| 3/8 [" in proc.stderr  # the resumed run's bar starts at its checkpoint's step

    first, second = plot.log_files(tmp_path / "logs")  # one file per start
    killed, resumed = plot.merge_logs([first.read_text()]), plot.merge_logs([second.read_text()])
    assert min(resumed["loss"]) == 4 and max(resumed["loss"]) == 8
    pytest.importorskip("matplotlib")
    lines = _lines(tmp_path)
    expected = {s: killed["loss"][s] for s in (1, 2, 3)} | resumed["loss"]  # the resume wins
    assert lines["training loss"] == expected == logged(tmp_path, "loss")
    assert sorted(lines["learning rate"]) == list(range(1, 9))
    _redrawn_equals_the_runs_picture(tmp_path)


@pytest.mark.slow
def test_squash_distill_draws_its_weighted_loss_and_held_out_evaluations(run, tmp_path):
    proc = run(tmp_path, "epochs=1", "max_steps_per_epoch=3", *HELDOUT, recipe="squash_distill",
               config=REPO / "configs" / "opt_tiny_distill.yaml")  # fmt: skip
    pytest.importorskip("matplotlib")
    lines = _lines(tmp_path)
    assert lines["training loss"] == logged(tmp_path, "loss") and len(lines["training loss"]) == 3
    assert lines["learning rate"] == logged(tmp_path, "lr")
    before, after = map(float, re.search(
        r"Held-out loss before training: ([\d.]+), after: ([\d.]+)", proc.stdout).groups())  # fmt: skip
    heldout = lines["held-out loss"]
    assert [round(heldout[s], 4) for s in sorted(heldout)] == [before, after]
    assert sorted(heldout) == [0, 3]
    _redrawn_equals_the_runs_picture(tmp_path, steps=3)


@pytest.mark.slow
def test_without_matplotlib_the_run_says_how_to_get_the_picture_and_trains(run, tmp_path):
    # a matplotlib that fails to import, first on the path: what a machine without it sees
    shadow = tmp_path / "shadow" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'matplotlib'\")\n")
    path = os.pathsep.join([str(shadow.parent), os.environ.get("PYTHONPATH", "")])
    out = tmp_path / "run"
    proc = run(out, "epochs=1", "max_steps_per_epoch=2", env={"PYTHONPATH": path})
    assert proc.stdout.count(plot.HINT) == 1 and plot.HINT not in proc.stderr
    assert (out / "epoch_0" / "checkpoint.json").is_file()
    assert sorted(logged(out, "loss")) == [1, 2]
    assert not (out / "training.png").exists()
    env = {**os.environ, "PYTHONPATH": path}
    proc = _squash_plot(out, env=env)
    assert proc.returncode == 1 and proc.stderr == f"squash plot: {plot.HINT}\n"
    assert not (out / "training.png").exists()
    assert _squash_plot(out).returncode == 0  # with matplotlib: drawn from the same logs
    assert set(_lines(out)) == {"training loss", "learning rate"}
    assert _lines(out)["training loss"] == logged(out, "loss")
