"""A regular (non-editable) install ships every subpackage, recipe, config, kernel source and the
tiny OPT, the loader finds the kernels there, and a shipped config copied out with ``squash cp``
runs from an empty directory."""

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

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


BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory):
    """The squash wheel built from this checkout, and a directory it is unpacked into (what a
    regular install puts in site-packages)."""
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(REPO)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = out.glob("squash-*.whl")
    target = out / "site"
    zipfile.ZipFile(wheel).extractall(target)
    return wheel, target


@pytest.mark.slow
def test_wheel_ships_every_package_recipe_config_and_kernel_and_loader_finds_them(wheel_site, tmp_path):
    wheel, target = wheel_site
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = _expected_files()
    # the tree has what the wheel must carry: packages below squash/, four recipes, the configs
    assert {"squash/export/adapters.py", "squash/models/opt/__init__.py",
            "squash_finetune.py", "squash/_configs/opt_tiny.yaml",
            "squash/_kernels/ffi_cpu.cpp"} <= expected  # fmt: skip
    assert not expected - names, sorted(expected - names)
    assert not any(n.startswith(("recipes/", "configs/", "kernels/", "tests/")) for n in names)

    # site-packages may hold a `kernels` package of its own (PyPI's, which transformers brings)
    # beside squash: the loader must not take it for squash's sources
    (target / "kernels").mkdir()
    (target / "kernels" / "__init__.py").write_text("")
    probe = (
        "import squash.ops._loader as l, squash_finetune, squash.export.adapters; "
        "print(l.kernels_dir())"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env={"PYTHONPATH": str(target)},
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert Path(run.stdout.strip().splitlines()[-1]) == target / "squash" / "_kernels"


@pytest.mark.slow
def test_wheel_ships_the_tiny_opt_byte_for_byte(wheel_site):
    wheel, _ = wheel_site
    z = zipfile.ZipFile(wheel)
    shipped = {n[len("squash/_assets/"):] for n in z.namelist() if n.startswith("squash/_assets/")}
    tracked = {f"tiny_opt/{p.name}" for p in (REPO / "assets" / "tiny_opt").iterdir()}
    assert shipped == tracked
    for name in tracked:
        assert z.read(f"squash/_assets/{name}") == (REPO / "assets" / name).read_bytes()


def test_shipped_configs_name_no_checkout_relative_path():
    # a value under a key that names a file or directory is absolute or an interpolation
    # (${squash_asset:tiny_opt}/..., ${output_dir}/...), never relative to the working directory
    key = re.compile(r"^\s*(\w*(_dir|_path|_files|_file))\s*:\s*(\S.*?)\s*(#.*)?$")
    checked = 0
    for path in sorted((REPO / "configs").glob("*.yaml")):
        for line in path.read_text().splitlines():
            m = key.match(line)
            if not m or m.group(3) in ("null", "None"):
                continue
            for value in re.split(r"[\[\],\s]+", m.group(3)):
                if "/" in value:
                    checked += 1
                    assert value.startswith(("/", "${")), f"{path.name}: {line.strip()}"
    assert checked > 10
    assert "${squash_asset:tiny_opt}" in (REPO / "configs" / "opt_tiny.yaml").read_text()


@pytest.mark.slow
def test_a_copied_config_runs_from_an_empty_directory_after_a_regular_install(wheel_site, tmp_path):
    _, target = wheel_site
    empty = tmp_path / "empty"
    empty.mkdir()
    # the unpacked wheel comes first on the path, so neither this checkout nor an editable
    # install serves squash, its recipes or its files
    env = {**os.environ, "PYTHONPATH": str(target), "SQUASH_KERNELS": "reference"}
    cp = subprocess.run(
        [sys.executable, "-c", "import sys, squash.cli; sys.exit(squash.cli.main())",
         "cp", "opt_tiny", "my.yaml"],
        cwd=empty, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert cp.returncode == 0, cp.stderr[-3000:]
    out = tmp_path / "out"
    run = subprocess.run(
        [str(BIN / "tune"), "run", "squash_finetune", "--config", "my.yaml", f"output_dir={out}",
         "epochs=1", "max_steps_per_epoch=2", "batch_size=4", "save_adapter_weights_only=True"],
        cwd=empty, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert str(target / "squash" / "_assets" / "tiny_opt") in run.stdout + run.stderr
    assert str(REPO) not in run.stdout + run.stderr
    assert (out / "epoch_0" / "checkpoint.json").is_file()
    assert sorted(p.name for p in empty.iterdir()) == ["my.yaml"]
