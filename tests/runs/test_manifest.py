"""checkpoint.json records each file's sha256 and size and the counters; a changed byte, a
missing or extra file, an edited checkpoint.json or disagreeing counters are refused by name."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from squash.export.adapters import Exports
from squash.runs import checkpoint as ckpt
from squash.runs import manifest
from squash.runs.run_lock import RunLock

from tests.helpers import StubCheckpointer

REPO = Path(__file__).resolve().parents[2]


COUNTERS = {"epochs_run": 0, "global_step": 3, "steps_in_epoch": 3, "seed": 7, "total_epochs": 2,
            "max_steps_per_epoch": None}


def _write(out, name="step_3"):
    return ckpt.write_checkpoint(
        out, name, checkpointer=StubCheckpointer(out),
        exports=Exports({"x.lora_a.values": torch.ones(4)}, {"r": 1}, {}),
        recipe_state={**COUNTERS, "optimizer": {"state": {}}}, epoch=0, global_step=3,
        adapter_only=False,
    )


def test_checkpoint_json_records_every_file_hash_size_counters_and_the_runs_config(tmp_path):
    lock = RunLock(tmp_path, {"batch_size": 4})
    path = _write(tmp_path)
    lock.release()
    meta = json.loads((path / "checkpoint.json").read_text())
    files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert sorted(meta["files"]) == [f for f in files if f != "checkpoint.json"]
    for rel, entry in meta["files"].items():  # hashlib over the bytes on disk
        data = (path / rel).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    assert meta["counters"] == COUNTERS and meta["global_step"] == 3
    assert meta["config"] == {"batch_size": 4}
    assert manifest.verify(path)["files"] == meta["files"]


def _flip(path, offset=None):
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_any_file_is_refused_naming_it(tmp_path):
    good = _write(tmp_path / "good")
    names = sorted(p.relative_to(good).as_posix() for p in good.rglob("*") if p.is_file())
    assert len(names) == 6
    for rel in names:
        bad = tmp_path / "bad" / rel.replace("/", "_")
        shutil.copytree(good, bad)
        _flip(bad / rel)
        with pytest.raises(manifest.CheckpointIntegrityError, match=str(bad / rel)):
            manifest.verify(bad)


def test_missing_extra_and_resized_files_are_refused(tmp_path):
    path = _write(tmp_path)
    (path / "notes.txt").write_text("x")
    with pytest.raises(manifest.CheckpointIntegrityError, match="notes.txt is not recorded"):
        manifest.verify(path)
    (path / "notes.txt").unlink()
    with open(path / "model.safetensors", "ab") as f:
        f.write(b"\0")
    with pytest.raises(manifest.CheckpointIntegrityError, match="model.safetensors has 1025 bytes.*records 1024"):
        manifest.verify(path)
    (path / "model.safetensors").unlink()
    with pytest.raises(manifest.CheckpointIntegrityError, match="model.safetensors is recorded .* but missing"):
        manifest.verify(path)


def test_an_edited_checkpoint_json_is_refused(tmp_path):
    path = _write(tmp_path)
    meta = json.loads((path / "checkpoint.json").read_text())
    meta["global_step"] = 12
    (path / "checkpoint.json").write_text(json.dumps(meta))
    with pytest.raises(manifest.CheckpointIntegrityError, match="checkpoint.json was changed"):
        manifest.verify(path)
    (path / "checkpoint.json").write_text(json.dumps({"epoch": 0, "global_step": 3}))
    with pytest.raises(manifest.CheckpointIntegrityError, match="records no file hashes"):
        manifest.verify(path)


def test_recipe_state_counters_must_agree_with_checkpoint_json(tmp_path):
    path = _write(tmp_path)
    meta = manifest.verify(path)
    state = ckpt.load_recipe_state(path)
    manifest.check_counters(path, meta, state)
    with pytest.raises(manifest.CheckpointIntegrityError,
                       match=r"recipe_state.pt has global_step=5 but .*checkpoint.json records 3"):
        manifest.check_counters(path, meta, {**state, "global_step": 5})


_FULL_DISK = """
import resource, signal, sys, torch
sys.path.insert(0, sys.argv[2])
from tests.helpers import StubCheckpointer
from squash.export.adapters import Exports
from squash.runs import checkpoint as ckpt
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
try:
    ckpt.write_checkpoint(sys.argv[1], "step_1", checkpointer=StubCheckpointer(sys.argv[1]),
        exports=Exports({"a.lora_a.values": torch.ones(10)}, {}, {}),
        recipe_state={"big": torch.ones(100_000)}, epoch=0, global_step=1, adapter_only=False)
except OSError as e:
    print("OSError:", e)
"""


@pytest.mark.slow
def test_a_failed_write_names_the_checkpoint_and_the_directory(tmp_path):
    """A write past the file-size limit (EFBIG, as a full disk gives ENOSPC) inside torch.save."""
    proc = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path), str(REPO)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert f"OSError: Cannot write checkpoint step_1 into output_dir {tmp_path} (" in proc.stdout, proc.stderr
    assert "MiB free there" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing half-written is left
