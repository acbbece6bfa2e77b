"""OPTCheckpointer: refuses mismatched or unsafe checkpoints with errors naming the keys, writes
epoch directories atomically, resumes adapter and recipe state."""

import json
import os
import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file

from squash.models.opt import OPTCheckpointer
from squash.models.opt import _checkpointer as checkpointer_module

import transformers  # noqa: F401


@pytest.fixture
def hf_dir(make_hf, tmp_path):
    make_hf("350m_like").save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer_config.json").write_text("{}")
    return tmp_path / "hf"


def _rewrite(hf_dir, edit):
    state_dict = load_file(hf_dir / "model.safetensors")
    edit(state_dict)
    save_file(state_dict, hf_dir / "model.safetensors")


def _load(hf_dir, tmp_path, files=("model.safetensors",)):
    return OPTCheckpointer(str(hf_dir), list(files), str(tmp_path / "out")).load_checkpoint()


def test_wrong_shape_is_refused_naming_the_key(hf_dir, tmp_path):
    key = "model.decoder.layers.1.fc1.weight"
    _rewrite(hf_dir, lambda sd: sd.update({key: sd[key][:-1].clone()}))
    with pytest.raises(ValueError, match=r"decoder\.layers\.1\.fc1\.weight.*\(63, 32\)"):
        _load(hf_dir, tmp_path)


def test_missing_and_unexpected_keys_are_refused_naming_them(hf_dir, tmp_path):
    def edit(sd):
        del sd["model.decoder.layers.0.self_attn.k_proj.bias"]
        sd["model.decoder.layers.0.self_attn.rotary.weight"] = torch.zeros(2)

    _rewrite(hf_dir, edit)
    with pytest.raises(ValueError, match="k_proj.bias") as error:
        _load(hf_dir, tmp_path)
    assert "rotary.weight" in str(error.value)


def test_config_disagreeing_with_weights_is_refused(hf_dir, tmp_path):
    config = json.loads((hf_dir / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"missing keys \[.*decoder\.layers\.2\."):
        _load(hf_dir, tmp_path)


def test_missing_paths_raise(hf_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="directory"):
        OPTCheckpointer(str(tmp_path / "nope"), ["model.safetensors"], str(tmp_path / "out"))
    with pytest.raises(FileNotFoundError, match="other.safetensors"):
        OPTCheckpointer(str(hf_dir), ["other.safetensors"], str(tmp_path / "out"))
    with pytest.raises(ValueError, match="inside"):
        OPTCheckpointer(str(hf_dir), ["model.safetensors"], str(hf_dir / "out"))
    with pytest.raises(ValueError, match="OPT"):
        OPTCheckpointer(
            str(hf_dir), ["model.safetensors"], str(tmp_path / "out"), model_type="LLAMA3"
        )
    os.remove(hf_dir / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        OPTCheckpointer(str(hf_dir), ["model.safetensors"], str(tmp_path / "out"))


class _Payload:
    """Pickles to a call that would create a file when unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_payload_is_not_executed(hf_dir, tmp_path):
    marker = tmp_path / "executed"
    with open(hf_dir / "pytorch_model.bin", "wb") as f:
        pickle.dump({"decoder.embed_tokens.weight": _Payload(str(marker))}, f)
    with pytest.raises(ValueError, match="weights_only"):
        _load(hf_dir, tmp_path, files=["pytorch_model.bin"])
    assert not marker.exists()


def test_save_is_atomic(hf_dir, tmp_path, monkeypatch):
    checkpointer = OPTCheckpointer(str(hf_dir), ["model.safetensors"], str(tmp_path / "out"))
    state_dict = checkpointer.load_checkpoint()
    checkpointer.save_checkpoint(state_dict, epoch=0)
    epoch_dir = tmp_path / "out" / "epoch_0"
    before = sorted(p.name for p in epoch_dir.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= set(before)

    # A save that fails after writing its first shard leaves the previous epoch_0 untouched
    # and no partial directory behind.
    checkpointer._max_shard_size = 10_000
    real_save_file, calls = checkpointer_module.save_file, []

    def failing_save_file(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise OSError("disk full")
        return real_save_file(*args, **kwargs)

    monkeypatch.setattr(checkpointer_module, "save_file", failing_save_file)
    with pytest.raises(OSError, match="disk full"):
        checkpointer.save_checkpoint(checkpointer.load_checkpoint(), epoch=0)
    assert sorted(p.name for p in epoch_dir.iterdir()) == before
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["epoch_0"]

    # A successful save replaces the directory as a whole.
    monkeypatch.setattr(checkpointer_module, "save_file", real_save_file)
    checkpointer.save_checkpoint(checkpointer.load_checkpoint(), epoch=0)
    assert (epoch_dir / "model.safetensors.index.json").is_file()
    assert not (epoch_dir / "model.safetensors").exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["epoch_0"]


def test_intermediate_checkpoint_resumes(hf_dir, tmp_path):
    out = tmp_path / "out"
    checkpointer = OPTCheckpointer(str(hf_dir), ["model.safetensors"], str(out))
    model_sd = checkpointer.load_checkpoint()["model"]
    key = "layers.0.attn.q_proj.lora_a.weight"
    adapter = {key: torch.randn(4, 32), "layers.0.attn.q_proj.lora_b.weight": torch.randn(32, 4)}
    recipe_state = {
        "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}},
        "seed": 7,
        "epochs_run": 1,
    }
    checkpointer.save_checkpoint(
        {"model": model_sd, "adapter": adapter, **recipe_state},
        epoch=0,
        intermediate_checkpoint=True,
    )
    assert (out / "epoch_0" / "adapter_model.pt").is_file()
    assert (out / "epoch_0" / "adapter_model.safetensors").is_file()

    resumed = OPTCheckpointer(
        str(hf_dir), ["model.safetensors"], str(out), should_load_recipe_state=True
    ).load_checkpoint()
    assert torch.equal(resumed["adapter"][key], adapter[key])
    assert resumed["seed"] == 7 and resumed["epochs_run"] == 1
    assert resumed["optimizer"]["state"][0]["step"] == 3.0
    assert resumed["model"].keys() == model_sd.keys()
    with pytest.raises(ValueError, match="adapter_only"):
        checkpointer.save_checkpoint({"model": model_sd}, epoch=1, adapter_only=True)


def test_saved_config_records_the_weights_dtype(hf_dir, tmp_path):
    checkpointer = OPTCheckpointer(str(hf_dir), ["model.safetensors"], str(tmp_path / "out"))
    state_dict = checkpointer.load_checkpoint()
    state_dict["model"] = {k: v.to(torch.bfloat16) for k, v in state_dict["model"].items()}
    checkpointer.save_checkpoint(state_dict, epoch=1)
    epoch_dir = tmp_path / "out" / "epoch_1"
    config = json.loads((epoch_dir / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    weights = load_file(epoch_dir / "model.safetensors")
    assert weights["model.decoder.embed_tokens.weight"].dtype == torch.bfloat16


def test_instantiated_from_a_torchtune_config(hf_dir, tmp_path):
    """As a recipe builds it: OmegaConf containers for the file list, torchtune's extra flag."""
    from omegaconf import OmegaConf
    from torchtune import config

    cfg = OmegaConf.create(
        {
            "_component_": "squash.models.opt.OPTCheckpointer",
            "checkpoint_dir": str(hf_dir),
            "checkpoint_files": ["model.safetensors"],
            "output_dir": str(tmp_path / "out"),
            "model_type": "OPT",
        }
    )
    checkpointer = config.instantiate(cfg, should_load_recipe_state=False)
    assert "tok_embeddings.weight" in checkpointer.load_checkpoint()["model"]
    cfg.checkpoint_files = ["../hf/model.safetensors"]
    with pytest.raises(ValueError, match="outside"):
        config.instantiate(cfg)


def test_save_refuses_to_replace_the_checkpoint_being_read(hf_dir, tmp_path):
    """Resuming from out/epoch_0 with output_dir=out: saving epoch 0 would replace the very
    directory being read (its weights would change under the reader)."""
    out = tmp_path / "out"
    first = OPTCheckpointer(str(hf_dir), ["model.safetensors"], str(out))
    state_dict = first.load_checkpoint()
    first.save_checkpoint(state_dict, epoch=0)
    before = load_file(out / "epoch_0" / "model.safetensors")
    reader = OPTCheckpointer(str(out / "epoch_0"), ["model.safetensors"], str(out))
    changed = {k: v + 1 for k, v in state_dict["model"].items()}
    with pytest.raises(ValueError, match="would replace.*epoch_0"):
        reader.save_checkpoint({"model": changed}, epoch=0)
    after = load_file(out / "epoch_0" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)
    # The parent of the checkpoint being read is refused too; another epoch is fine.
    nested = tmp_path / "nested"
    OPTCheckpointer(str(hf_dir), ["model.safetensors"], str(nested)).save_checkpoint(
        state_dict, epoch=2)  # fmt: skip
    (nested / "epoch_2" / "inner").mkdir()
    for f in ("config.json", "model.safetensors"):
        (nested / "epoch_2" / "inner" / f).write_bytes((nested / "epoch_2" / f).read_bytes())
    inner = OPTCheckpointer(str(nested / "epoch_2" / "inner"), ["model.safetensors"], str(nested))
    with pytest.raises(ValueError, match="would replace"):
        inner.save_checkpoint(state_dict, epoch=2)
    reader.save_checkpoint({"model": changed}, epoch=1)
    assert torch.equal(load_file(out / "epoch_1" / "model.safetensors")[
        "model.decoder.embed_tokens.weight"], changed["tok_embeddings.weight"])  # fmt: skip


def test_interrupted_saves_are_cleaned_up_and_restored(hf_dir, tmp_path):
    out = tmp_path / "out"
    checkpointer = OPTCheckpointer(str(hf_dir), ["model.safetensors"], str(out))
    state_dict = checkpointer.load_checkpoint()
    checkpointer.save_checkpoint(state_dict, epoch=0)
    checkpointer.save_checkpoint(state_dict, epoch=1)
    saved = sorted(p.name for p in (out / "epoch_1").iterdir())
    # The names squash's one atomic writer (squash.runs.checkpoint.atomic_directory) uses.
    # A save of epoch 2 killed mid-write: a hidden temporary directory with a partial shard.
    (out / ".squash-tmp-epoch_2.k2j4h1x0").mkdir()
    (out / ".squash-tmp-epoch_2.k2j4h1x0" / "model-00001-of-00003.safetensors").write_bytes(b"x")
    # A save of epoch 1 killed between its two renames: epoch_1 moved aside, not replaced.
    os.replace(out / "epoch_1", out / ".squash-tmp-epoch_1.old")
    # One killed after both renames: the set-aside copy of epoch_0 is only garbage.
    os.makedirs(out / ".squash-tmp-epoch_0.old")
    # A recipe-state save killed mid-write.
    os.makedirs(out / ".squash-tmp-recipe_state.abcdefgh")
    (out / ".squash-tmp-recipe_state.abcdefgh" / "recipe_state.pt").write_bytes(b"partial")

    left = sorted(p.name for p in out.iterdir())
    # Creating a checkpointer removes nothing (it may be another process's, beside a live run);
    # its first save cleans up and restores.
    nxt = OPTCheckpointer(str(hf_dir), ["model.safetensors"], str(out))  # the next run starts
    assert sorted(p.name for p in out.iterdir()) == left
    nxt.save_checkpoint(state_dict, epoch=2)
    assert sorted(p.name for p in out.iterdir()) == ["epoch_0", "epoch_1", "epoch_2"]
    assert sorted(p.name for p in (out / "epoch_1").iterdir()) == saved
    # The same on a save by a checkpointer that was created before the interruption.
    (out / ".squash-tmp-epoch_3.abcdefgh").mkdir()
    checkpointer.save_checkpoint(state_dict, epoch=4)
    assert sorted(p.name for p in out.iterdir()) == ["epoch_0", "epoch_1", "epoch_2", "epoch_4"]


def test_file_names_are_judged_by_path_components(hf_dir, tmp_path):
    """``../x.index.json`` is outside checkpoint_dir (refused, as weight files are); a file named
    ``..model.safetensors`` is inside it (accepted)."""
    index = {"weight_map": {"model.decoder.embed_tokens.weight": "model.safetensors"}}
    (tmp_path / "x.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="outside"):
        OPTCheckpointer(str(hf_dir), "../x.index.json", str(tmp_path / "out"))
    expected = _load(hf_dir, tmp_path)["model"]
    os.replace(hf_dir / "model.safetensors", hf_dir / "..model.safetensors")
    loaded = _load(hf_dir, tmp_path, files=["..model.safetensors"])["model"]
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in loaded)


@pytest.mark.parametrize(
    "text, match",
    [
        ("{not json", "JSON"),
        ("[1, 2]", "JSON object expected"),
        ('{"model_type": "opt", "num_hidden_layers": 2}', "lacks 'vocab_size'"),
        (None, "hidden_size"),  # a wrong type: hidden_size given as a string
    ],
)
def test_bad_config_json_errors_name_the_file(hf_dir, tmp_path, text, match):
    path = hf_dir / "config.json"
    if text is None:
        config = json.loads(path.read_text())
        config["hidden_size"] = "thirty-two"
        text = json.dumps(config)
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as error:
        OPTCheckpointer(str(hf_dir), ["model.safetensors"], str(tmp_path / "out"))
    assert str(path) in str(error.value)


def test_index_without_weight_map_names_the_file(hf_dir, tmp_path):
    index = hf_dir / "model.safetensors.index.json"
    for text in ('{"metadata": {}}', '{"weight_map": ["model.safetensors"]}', "{oops"):
        index.write_text(text)
        with pytest.raises(ValueError) as error:
            OPTCheckpointer(str(hf_dir), index.name, str(tmp_path / "out"))
        assert str(index) in str(error.value)
