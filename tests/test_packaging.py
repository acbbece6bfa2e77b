"""A regular (non-editable) install ships the kernel sources, and the loader finds them there."""

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_wheel_ships_kernel_sources_and_loader_finds_them(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(REPO)],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = tmp_path.glob("squash-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in (REPO / "kernels").iterdir() if p.suffix in {".cpp", ".h", ".cu", ".cuh"})
    assert sources and {f"squash/_kernels/{name}" for name in sources} <= names

    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    probe = "import squash.ops._loader as l; print(l.kernels_dir())"
    run = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env={"PYTHONPATH": str(target)},
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert Path(run.stdout.strip()) == target / "squash" / "_kernels"
