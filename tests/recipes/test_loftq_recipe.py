"""``model.init: loftq`` through ``tune run squash_finetune`` on the tiny OPT: what the run
exports, checked in PEFT and against values computed here by hand."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from squash.export.gguf import load_merged_checkpoint
from squash.merge import load_checkpoint_model
from squash.nf4.quantize import nf4_block_sizes, to_nf4

from tests.helpers import REPO, rehash_checkpoint, tune_run

TINY = REPO / "assets" / "tiny_opt"
QLORA = ["model._component_=squash.models.opt.qlora_opt_tiny", "~model.sparsity",
         "~model.sparse_factor", "~mask_update"]  # fmt: skip


@pytest.mark.slow
def test_qlora_loftq_peft_delta_on_the_original_weights_misses_the_trained_model_by_loftqs_error(
    tmp_path,
):
    """One LoftQ iteration: the run's base is ``Q = NF4(W)`` and its adapter starts at the best
    rank-32 approximation ``s B0 A0`` of ``W - Q``. The PEFT adapter (rank 64: ``B A - B0 A0``),
    merged by PEFT into the original ``W``, then differs from the run's merged weights
    (``Q + s B A``) by ``W - Q - s B0 A0`` whatever was trained: exactly what Eckart-Young
    leaves of ``W - Q`` (its singular values past 32), computed here from ``W`` alone."""
    import transformers
    from peft import PeftModel

    tune_run(tmp_path, *QLORA, "model.init=loftq", "epochs=1", "max_steps_per_epoch=2")
    epoch = tmp_path / "epoch_0"
    config = json.loads((epoch / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (64, 128)
    hf = transformers.OPTForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    peft_merged = PeftModel.from_pretrained(hf, epoch / "adapter").merge_and_unload()
    peft_weights = peft_merged.state_dict()
    merged = load_file(epoch / "model.safetensors")
    original = load_file(TINY / "model.safetensors")
    trained = 0
    for layer in range(2):
        for proj in ("q_proj", "v_proj", "fc1"):
            part = "fc1" if proj == "fc1" else f"self_attn.{proj}"
            key = f"model.decoder.layers.{layer}.{part}.weight"
            w = original[key].float()
            q = to_nf4(w, *nf4_block_sizes(key, tuple(w.shape))).get_original_weight()
            left = torch.linalg.svdvals((w - q).double())[32:].square().sum().sqrt().item()
            gap = (merged[key].double() - peft_weights[key].double()).norm().item()
            assert gap == pytest.approx(left, rel=2e-3, abs=1e-6), key
            assert left < 0.8 * (w - q).norm().item()  # LoftQ's point: less than NF4's error
            trained += int((peft_weights[key] - w).abs().max() > 1e-6)  # B A - B0 A0 != 0
    assert trained  # the adapter moved from its start, and the gap did not move with it


@pytest.mark.slow
def test_a_squash_loftq_adapter_merges_as_the_recipe_merged_it(tmp_path):
    """Two LoftQ iterations on squash's sparse adapters: ``squash export``'s merge recomputes
    LoftQ from the base the run recorded (another process) and lands on the recipe's merged
    weights; the model block's ``init``/``loftq_iterations`` pass the checkpoint's allow-list."""
    tune_run(tmp_path / "run", "model.init=loftq", "model.loftq_iterations=2", "~mask_update",
             "epochs=1", "max_steps_per_epoch=2")  # fmt: skip
    epoch = tmp_path / "run" / "epoch_0"
    twin = tmp_path / "twin" / "epoch_0"
    shutil.copytree(epoch, twin, ignore=shutil.ignore_patterns("model*.safetensors"))
    rehash_checkpoint(twin)
    _, want = load_merged_checkpoint(epoch)
    got = load_checkpoint_model(twin).weights
    original = load_file(TINY / "model.safetensors")
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=0, msg=key)
    key = "model.decoder.layers.0.self_attn.q_proj.weight"
    w = original[key].float()
    nf4_error = (to_nf4(w, *nf4_block_sizes(key, tuple(w.shape))).get_original_weight() - w)
    assert (want[key].float() - w).norm() < nf4_error.norm()
