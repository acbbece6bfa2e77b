"""``squash validate CONFIG``: squash's own key checks, where ``tune validate`` accepts a
misspelled key."""

import subprocess
import sys
from pathlib import Path

import pytest

from squash.cli import main, recipe_for

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "configs").glob("*.yaml")
                                        ))
def test_every_shipped_squash_config_validates(name, capsys):
    path = REPO / "configs" / f"{name}.yaml"
    assert main(["validate", str(path)]) == 0
    assert f"well-formed for {recipe_for(str(path))}" in capsys.readouterr().out


def test_recipe_is_found_from_the_config():
    assert recipe_for(str(REPO / "configs" / "opt_tiny_distill.yaml")) == "squash_distill"
    assert recipe_for(str(REPO / "configs" / "smollm2_135m_eval.yaml")) == "squash_eval"
    assert recipe_for(str(REPO / "configs" / "smollm2_135m.yaml")) == "squash_finetune"


@pytest.mark.parametrize("override, message", [
    ("batch_szie=8", "Unknown config key(s): batch_szie (did you mean 'batch_size'?)"),
    ("mask_update.every_n_step=5", "Unknown config key(s): mask_update.every_n_step (did you mean 'every_n_steps'?)"),
    ("model.lora_rnak=8", "model.lora_rnak: squash.models.opt.squash_opt_tiny takes no argument "
                          "'lora_rnak' (did you mean 'lora_rank'?)"),
    ("heldout.batch_size=2", "heldout needs a dataset block (heldout.dataset)"),
    ("device=gpu", "device must be auto, cpu or cuda (cuda:N; cuda also means ROCm), got 'gpu'"),
    ("dtype=float32", "dtype must be one of auto, bf16, fp32, fp16, fp64, got 'float32'"),
])
def test_a_bad_key_is_one_line_naming_it(override, message, capsys):
    path = str(REPO / "configs" / "opt_tiny.yaml")
    assert main(["validate", path, override]) == 1
    err = capsys.readouterr().err
    assert err == f"squash validate: {path}: config error: {message}\n"


@pytest.mark.parametrize("overrides", [
    ["device=auto", "dtype=auto"], ["device=cpu", "dtype=bf16"], ["device=cuda:1", "dtype=fp32"],
])
def test_device_and_dtype_auto_or_explicit_validate(overrides, capsys):
    assert main(["validate", str(REPO / "configs" / "opt_tiny.yaml"), *overrides]) == 0
    assert "well-formed for squash_finetune" in capsys.readouterr().out


@pytest.mark.slow
def test_tune_validate_accepts_what_squash_validate_rejects(tmp_path):
    cfg = tmp_path / "my.yaml"
    cfg.write_text((REPO / "configs" / "opt_tiny.yaml").read_text().replace("batch_size:", "batch_szie:"))
    tune = subprocess.run([str(BIN / "tune"), "validate", str(cfg)], capture_output=True, text=True)
    assert tune.returncode == 0 and "Config is well-formed!" in tune.stdout
    ours = subprocess.run([str(BIN / "squash"), "validate", str(cfg)], capture_output=True, text=True)
    assert ours.returncode == 1 and ours.stdout == ""
    assert ours.stderr.splitlines() == [
        f"squash validate: {cfg}: config error: Unknown config key(s): batch_szie "
        "(did you mean 'batch_size'?)"
    ]


def test_each_bad_value_the_recipe_refuses_is_refused_with_its_line(tmp_path, capsys):
    """The config-refusal tests' list of bad values (each one line from the recipe, checked
    there), through `squash validate`: the same message."""
    from omegaconf import OmegaConf

    from tests.recipes.test_config_refusals import BAD_VALUES

    for i, (key, value, message) in enumerate(BAD_VALUES):
        cfg = OmegaConf.load(REPO / "configs" / "opt_tiny.yaml")
        OmegaConf.update(cfg, key, value, force_add=True)
        path = tmp_path / f"bad_{i}.yaml"
        OmegaConf.save(cfg, path)
        assert main(["validate", str(path)]) == 1
        assert capsys.readouterr().err == f"squash validate: {path}: config error: {message}\n", key


@pytest.mark.slow
def test_tune_run_and_squash_validate_refuse_each_non_config_with_the_same_line(tmp_path, capsys):
    """The real `tune run` (a process) and `squash validate` (its ``main``, in this process) on
    each config the in-process tests refuse (tests/config/test_refused_configs.py): no
    traceback, and the same message after ``config error:``, naming the file or the key."""
    from omegaconf import OmegaConf

    from tests.config.test_refused_configs import bad_files

    cases = {case: path for case, (path, _) in bad_files(tmp_path).items()}
    for key in ("model", "tokenizer"):
        cfg = OmegaConf.load(REPO / "configs" / "opt_tiny.yaml")
        del cfg[key]
        cases[f"no_{key}"] = tmp_path / f"no_{key}.yaml"
        OmegaConf.save(cfg, cases[f"no_{key}"])
    for case, path in cases.items():
        out = tmp_path / f"out_{case}"
        tune = subprocess.run([str(BIN / "tune"), "run", "squash_finetune", "--config", str(path),
                               f"output_dir={out}"], capture_output=True, text=True, timeout=300)  # fmt: skip
        capsys.readouterr()
        code = main(["validate", str(path)])
        ours = subprocess.CompletedProcess([], code, *capsys.readouterr())
        for proc in (tune, ours):
            assert proc.returncode == 1 and "Traceback" not in proc.stderr, (case, proc.stderr)
        tune_line = [line for line in tune.stderr.splitlines() if line.strip()][-1]
        assert tune_line.startswith("squash_finetune: config error: "), (case, tune.stderr)
        assert ours.stderr.splitlines() == [f"squash validate: {path}: config error: "
                                            + tune_line.split("config error: ", 1)[1]], case  # fmt: skip
        assert str(path) in tune_line or case.startswith("no_"), case
        assert not out.exists(), case
