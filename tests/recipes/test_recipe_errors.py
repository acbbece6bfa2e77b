"""Errors a user can act on: each names the config key or file at fault."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.helpers import REPO, TINY_CONFIG, rehash_checkpoint

sys.path.insert(0, str(REPO / "recipes"))
import squash_finetune  # noqa: E402

from squash.config.keys import ConfigKeyError  # noqa: E402


def _cfg(tmp_path, **changes):
    cfg = OmegaConf.load(TINY_CONFIG)
    cfg.output_dir = str(tmp_path / "out")
    cfg.device, cfg.dtype = "cpu", "fp32"  # as tests.helpers.QUICK: the CPU in fp32 on any host
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def _setup(cfg):
    recipe = squash_finetune.SquashFinetuneRecipeSingleDevice(cfg)
    try:
        recipe.setup(cfg)
    finally:
        recipe.cleanup()


def test_misspelled_top_level_key_is_named_with_the_nearest_valid_one(tmp_path):
    with pytest.raises(ConfigKeyError, match=r"batch_szie \(did you mean 'batch_size'\?\)"):
        squash_finetune.SquashFinetuneRecipeSingleDevice(_cfg(tmp_path, batch_szie=8))


def test_misspelled_mask_update_key_is_named(tmp_path):
    cfg = _cfg(tmp_path)
    cfg.mask_update.every_n_step = 5
    with pytest.raises(ConfigKeyError, match=r"mask_update.every_n_step \(did you mean 'every_n_steps'"):
        squash_finetune.SquashFinetuneRecipeSingleDevice(cfg)


def test_misspelled_builder_argument_is_named_before_anything_is_built(tmp_path):
    cfg = _cfg(tmp_path)
    cfg.model.lora_rnak = 8
    with pytest.raises(ConfigKeyError, match=r"model.lora_rnak: .* \(did you mean 'lora_rank'\?\)"):
        _setup(cfg)


@pytest.mark.parametrize("value", [0, -1, 1.5, "2"])
def test_bad_integer_values_are_named(tmp_path, value):
    with pytest.raises(ConfigKeyError, match="gradient_accumulation_steps must be an integer >= 1"):
        squash_finetune.SquashFinetuneRecipeSingleDevice(
            _cfg(tmp_path, gradient_accumulation_steps=value)
        )


def test_a_checkpoint_dir_without_its_files_is_named(tmp_path):
    empty = tmp_path / "ckpt"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=f"No config.json in checkpoint_dir {empty}"):
        _setup(_cfg(tmp_path, **{"checkpointer.checkpoint_dir": str(empty)}))
    shutil.copy(REPO / "assets" / "tiny_opt" / "config.json", empty / "config.json")
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found: .*model.safetensors"):
        _setup(_cfg(tmp_path, **{"checkpointer.checkpoint_dir": str(empty)}))


def test_a_missing_dataset_column_is_named_with_the_columns_there_are(tmp_path):
    cfg = _cfg(tmp_path)
    cfg.dataset = OmegaConf.create({
        "_component_": "torchtune.datasets.instruct_dataset", "source": "json",
        "data_files": str(REPO / "assets" / "tiny_opt" / "alpaca_tiny.json"), "split": "train",
        "column_map": {"input": "question", "output": "output"},
    })
    with pytest.raises(ConfigKeyError, match=r"no column 'question'.*\['instruction', 'input', 'output'\]"):
        _setup(cfg)


def test_mask_update_on_a_model_without_a_sparse_factor_is_refused(tmp_path):
    cfg = _cfg(tmp_path, **{"model._component_": "squash.models.opt.qlora_opt_tiny"})
    for key in ("sparsity", "sparse_factor"):
        cfg.model.pop(key)
    with pytest.raises(ConfigKeyError, match="mask_update is set but model .*qlora_opt_tiny has no sparse"):
        _setup(cfg)


def test_resume_without_a_checkpoint_says_where_it_looked(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no complete epoch_N or step_N checkpoint"):
        _setup(_cfg(tmp_path, resume_from_checkpoint=True))


def test_a_corrupt_adapter_index_is_refused_on_resume(tmp_path):
    """An unsorted FFI row in the saved adapter: resume refuses it, by its hash and, were the
    hash recorded for it, by the FFI rule; it does not train."""
    from safetensors.torch import load_file, save_file

    cfg = _cfg(tmp_path, epochs=1, max_steps_per_epoch=1, save_adapter_weights_only=True)
    recipe = squash_finetune.SquashFinetuneRecipeSingleDevice(cfg)
    recipe.setup(cfg)
    recipe.train()
    recipe.cleanup()
    path = Path(cfg.output_dir) / "epoch_0" / "squash_adapter.safetensors"
    tensors = load_file(path)
    key = next(k for k in tensors if k.endswith("lora_a.indices"))
    tensors[key][0, :2] = tensors[key][0, :2].flip(0)  # swap two columns of row 0
    save_file(tensors, path)
    cfg.resume_from_checkpoint = True
    with pytest.raises(ValueError, match=f"{path} does not match"):  # checkpoint.json's sha256
        _setup(cfg)
    rehash_checkpoint(path.parent)  # as if the writer had saved the bad row: the FFI check
    with pytest.raises(ValueError, match="increasing"):
        _setup(cfg)


@pytest.mark.slow
def test_every_shipped_config_passes_tune_validate(capsys):
    """The first config through the ``tune validate`` command, every one through its parser and
    subcommand in this process (the same code, without a new interpreter a config)."""
    from torchtune._cli.tune import TuneCLIParser

    tune = str(Path(sys.executable).with_name("tune"))
    configs = sorted((REPO / "configs").glob("*.yaml"))
    assert {p.stem for p in configs} >= {"opt_tiny", "opt350m", "opt350m_qlora", "llama3_2_1b"}
    proc = subprocess.run([tune, "validate", str(configs[0])], capture_output=True, text=True)
    assert proc.returncode == 0 and "Config is well-formed!" in proc.stdout, proc.stderr
    for path in configs:
        cli = TuneCLIParser()
        cli.run(cli._parser.parse_args(["validate", str(path)]))  # exits on an invalid config
        assert capsys.readouterr().out.strip().endswith("Config is well-formed!"), path
        # each config opens with the command that uses it
        assert f"--config configs/{path.name}" in path.read_text().split("\n\n")[0] + path.read_text()[:1500]
