"""A run writes only where it still owns: run A is stopped after its first step (as SIGSTOP would
stop it; here, inside its first log call), its output_dir is deleted, renamed, or deleted and
taken by run B (another seed) that runs to the end; A then continues, and must stop at its first
save, with one line naming the directory, writing nothing: B's files stay byte-identical and a
deleted directory is not made again."""

import shutil
import sys

import pytest
from omegaconf import OmegaConf

from tests.helpers import REPO, TINY_CONFIG, tree

sys.path.insert(0, str(REPO / "recipes"))
import squash_finetune  # noqa: E402

from squash.runs.entry import config_errors_in_one_line  # noqa: E402

Recipe = squash_finetune.SquashFinetuneRecipeSingleDevice


def _cfg(out, seed):
    cfg = OmegaConf.load(TINY_CONFIG)
    for key, value in {"output_dir": str(out), "batch_size": 4, "epochs": 2,
                       "max_steps_per_epoch": 1, "seed": seed}.items():  # fmt: skip
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def _run(cfg):
    recipe = Recipe(cfg)
    try:
        recipe.setup(cfg)
        recipe.train()
    finally:
        recipe.cleanup()


@pytest.mark.slow
@pytest.mark.parametrize("what", ["deleted", "renamed", "replaced"])
def test_a_stopped_run_whose_output_dir_changed_writes_nothing(tmp_path, capsys, what):
    out, moved = tmp_path / "out", tmp_path / "moved"
    cfg = _cfg(out, seed=1)
    a = Recipe(cfg)
    a.setup(cfg)
    after_b = {}
    log_dict = a._metric_logger.log_dict

    def first_step_then_stopped(*args, **kwargs):  # step 1 is logged before epoch_0 is saved
        log_dict(*args, **kwargs)
        if after_b:
            return
        if what == "renamed":
            out.rename(moved)
        else:
            shutil.rmtree(out)
        if what != "deleted":
            _run(_cfg(out, seed=2))  # B, to its end: epoch_0 and epoch_1
        after_b["tree"] = tree(out)

    a._metric_logger.log_dict = first_step_then_stopped
    with pytest.raises(SystemExit) as info:
        with config_errors_in_one_line("squash_finetune"):
            try:
                a.train()
            finally:
                a.cleanup()
    assert info.value.code == 1
    was = {"deleted": "it was deleted and nothing is at that path",
           "renamed": f"it is now {moved} and another directory is at that path",
           "replaced": "it was deleted and another directory is at that path"}[what]  # fmt: skip
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == (  # a line of its own, after the closed progress bars
        f"squash_finetune: error: output_dir {out} is no longer the directory this run locked "
        f"({was}); the run stops without writing there"
    )
    assert tree(out) == after_b["tree"]  # B's files byte-identical (absent when deleted)
    if what != "deleted":
        assert {"epoch_0", "epoch_1"} <= set(after_b["tree"])
    if what == "renamed":  # A's own directory, wherever it is: no checkpoint, no lock left
        assert not [p for p in moved.iterdir() if p.name.startswith(("epoch_", ".squash"))]
