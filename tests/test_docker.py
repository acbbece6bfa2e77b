"""The GPU Dockerfiles: hadolint-clean, and everything they copy or run exists in the repo."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted((REPO / "docker").glob("Dockerfile.*"))
HADOLINT = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))


def test_both_dockerfiles_exist():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cuda", "Dockerfile.rocm"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(path):
    proc = subprocess.run([HADOLINT, str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_really_lints(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install -y g++\n")  # untagged base, no cleanup
    proc = subprocess.run([HADOLINT, str(bad)], capture_output=True, text=True)
    assert proc.returncode != 0 and "DL3006" in proc.stdout


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_what_a_dockerfile_copies_and_runs_exists(path):
    text = path.read_text()
    for src in re.findall(r"^COPY\s+(\S+)\s+\S+", text, flags=re.M):
        assert (REPO / src).exists(), src
    for script in re.findall(r"python (scripts/\S+\.py)", text):
        assert (REPO / script).is_file(), script
    for config in re.findall(r"--config (configs/\S+\.yaml)", text):
        assert (REPO / config).is_file(), config
    # installed as the README's test command installs (CI adds llama.cpp: the gguf-check extra,
    # and matplotlib: the plot extra), and CI runs the fast set, then the slow set
    assert 'pip install --no-cache-dir -e ".[dev]"' in text
    ci = (REPO / ".ci" / "run").read_text()
    assert 'pip install -e ".[dev,gguf-check,plot]"\n' in ci
    assert 'python -m pytest && python -m pytest -m "slow or smollm2 or gguf_check"\n' in ci


@pytest.mark.slow
def test_prebuild_script_builds_the_cpu_kernels_and_fails_loudly_when_it_cannot():
    script = [sys.executable, str(REPO / "scripts" / "prebuild_kernels.py"), "cpu"]
    ok = subprocess.run(script, capture_output=True, text=True, timeout=900)
    assert ok.returncode == 0 and "cpu: built" in ok.stdout, ok.stderr[-2000:]
    env = {**__import__("os").environ, "SQUASH_KERNELS": "reference"}
    refused = subprocess.run(script, capture_output=True, text=True, env=env, timeout=300)
    assert refused.returncode == 1 and "cpu: NOT built" in refused.stdout
