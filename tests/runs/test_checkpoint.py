"""Checkpoint directories: atomic writes, recovery from interrupted saves, newest-first resume."""

import json
from pathlib import Path

import pytest
import torch

from squash.export import adapters
from squash.export.adapters import Exports
from squash.modules import sparse_lora_linear
from squash.runs import checkpoint as ckpt
from squash.runs import manifest


class _Writer:
    """A checkpointer stand-in with the interface write_checkpoint uses; optionally crashes."""

    def __init__(self, output_dir, crash=False):
        self._output_dir, self.crash = Path(output_dir), crash

    def save_checkpoint(self, state, epoch, intermediate_checkpoint=False, adapter_only=False):
        out = self._output_dir / f"epoch_{epoch}"
        out.mkdir(parents=True)
        (out / "adapter_config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"partial")
        if self.crash:
            raise KeyboardInterrupt  # an interrupt in the middle of the write


def _write(out, name, step, crash=False):
    return ckpt.write_checkpoint(
        out, name, checkpointer=_Writer(out, crash),
        exports=Exports({"x.lora_a.values": torch.ones(2)}, {"r": 1}, {}),
        recipe_state={"global_step": step}, epoch=0, global_step=step, adapter_only=False,
    )


def test_a_write_is_complete_or_absent(tmp_path):
    path = _write(tmp_path, "step_2", 2)
    assert sorted(p.name for p in path.iterdir()) == [
        "adapter", "checkpoint.json", "model.safetensors", "recipe_state.pt",
        "squash_adapter.safetensors", "squash_adapter_config.json",
    ]
    assert (path / "adapter" / "adapter_config.json").is_file()
    with pytest.raises(KeyboardInterrupt):
        _write(tmp_path, "step_4", 4, crash=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2"]  # nothing half-written
    assert ckpt.latest_checkpoint(tmp_path) == path


def test_stale_temporaries_are_removed_and_an_orphaned_old_checkpoint_restored(tmp_path):
    _write(tmp_path, "step_2", 2)
    (tmp_path / ".squash-tmp-step_4.abc").mkdir()  # a save killed mid-write
    # a save killed between moving epoch_0 aside and renaming its replacement into place
    _write(tmp_path, "epoch_0", 3).rename(tmp_path / ".squash-tmp-epoch_0.old")
    done = ckpt.clean_stale_temporaries(tmp_path)
    assert len(done) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch_0", "step_2"]
    assert ckpt.read_meta(tmp_path / "epoch_0")["global_step"] == 3
    assert ckpt.latest_checkpoint(tmp_path).name == "epoch_0"


def test_latest_is_by_global_step_and_ignores_incomplete_directories(tmp_path):
    _write(tmp_path, "step_10", 10)
    _write(tmp_path, "epoch_0", 10)
    _write(tmp_path, "step_9", 9)
    (tmp_path / "step_12").mkdir()  # no checkpoint.json: not complete
    (tmp_path / "step_11").mkdir()
    (tmp_path / "step_11" / "checkpoint.json").write_text("not json")
    assert ckpt.latest_checkpoint(tmp_path).name == "epoch_0"  # ties go to the epoch checkpoint
    assert ckpt.prune_step_checkpoints(tmp_path, 2) == []  # two complete ones: nothing to do
    assert [p.name for p in ckpt.prune_step_checkpoints(tmp_path, 1)] == ["step_9"]
    assert (tmp_path / "step_10").is_dir() and (tmp_path / "step_12").is_dir()
    assert ckpt.prune_step_checkpoints(tmp_path, None) == []


def test_a_damaged_newest_checkpoint_is_refused_not_skipped(tmp_path):
    for name, step in (("step_2", 2), ("step_4", 4)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "checkpoint.json").write_text(json.dumps({"epoch": 0, "global_step": step}))
    assert ckpt.latest_checkpoint(tmp_path, refuse_damaged=True).name == "step_4"
    (tmp_path / "step_4" / "checkpoint.json").write_text('{"epoch": 0, "global_st')  # torn
    with pytest.raises(manifest.CheckpointIntegrityError, match="step_4/checkpoint.json cannot be read"):
        ckpt.latest_checkpoint(tmp_path, refuse_damaged=True)
    (tmp_path / "step_4" / "checkpoint.json").unlink()
    with pytest.raises(manifest.CheckpointIntegrityError, match="step_4/checkpoint.json is missing"):
        ckpt.latest_checkpoint(tmp_path, refuse_damaged=True)


def test_adapter_loading_names_what_does_not_fit():
    module = sparse_lora_linear(64, 32, rank=4, alpha=8, sparsity=0.5, sparse_factor="both")
    model = torch.nn.ModuleDict({"proj": module})
    good = {k: v.clone() for k, v in model.state_dict().items() if ".lora_" in k}
    ckpt.load_adapter_into(model, good, Path("x"))
    with pytest.raises(ValueError, match=r"missing \['proj.lora_b.indices'\]"):
        ckpt.load_adapter_into(model, {k: v for k, v in good.items() if k != "proj.lora_b.indices"}, Path("x"))
    bad_shape = dict(good, **{"proj.lora_a.values": torch.zeros(4, 3)})
    with pytest.raises(ValueError, match=r"proj.lora_a.values: \(4, 3\) in the file"):
        ckpt.load_adapter_into(model, bad_shape, Path("x"))
    out_of_range = dict(good)
    out_of_range["proj.lora_a.indices"] = good["proj.lora_a.indices"].clone()
    out_of_range["proj.lora_a.indices"][0, -1] = 64
    with pytest.raises(ValueError, match="invalid"):
        ckpt.load_adapter_into(model, out_of_range, Path("x"))


def test_merged_state_dict_is_base_plus_scaled_product_of_dense_factors():
    torch.manual_seed(0)
    module = sparse_lora_linear(32, 16, rank=4, alpha=8, sparsity=0.5, sparse_factor="a", use_bias=True)
    with torch.no_grad():
        module.lora_b.weight.normal_()
    model = torch.nn.ModuleDict({"proj": module})
    a_dense = torch.zeros(4, 32).scatter_(1, module.lora_a.indices.long(), module.lora_a.values)
    expected = module.weight + 2.0 * module.lora_b.weight @ a_dense  # alpha / rank = 2
    layout = adapters.adapter_layout(model)
    merged = adapters.merged_weights(model.state_dict(), layout, torch.float32)
    assert sorted(merged) == ["proj.bias", "proj.weight"]
    torch.testing.assert_close(merged["proj.weight"], expected)
    dense = adapters.dense_adapter(model.state_dict(), layout)
    torch.testing.assert_close(dense["proj.lora_a.weight"], a_dense)


def test_adapter_state_is_the_adapter_part_of_the_full_state_dict():
    """What load_adapter_into compares against, read from the adapter submodules only, equals
    the lora_a / lora_b entries of model.state_dict(), also under activation checkpointing (whose
    wrapper's prefix the full state dict drops) and beside torchtune's LoRALinear."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torchtune.modules.peft import LoRALinear

    torch.manual_seed(0)
    layer = torch.nn.ModuleDict({
        "q": sparse_lora_linear(64, 32, rank=4, alpha=8, sparsity=0.5, sparse_factor="both"),
        "v": LoRALinear(64, 16, rank=2, alpha=4),
    })  # fmt: skip
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([checkpoint_wrapper(layer)])})
    full = {k: v for k, v in model.state_dict().items() if ".lora_a." in k or ".lora_b." in k}
    own = adapters.adapter_state(model)
    assert sorted(own) == sorted(full) and len(full) == 6  # q: values+indices x2; v: 2 weights
    assert all(torch.equal(own[k], full[k]) for k in full)
    assert not any("_checkpoint_wrapped_module" in k for k in own)
    ckpt.load_adapter_into(model, {k: v.clone() for k, v in full.items()}, Path("x"))
