"""``device: auto`` and ``dtype: auto`` through the recipe: the run's first line names what it
picked and why, the adapter trains in that dtype, and the run records the picked values (not
``auto``) for resume and merge. Once through the real ``tune run`` on this host (the expected
line derived from /proc/cpuinfo here), once in-process with native bf16 detected, so the bf16
branch runs on any host."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers import REPO, TINY_CONFIG, logged, tune_run

sys.path.insert(0, str(REPO / "recipes"))
import squash_finetune  # noqa: E402

from squash.config.keys import ConfigKeyError  # noqa: E402
from squash.runs import checkpoint as ckpt  # noqa: E402
from squash.training import placement  # noqa: E402

LINE = re.compile(r"device: (\S+) \(([^)]*)\); dtype: (\S+) \(([^)]*)\)")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ONE_STEP = ["epochs=1", "max_steps_per_epoch=1", "~mask_update", "save_adapter_weights_only=True"]


def _expected_on_this_host():
    """What auto should pick here, read from /proc/cpuinfo without squash's parser."""
    cpuinfo = Path("/proc/cpuinfo")
    if torch.cuda.is_available() or not cpuinfo.is_file():
        pytest.skip("the expected line is derived for a Linux host without a GPU")
    flags = next(
        (ln.split(":", 1)[1].split() for ln in cpuinfo.read_text().splitlines()
         if ln.startswith("flags")), [],
    )  # fmt: skip
    names = [n for f, n in (("avx512_bf16", "AVX512_BF16"), ("amx_bf16", "AMX-BF16")) if f in flags]
    if names:
        return ("cpu", "no GPU visible", "bf16", f"CPU has {', '.join(names)}")
    return ("cpu", "no GPU visible", "fp32", "CPU has no AVX512_BF16 or AMX-BF16")


def test_tune_run_with_auto_names_its_pick_and_trains_in_it(tmp_path):
    expected = _expected_on_this_host()
    # tune_run pins device=cpu dtype=fp32 (tests.helpers.QUICK); these later overrides win
    proc = tune_run(tmp_path, *ONE_STEP, "device=auto", "dtype=auto")
    found = LINE.findall(proc.stdout + proc.stderr)
    assert found == [expected], (proc.stdout + proc.stderr)[-3000:]
    dtype = DTYPES[expected[2]]
    adapter = ckpt.load_squash_adapter(tmp_path / "epoch_0")
    floats = {k: v.dtype for k, v in adapter.items() if v.is_floating_point()}
    assert floats and set(floats.values()) == {dtype}, floats
    assert set(logged(tmp_path)) == {1}  # it trained its one step
    meta = json.loads((tmp_path / "epoch_0" / "checkpoint.json").read_text())
    assert (meta["config"]["device"], meta["config"]["dtype"]) == expected[::2]


def test_native_bf16_detected_the_recipe_trains_in_bf16(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(placement, "gpu_name", lambda: None)
    monkeypatch.setattr(placement, "cpu_bf16_features", lambda: ["AMX-BF16"])
    cfg = OmegaConf.load(TINY_CONFIG)
    assert (cfg.device, cfg.dtype) == ("auto", "auto")  # the shipped config, unchanged
    cfg.output_dir = str(tmp_path / "out")
    cfg.batch_size = 4
    for override in ONE_STEP[:2] + ONE_STEP[3:]:
        key, value = override.split("=")
        OmegaConf.update(cfg, key, int(value) if value.isdigit() else value == "True")
    cfg.pop("mask_update")
    with caplog.at_level("INFO"):
        recipe = squash_finetune.SquashFinetuneRecipeSingleDevice(cfg)
    assert "device: cpu (no GPU visible); dtype: bf16 (CPU has AMX-BF16)" in caplog.text
    assert (cfg.device, cfg.dtype) == ("cpu", "bf16")  # what the run records
    try:
        recipe.setup(cfg)
        trainable = [p for p in recipe._model.parameters() if p.requires_grad]
        assert trainable and {p.dtype for p in trainable} == {torch.bfloat16}
        recipe.train()
    finally:
        recipe.cleanup()
    adapter = ckpt.load_squash_adapter(tmp_path / "out" / "epoch_0")
    assert {v.dtype for v in adapter.values() if v.is_floating_point()} == {torch.bfloat16}
    meta = json.loads((tmp_path / "out" / "epoch_0" / "checkpoint.json").read_text())
    assert (meta["config"]["device"], meta["config"]["dtype"]) == ("cpu", "bf16")

    # the same config resumed where auto picks fp32: refused, the run trained in bf16
    monkeypatch.setattr(placement, "cpu_bf16_features", lambda: [])
    cfg.device, cfg.dtype, cfg.resume_from_checkpoint = "auto", "auto", True
    recipe = squash_finetune.SquashFinetuneRecipeSingleDevice(cfg)
    try:
        with pytest.raises(ConfigKeyError, match=r"differs from the run .* dtype"):
            recipe.setup(cfg)
    finally:
        recipe.cleanup()


@pytest.mark.parametrize("recipe, cls, config", [
    ("squash_distill", "SquashDistillRecipeSingleDevice", "opt_tiny_distill"),
    ("squash_eval", "SquashEvalRecipe", "opt_tiny_eval"),
    ("squash_finetune_distributed", "SquashFinetuneRecipeDistributed", "opt_tiny_distributed"),
    ("squash_eleuther_eval", "EleutherEvalRecipe", "smollm2_eleuther_eval"),
])  # fmt: skip
def test_every_recipe_resolves_auto_and_logs_it_first(recipe, cls, config, tmp_path, monkeypatch,
                                                      caplog):  # fmt: skip
    """Each recipe's constructor (nothing built yet) on its shipped config: the line logged, the
    torch dtype it will build in, the picked values written back into the config."""
    if recipe == "squash_eleuther_eval":
        pytest.importorskip("lm_eval")
    monkeypatch.setattr(placement, "gpu_name", lambda: None)
    monkeypatch.setattr(placement, "cpu_bf16_features", lambda: ["AVX512_BF16"])
    cfg = OmegaConf.load(REPO / "configs" / f"{config}.yaml")
    assert (cfg.device, cfg.dtype) == ("auto", "auto")
    cfg.output_dir = str(tmp_path)
    module = __import__(recipe)
    with caplog.at_level("INFO"):
        built = getattr(module, cls)(cfg)
    line = "device: cpu (no GPU visible); dtype: bf16 (CPU has AVX512_BF16)"
    assert line in caplog.text
    dtype = built.dtype if recipe == "squash_eleuther_eval" else built._dtype
    device = built.device if recipe == "squash_eleuther_eval" else built._device
    assert (device, dtype) == (torch.device("cpu"), torch.bfloat16)
    assert (cfg.device, cfg.dtype) == ("cpu", "bf16")
    if recipe == "squash_distill":  # the tiny config's explicit teacher_dtype: fp32 stays
        assert f"{line}; teacher_dtype: fp32 (set in config)" in caplog.text
        assert built._teacher_dtype == torch.float32
        cfg.teacher_dtype = "auto"  # and device, dtype now as recorded: set in config
        caplog.clear()
        with caplog.at_level("INFO"):
            built = module.SquashDistillRecipeSingleDevice(cfg)
        assert ("device: cpu (set in config); dtype: bf16 (set in config); "
                "teacher_dtype: bf16 (CPU has AVX512_BF16)") in caplog.text
        assert built._teacher_dtype == torch.bfloat16 and cfg.teacher_dtype == "bf16"
