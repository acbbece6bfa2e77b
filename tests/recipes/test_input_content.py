"""A run reads the bytes it hashed: a data file edited in place keeping its path, size and mtime
(what ``cp -p``, ``rsync -t`` or ``touch -r`` leave) trains exactly as the same bytes under a new
name, for a fresh run and for a resume that accepts changed inputs; the pre-edit run is the
control that the edit changes the losses at all. The ``datasets`` cache would otherwise serve the
old records (it knows a local file by its path and mtime)."""

import os
import shutil
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.helpers import REPO, TINY_CONFIG, finetune_in_process, logged

sys.path.insert(0, str(REPO / "recipes"))

from squash.config.keys import ConfigKeyError  # noqa: E402
from squash.runs import manifest  # noqa: E402
from squash.training import data  # noqa: E402

DATA = REPO / "assets" / "tiny_opt" / "alpaca_tiny.json"
KEYS = dict(epochs=2, max_steps_per_epoch=1, batch_size=4, log_every_n_steps=1)


def _train(out: Path, data_file: Path, **changes) -> dict:
    """Run configs/opt_tiny.yaml on ``data_file`` in-process; ``{step: loss}`` it logged."""
    cfg = OmegaConf.load(TINY_CONFIG)
    for key, value in {"output_dir": str(out), "dataset.data_files": str(data_file), **KEYS,
                       **changes}.items():  # fmt: skip
        OmegaConf.update(cfg, key, value, force_add=True)
    recipe = finetune_in_process(cfg)
    return logged(out)


def _edit_keeping_size_and_mtime(path: Path) -> bytes:
    """Swap every ``e`` and ``a`` of ``path`` in place (same size), then restore its atime and
    mtime, as ``touch -r`` does; returns the new bytes."""
    st = path.stat()
    new = path.read_bytes().translate(bytes.maketrans(b"ea", b"ae"))
    with open(path, "r+b") as f:
        f.write(new)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    return new


@pytest.mark.slow
def test_a_fresh_run_after_an_in_place_edit_trains_on_the_new_bytes(tmp_path):
    data_file = tmp_path / "data.json"
    shutil.copy(DATA, data_file)
    before = _train(tmp_path / "before", data_file)
    new = _edit_keeping_size_and_mtime(data_file)
    after = _train(tmp_path / "after", data_file)
    fresh = tmp_path / "fresh_copy.json"
    fresh.write_bytes(new)
    reference = _train(tmp_path / "reference", fresh)

    assert sorted(after) == [1, 2]
    assert after == reference  # to the last digit: the same bytes, read under another name
    assert after != before
    recorded = manifest.verify(tmp_path / "after" / "epoch_1")["inputs"]["dataset.data_files"]
    assert recorded["sha256"] == manifest.file_sha256(data_file)


@pytest.mark.slow
def test_a_resume_that_accepts_changed_inputs_trains_on_the_new_bytes(tmp_path):
    data_file = tmp_path / "data.json"
    shutil.copy(DATA, data_file)
    out = tmp_path / "out"
    uninterrupted = _train(out, data_file)
    shutil.rmtree(out / "epoch_1")  # as if killed after epoch_0
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    new = _edit_keeping_size_and_mtime(data_file)
    fresh = tmp_path / "fresh_copy.json"
    fresh.write_bytes(new)

    resumed = _train(out, data_file, resume_from_checkpoint=True, resume_allow_config_change=True)
    reference = _train(copy, fresh, resume_from_checkpoint=True, resume_allow_config_change=True)
    assert resumed[2] == reference[2]
    assert resumed[2] != uninterrupted[2]
    assert resumed[1] == uninterrupted[1]  # step 1 is epoch_0's, trained before the edit


def test_a_file_that_is_not_what_the_run_recorded_is_refused_and_its_cache_removed(tmp_path):
    """The record says other bytes than the file holds (it changed between the run's start and
    the read): refused naming the file, and the cache built from it is not kept."""
    data_file = tmp_path / "data.json"
    shutil.copy(DATA, data_file)
    node = OmegaConf.create({"_component_": "torchtune.datasets.alpaca_dataset", "source": "json",
                             "data_files": str(data_file), "split": "train",
                             "cache_dir": str(tmp_path / "cache")})  # fmt: skip
    recorded = {"dataset.data_files": {"path": str(data_file.resolve()), "sha256": "0" * 64}}
    cache = data.content_cache_dir([data_file.resolve()], ["0" * 64], str(tmp_path / "cache"))
    with pytest.raises(ConfigKeyError) as info:
        data.instantiate_dataset(node, None, recorded)
    assert str(info.value) == (
        f"dataset ({data_file}): {data_file.resolve()} changed while the run read it (sha256 "
        f"{manifest.file_sha256(data_file)[:12]}..., recorded 000000000000...); start the run "
        "again once the file is as it should be"
    )
    assert not cache.exists()
    # with the true hash the records are the file's, and the cache is the content's
    ds = data.instantiate_dataset(node, None, {})
    assert ds._data[0]["output"] == "STATION"
    sha = manifest.file_sha256(data_file)
    assert data.content_cache_dir([data_file.resolve()], [sha], str(tmp_path / "cache")).is_dir()


def test_local_data_files_are_the_files_a_block_reads(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.json").write_text("[]")
    (tmp_path / "d" / "sub").mkdir()
    (tmp_path / "d" / "sub" / "b.json").write_text("[]")
    one = tmp_path / "one.json"
    one.write_text("[]")
    node = {"data_files": {"train": [str(one)], "test": "hf://nope/x.json"},
            "source": str(tmp_path / "d")}  # fmt: skip
    assert data.local_data_files(node) == sorted(
        [one.resolve(), (tmp_path / "d" / "a.json").resolve(), (tmp_path / "d" / "sub" / "b.json").resolve()]
    )
    assert data.local_data_files({"source": "tatsu-lab/alpaca"}) == []
