"""Bad values are named where they are given, not at the first step or deep inside a library."""

import json
import re

import pytest
import torch
from omegaconf import OmegaConf

from squash.config.keys import ConfigKeyError, check_component
from squash.config.values import check_values
from squash.training.data import NamedRecordErrors


@pytest.mark.parametrize("key, value, message", [
    ("seed", "abc", "seed must be an integer >= 0, got 'abc'"),
    ("clip_grad_norm", "abc", "clip_grad_norm must be a number > 0 or null, got 'abc'"),
    ("clip_grad_norm", 0, "clip_grad_norm must be a number > 0 or null, got 0"),
    ("tokenizer.max_seq_len", 0, "tokenizer.max_seq_len must be an integer >= 1, got 0"),
])
def test_bad_run_values_are_named(key, value, message):
    cfg = OmegaConf.create({"tokenizer": {"max_seq_len": 8}})
    OmegaConf.update(cfg, key, value, force_add=True)
    with pytest.raises(ConfigKeyError, match=f"^{message}"):
        check_values(cfg)


def test_a_gpu_device_without_a_gpu_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigKeyError, match=r"device: cuda, but this machine has no usable GPU"):
        check_values(OmegaConf.create({"device": "cuda"}))
    check_values(OmegaConf.create({"device": "cpu"}))


@pytest.mark.parametrize("key, value, message", [
    ("device", "gpu", "device must be auto, cpu or cuda (cuda:N; cuda also means ROCm), got 'gpu'"),
    ("device", "cuda:x", "device must be auto, cpu or cuda (cuda:N; cuda also means ROCm), got 'cuda:x'"),
    ("device", 0, "device must be auto, cpu or cuda (cuda:N; cuda also means ROCm), got 0"),
    ("dtype", "bfloat16", "dtype must be one of auto, bf16, fp32, fp16, fp64, got 'bfloat16'"),
    ("teacher_dtype", "half", "teacher_dtype must be one of auto, bf16, fp32, fp16, fp64, got 'half'"),
])  # fmt: skip
def test_unknown_devices_and_dtypes_are_named(key, value, message):
    with pytest.raises(ConfigKeyError, match=f"^{re.escape(message)}$"):
        check_values(OmegaConf.create({key: value}))


def test_auto_and_the_known_values_pass():
    for device in ("auto", "cpu", None):
        for dtype in ("auto", "bf16", "fp32", None):
            check_values(OmegaConf.create({"device": device, "dtype": dtype, "teacher_dtype": dtype}))


def test_empty_and_missing_local_data_files_are_named(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text("")
    cfg = OmegaConf.create({"dataset": {"source": "json", "data_files": str(empty)}})
    with pytest.raises(ConfigKeyError, match=f"dataset.data_files: {empty} is empty"):
        check_values(cfg)
    cfg = OmegaConf.create({"dataset": [{"source": "json", "data_files": [str(tmp_path / "no.json")]}]})
    with pytest.raises(ConfigKeyError, match=r"dataset\[0\].data_files: .*no.json does not exist"):
        check_values(cfg)


def test_a_string_where_a_component_takes_a_number_is_named():
    node = OmegaConf.create({"_component_": "torch.optim.AdamW", "lr": "abc"})
    with pytest.raises(ConfigKeyError, match="optimizer.lr must be a number .*got 'abc'"):
        check_component(node, "optimizer", positional=1)
    node.lr = 1e-3
    check_component(node, "optimizer", positional=1)
    tok = OmegaConf.create({"_component_": "squash.models.opt.opt_tokenizer", "vocab_path": "v",
                            "merges_path": "m", "max_seq_len": "long"})
    with pytest.raises(ConfigKeyError, match="tokenizer.max_seq_len must be a number"):
        check_component(tok, "tokenizer")


def test_a_record_with_a_null_field_is_named(tmp_path):
    from squash.models.opt import opt_tokenizer
    from torchtune.datasets import alpaca_dataset

    from tests.helpers import REPO

    records = json.loads((REPO / "assets/tiny_opt/alpaca_tiny.json").read_text())[:3]
    records[2]["output"] = None
    path = tmp_path / "d.json"
    path.write_text(json.dumps(records))
    tok = opt_tokenizer(str(REPO / "assets/tiny_opt/vocab.json"), str(REPO / "assets/tiny_opt/merges.txt"))
    ds = NamedRecordErrors(alpaca_dataset(tok, source="json", data_files=str(path), split="train"),
                           f"dataset ({path})")
    assert ds[1]["tokens"] == alpaca_dataset(tok, source="json", data_files=str(path), split="train")[1]["tokens"]
    with pytest.raises(ValueError, match=rf"dataset \({path}\): record 2 cannot be used: it has null \['output'\]"):
        ds[2]
