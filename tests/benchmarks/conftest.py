"""The SmolLM2 checkpoint for the benchmark scripts' smollm2 tests: ``squash download`` run once
into ``$SQUASH_SMOLLM2_DIR`` (default ``~/.cache/squash/smollm2-135m-instruct``, the directory
benchmarks/quality_smollm2.py uses without ``--checkpoint-dir``), kept between sessions."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    default = Path.home() / ".cache" / "squash" / "smollm2-135m-instruct"
    ckpt = Path(os.environ.get("SQUASH_SMOLLM2_DIR", default))
    if not (ckpt / "model.safetensors").is_file():
        subprocess.run([sys.executable, "-m", "squash.cli", "download", "smollm2-135m-instruct",
                        "--output-dir", str(ckpt)], check=True)  # fmt: skip
    return ckpt
