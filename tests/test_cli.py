"""The squash command: `squash ls` lists, `squash cp` copies what the package ships."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SQUASH = str(Path(sys.executable).with_name("squash"))


def _squash(*args, cwd=None):
    return subprocess.run([SQUASH, *args], capture_output=True, text=True, cwd=cwd)


def test_ls_lists_the_recipe_and_every_shipped_config():
    out = _squash("ls").stdout
    rows = [line.split() for line in out.splitlines()]
    assert ["squash_finetune_distributed", "opt_tiny_distributed"] in rows
    assert "squash_finetune" in out
    for path in (REPO / "configs").glob("*.yaml"):
        assert path.stem in out


@pytest.mark.slow
def test_cp_copies_recipes_and_configs_byte_for_byte(tmp_path):
    assert _squash("cp", "squash_finetune", str(tmp_path / "mine.py")).returncode == 0
    assert (tmp_path / "mine.py").read_bytes() == (REPO / "recipes" / "squash_finetune.py").read_bytes()
    assert _squash("cp", "opt350m", str(tmp_path)).returncode == 0
    assert (tmp_path / "opt350m.yaml").read_bytes() == (REPO / "configs" / "opt350m.yaml").read_bytes()


@pytest.mark.slow
def test_cp_refuses_to_overwrite_unknown_names_and_wrong_suffixes(tmp_path):
    (tmp_path / "x.yaml").write_text("mine")
    proc = _squash("cp", "opt_tiny", str(tmp_path / "x.yaml"))
    assert proc.returncode == 1 and "exists" in proc.stderr
    assert (tmp_path / "x.yaml").read_text() == "mine"
    assert _squash("cp", "opt_tiny", str(tmp_path / "x.yaml"), "--force").returncode == 0
    proc = _squash("cp", "opt_tni", str(tmp_path))
    assert proc.returncode == 1 and "unknown recipe or config 'opt_tni'" in proc.stderr
    proc = _squash("cp", "opt_tiny", str(tmp_path / "x.py"))
    assert proc.returncode == 1 and "to a .yaml file" in proc.stderr


@pytest.mark.slow
def test_a_regular_install_ships_the_recipe_module_and_the_configs(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(REPO)],
        capture_output=True, text=True, timeout=600,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = tmp_path.glob("squash-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"squash_finetune.py", "squash_finetune_distributed.py"} <= names
    assert {"squash_eleuther_eval.py", "squash/export/gguf.py", "squash/chat.py",
            "squash/eval_tasks/squash_facts.yaml", "squash/eval_tasks/squash_facts.jsonl",
            "squash/eval_tasks/utils.py"} <= names  # fmt: skip
    assert not any(n.startswith(("recipes/", "configs/")) for n in names)
    configs = {f"squash/_configs/{p.name}" for p in (REPO / "configs").glob("*.yaml")}
    assert configs and configs <= names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = ("import squash_finetune, squash.cli as c; print(squash_finetune.__file__); "
             "print(c.config_dir())")
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                         text=True, env={"PYTHONPATH": str(site)}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    recipe, configs_dir = run.stdout.strip().splitlines()[-2:]
    assert Path(recipe) == site / "squash_finetune.py"
    assert Path(configs_dir) == site / "squash" / "_configs"
