"""output_dir: refused where it overlaps an input; owned by one live run through its lock."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from squash.config.keys import ConfigKeyError
from squash.runs import run_lock

REPO = Path(__file__).resolve().parents[2]


def _cfg(tmp_path, out, **changes):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    cfg = OmegaConf.create({
        "output_dir": str(out),
        "checkpointer": {"checkpoint_dir": str(model), "output_dir": "${output_dir}"},
        "tokenizer": {"vocab_path": str(tmp_path / "tok" / "vocab.json"), "max_seq_len": 8},
        "dataset": {"source": "json", "data_files": str(tmp_path / "data" / "d.json")},
    })
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


@pytest.mark.parametrize("out, how, key", [
    ("model", "is", "checkpointer.checkpoint_dir"),
    ("model/run", "lies inside", "checkpointer.checkpoint_dir"),
    (".", "contains", "checkpointer.checkpoint_dir"),
    ("tok", "contains", "tokenizer.vocab_path"),
    ("data", "contains", "dataset.data_files"),
])
def test_an_output_dir_overlapping_an_input_is_refused_naming_both(tmp_path, out, how, key):
    with pytest.raises(ConfigKeyError, match=f"output_dir .* {how} {key} "):
        run_lock.check_output_dir(_cfg(tmp_path, tmp_path / out))


def test_a_symlink_does_not_hide_an_overlap_and_a_sibling_is_accepted(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "model")
    with pytest.raises(ConfigKeyError, match="is checkpointer.checkpoint_dir"):
        run_lock.check_output_dir(_cfg(tmp_path, tmp_path / "link"))
    assert run_lock.check_output_dir(_cfg(tmp_path, tmp_path / "out")) == (tmp_path / "out").resolve()


def test_a_teacher_and_an_adapter_dir_count_as_inputs(tmp_path):
    cfg = _cfg(tmp_path, tmp_path / "t" / "out", **{"teacher_checkpointer.checkpoint_dir": str(tmp_path / "t")})
    with pytest.raises(ConfigKeyError, match="lies inside teacher_checkpointer.checkpoint_dir"):
        run_lock.check_output_dir(cfg)
    cfg = _cfg(tmp_path, tmp_path / "run", adapter_dir=str(tmp_path / "run" / "epoch_0"))
    with pytest.raises(ConfigKeyError, match="contains adapter_dir"):
        run_lock.check_output_dir(cfg)


_HOLD = """
import sys, time
from squash.runs.run_lock import RunLock
lock = RunLock(sys.argv[1], {"seed": 1})
print("locked", flush=True)
time.sleep(600)
"""


def _holder(out):
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(out)], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "locked"
    return proc


@pytest.mark.slow
def test_a_live_runs_lock_refuses_a_second_run_naming_the_first(tmp_path):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(RuntimeError, match=f"in use by another run \\(pid {proc.pid} on host "
                                               f"{socket.gethostname()}"):
            run_lock.RunLock(tmp_path)
        assert json.loads((tmp_path / run_lock.LOCK_FILE).read_text())["pid"] == proc.pid
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_deleting_the_lock_file_does_not_let_a_second_run_in(tmp_path):
    """The lock is held on the directory too: with the first run's lock file deleted, a second
    run is still refused, and leaves no lock file of its own behind."""
    proc = _holder(tmp_path)
    try:
        (tmp_path / run_lock.LOCK_FILE).unlink()
        with pytest.raises(RuntimeError, match=f"output_dir {tmp_path} is in use by another run "
                                               r"\(its lock file .squash-run.lock was deleted"):
            run_lock.RunLock(tmp_path)
        assert not (tmp_path / run_lock.LOCK_FILE).exists()
    finally:
        proc.kill()
        proc.wait()
    lock = run_lock.RunLock(tmp_path)  # the first run gone, the directory is free
    lock.release()


@pytest.mark.slow
def test_a_killed_runs_lock_is_taken_over_with_a_warning(tmp_path, caplog):
    proc = _holder(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (tmp_path / run_lock.LOCK_FILE).exists()  # left behind by the killed run
    with caplog.at_level(logging.WARNING, logger="squash.runs.run_lock"):
        lock = run_lock.RunLock(tmp_path, {"seed": 2})
    assert f"taking over the lock of an earlier run (pid {proc.pid}" in caplog.text
    assert "no longer running" in caplog.text
    record = run_lock.read_lock(tmp_path)
    assert record["pid"] == os.getpid() and record["config"] == {"seed": 2}
    assert abs(record["started"] - time.time()) < 60
    lock.release()
    assert not (tmp_path / run_lock.LOCK_FILE).exists()
    run_lock.RunLock(tmp_path).release()  # released: the next run takes it without a word


def test_an_output_dir_that_cannot_be_created_names_it(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError, match=f"output_dir {tmp_path / 'file' / 'out'} cannot be created"):
        run_lock.RunLock(tmp_path / "file" / "out")


# ---- ownership: the path must still be the directory locked ---------------------------------------
def _tree(path):
    return {p.relative_to(path).as_posix(): p.read_bytes() if p.is_file() else None
            for p in sorted(Path(path).rglob("*"))}  # fmt: skip


@pytest.mark.parametrize("what", ["deleted", "renamed", "replaced"])
def test_a_lock_whose_directory_is_gone_refuses_writes_and_leaves_the_path_alone(tmp_path, what):
    out = tmp_path / "out"
    lock = run_lock.RunLock(out)
    run_lock.check_owned(out)
    run_lock.check_owned(out / "epoch_0")  # inside it: ours too
    moved = tmp_path / "moved"
    if what == "renamed":
        out.rename(moved)
    else:
        os.remove(out / run_lock.LOCK_FILE)
        out.rmdir()
    if what in ("renamed", "replaced"):  # another run's directory at the path now
        out.mkdir()
        (out / run_lock.LOCK_FILE).write_text(json.dumps({"pid": 4242, "host": "h", "command": "B"}))
        (out / "epoch_0").mkdir()
    before = _tree(out) if out.exists() else None
    was = {"deleted": "it was deleted and nothing is at that path",
           "renamed": f"it is now {moved} and another directory is at that path (locked by "
                      "pid 4242 on host h, started ?: B)",
           "replaced": "it was deleted and another directory is at that path (locked by pid 4242 "
                       "on host h, started ?: B)"}[what]  # fmt: skip
    for path in (out, out / "epoch_0"):
        with pytest.raises(run_lock.OutputDirLostError) as info:
            run_lock.check_owned(path)
        assert str(info.value) == (f"output_dir {out} is no longer the directory this run locked "
                                   f"({was}); the run stops without writing there")  # fmt: skip
    run_lock.check_owned(tmp_path / "elsewhere")  # a path no lock covers
    lock.release()
    assert (_tree(out) if out.exists() else None) == before  # its lock file and dirs untouched
    if what == "renamed":
        assert sorted(p.name for p in moved.iterdir()) == []  # the lock file went with it, removed
    run_lock.check_owned(out)  # released: nothing to check
