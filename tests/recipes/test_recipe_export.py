"""The recipe's ``export`` block: checked before training, and run on each finished epoch."""

import sys

import pytest
from omegaconf import OmegaConf

from tests.helpers import REPO, TINY_CONFIG, finetune_in_process

sys.path.insert(0, str(REPO / "recipes"))
import squash_finetune  # noqa: E402

from squash.export import UnsupportedModelError, parse_export_config  # noqa: E402
from squash.runs import checkpoint as ckpt  # noqa: E402


def _cfg(tmp_path, **changes):
    cfg = OmegaConf.load(TINY_CONFIG)
    cfg.output_dir = str(tmp_path / "out")
    cfg.device, cfg.dtype = "cpu", "fp32"  # as tests.helpers.QUICK: the CPU in fp32 on any host
    cfg.checkpointer.checkpoint_dir = str(REPO / "assets" / "tiny_opt")
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def test_bad_export_blocks_fail_before_training(tmp_path):
    with pytest.raises(ValueError, match=r"export.gguf: unknown dtype\(s\) \['q4'\]"):
        squash_finetune.SquashFinetuneRecipeSingleDevice(_cfg(tmp_path, export={"gguf": ["q4"]}))
    # the tiny config's model is OPT: refused at start, not after training
    with pytest.raises(UnsupportedModelError, match="export: .*OPTForCausalLM"):
        squash_finetune.SquashFinetuneRecipeSingleDevice(_cfg(tmp_path, export={"gguf": ["f16"]}))


@pytest.mark.slow
def test_each_epoch_checkpoint_is_exported_once_complete(tmp_path, monkeypatch):
    calls = []

    def record(path, formats):
        calls.append((path.name, (path / ckpt.CHECKPOINT_META_FILE).is_file(), formats))
        return []

    # OPT cannot be exported: check the wiring with the family check and the writer replaced
    monkeypatch.setattr(squash_finetune, "parse_export_config", lambda b, _=None: parse_export_config(b))
    monkeypatch.setattr(squash_finetune, "export_checkpoint", record)
    # adapter-only checkpoints (the shipped configs' default) are exported too: merged into the
    # recorded base (squash.merge, tested in tests/export/test_merge.py)
    cfg = _cfg(tmp_path, export={"gguf": ["f16", "q8_0"]}, epochs=2, max_steps_per_epoch=1,
               batch_size=2, save_every_n_steps=1, save_adapter_weights_only=True)  # fmt: skip
    recipe = squash_finetune.SquashFinetuneRecipeSingleDevice(cfg)
    recipe.setup(cfg)
    try:
        recipe.train()
    finally:
        recipe.cleanup()
    # step_N checkpoints are not exported; each epoch_N is, after it is complete
    assert calls == [("epoch_0", True, {"gguf": ["f16", "q8_0"]}),
                     ("epoch_1", True, {"gguf": ["f16", "q8_0"]})]  # fmt: skip


def test_a_resume_redoes_the_export_a_killed_run_never_finished(tmp_path, monkeypatch):
    """Killed during epoch_0's export (epoch_0 complete, no GGUF): the resume exports epoch_0
    before it trains on, then epoch_1; a resume whose files are there exports nothing again."""
    from squash.merge import export_path

    calls = []

    def kill_during_export(path, formats):
        calls.append((path.name, formats))
        raise KeyboardInterrupt  # as a SIGKILL: nothing written past the checkpoint

    def export(path, formats):
        calls.append((path.name, formats))
        written = [export_path(path, d) for d in formats["gguf"]]
        for f in written:
            f.parent.mkdir(exist_ok=True)
            f.write_bytes(b"GGUF")
        return written

    monkeypatch.setattr(squash_finetune, "parse_export_config", lambda b, _=None: parse_export_config(b))
    keys = dict(export={"gguf": ["f16", "q8_0"]}, epochs=2, max_steps_per_epoch=1, batch_size=2)

    def run(export_fn, **changes):
        monkeypatch.setattr(squash_finetune, "export_checkpoint", export_fn)
        cfg = _cfg(tmp_path, **keys, **changes)
        recipe = finetune_in_process(cfg)

    with pytest.raises(KeyboardInterrupt):
        run(kill_during_export)
    out = tmp_path / "out"
    assert calls == [("epoch_0", {"gguf": ["f16", "q8_0"]})] and not (out / "gguf").exists()
    assert sorted(p.name for p in out.glob("epoch_*")) == ["epoch_0"]
    calls.clear()
    run(export, resume_from_checkpoint=True)
    assert calls == [("epoch_0", {"gguf": ["f16", "q8_0"]}), ("epoch_1", {"gguf": ["f16", "q8_0"]})]
    assert sorted(p.name for p in (out / "gguf").iterdir()) == [
        "epoch_0-f16.gguf", "epoch_0-q8_0.gguf", "epoch_1-f16.gguf", "epoch_1-q8_0.gguf"
    ]
    # one file of epoch_1's export missing: only that one is redone
    (out / "gguf" / "epoch_1-q8_0.gguf").unlink()
    calls.clear()
    run(export, resume_from_checkpoint=True)
    assert calls == [("epoch_1", {"gguf": ["q8_0"]})]
