"""What a user sees when a run fails early: one line for a config error, no empty log file,
and none of the third-party notices squash cannot act on."""

import pytest

from tests.helpers import REPO


def _stderr_lines(proc):
    return [line for line in proc.stderr.splitlines() if line.strip()]


@pytest.mark.parametrize("recipe, config", [
    ("squash_finetune", REPO / "configs" / "opt_tiny.yaml"),
    pytest.param("squash_eval", REPO / "configs" / "opt_tiny_eval.yaml", marks=pytest.mark.slow),
])
def test_a_misspelled_key_is_one_line_and_exit_status_1(run, tmp_path, recipe, config):
    proc = run(tmp_path / "out", "batch_szie=8", recipe=recipe, config=config, check=False)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    last = _stderr_lines(proc)[-1]
    assert last.startswith(f"{recipe}: config error: Unknown config key(s): ")
    assert last.endswith("batch_szie (did you mean 'batch_size'?)")


@pytest.mark.slow
def test_an_unknown_asset_is_one_line(run, tmp_path):
    proc = run(tmp_path / "out", "checkpointer.checkpoint_dir=${squash_asset:tiny_opx}", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    last = _stderr_lines(proc)[-1]
    assert last.startswith("squash_finetune: config error: ") and "'tiny_opx'" in last
    assert "\n" not in last and "'tiny_opt'" in last  # names the asset there is


@pytest.mark.slow
def test_a_run_that_fails_in_setup_leaves_no_empty_log_file(run, tmp_path):
    out = tmp_path / "out"
    proc = run(out, "checkpointer.checkpoint_files=[missing.safetensors]", check=False)
    assert proc.returncode != 0 and "missing.safetensors" in proc.stderr
    # the logger is made last in set-up: no log file, no config copy, no output_dir left
    assert "Writing logs to" not in proc.stdout
    assert not out.exists()


@pytest.mark.slow
def test_a_run_that_logged_keeps_its_log_and_prints_no_set_vital_warning(run, tmp_path):
    out = tmp_path / "out"
    proc = run(out, "epochs=1", "max_steps_per_epoch=1", "save_adapter_weights_only=True")
    (log,) = out.glob("logs/log_*.txt")
    assert log.read_text().startswith("Step 1 | ")
    assert "set_vital" not in proc.stderr
