"""A regular (non-editable) install ships every subpackage, recipe, config and kernel source,
and the loader finds the kernels there."""

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KERNEL_SUFFIXES = {".cpp", ".h", ".cu", ".cuh"}


def _expected_files():
    """What the tree says a wheel must hold: every module of every squash package (a directory
    with an ``__init__.py``), every recipe as a top-level module, every config, every kernel."""
    expected = {
        str(p.relative_to(REPO))
        for init in (REPO / "squash").rglob("__init__.py")
        for p in init.parent.glob("*.py")
    }
    expected |= {p.name for p in (REPO / "recipes").glob("*.py")}
    expected |= {f"squash/_configs/{p.name}" for p in (REPO / "configs").glob("*.yaml")}
    expected |= {
        f"squash/_kernels/{p.name}"
        for p in (REPO / "kernels").iterdir()
        if p.suffix in KERNEL_SUFFIXES
    }
    return expected


def test_wheel_ships_every_package_recipe_config_and_kernel_and_loader_finds_them(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), str(REPO)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = tmp_path.glob("squash-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = _expected_files()
    # the tree has what the wheel must carry: packages below squash/, four recipes, the configs
    assert {"squash/training/exports.py", "squash/models/opt/__init__.py",
            "squash_finetune.py", "squash/_configs/opt_tiny.yaml",
            "squash/_kernels/ffi_cpu.cpp"} <= expected  # fmt: skip
    assert not expected - names, sorted(expected - names)
    assert not any(n.startswith(("recipes/", "configs/", "kernels/", "tests/")) for n in names)

    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    probe = (
        "import squash.ops._loader as l, squash_finetune, squash.training.exports; "
        "print(l.kernels_dir())"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env={"PYTHONPATH": str(target)},
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert Path(run.stdout.strip().splitlines()[-1]) == target / "squash" / "_kernels"
