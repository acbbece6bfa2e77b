"""``squash export`` / ``squash chat`` of an adapter-only checkpoint trained on a corrected base
with ``criterion: sensitivity``: the merge (:func:`squash.merge.load_checkpoint_model`)
calibrates with the run's tokenizer rebuilt from verified files, and gives the merged weights a
run saving them wrote; a checkpoint naming other tokenizer code is refused before anything runs."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import rehash_checkpoint
from tests.recipes.test_base_outliers_recipe import KEYS


@pytest.mark.slow
def test_an_adapter_only_sensitivity_checkpoint_merges_to_the_runs_merged_weights(
    run, tmp_path, monkeypatch
):
    import squash.merge as merge

    run(tmp_path / "merged", *KEYS, "save_adapter_weights_only=False")
    run(tmp_path / "adapter", *KEYS, "save_adapter_weights_only=True")
    saved = load_file(tmp_path / "merged" / "epoch_0" / "model.safetensors")
    epoch = tmp_path / "adapter" / "epoch_0"
    assert not (epoch / "model.safetensors").exists()
    weights = merge.load_checkpoint_model(epoch).weights  # squash export's and chat's merge
    assert weights.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(weights[key], value.float()), key

    # the same checkpoint naming other code as its tokenizer: one line, nothing built or run
    edited = tmp_path / "edited" / "epoch_0"
    shutil.copytree(epoch, edited)
    meta = json.loads((edited / "checkpoint.json").read_text())
    marker = tmp_path / "ran"
    meta["config"]["tokenizer"] = {"_component_": "os.system", "command": f"touch {marker}"}
    (edited / "checkpoint.json").write_text(json.dumps(meta))
    rehash_checkpoint(edited)

    def refuse(*args, **kwargs):
        raise AssertionError("the base was read or the model built")

    monkeypatch.setattr(merge, "base_state_dict", refuse)
    with pytest.raises(ValueError) as e:
        merge.load_checkpoint_model(edited)
    msg = str(e.value)
    assert msg.startswith(f"{edited / 'checkpoint.json'}: tokenizer._component_ 'os.system' is "
                          "not one of squash's tokenizer builders")  # fmt: skip
    assert "\n" not in msg and not marker.exists()
