"""``model.base_outliers`` in a real ``tune run squash_finetune`` on the tiny OPT: the run
calibrates with its own tokenizer, trains on the corrected base, and its merged weights are
``dequant(NF4) + S + B A`` of the model rebuilt from the base (S is not in the checkpoint)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import PINNED, REPO, assembled_from_checkpoint, logged

KEYS = ["epochs=1", "max_steps_per_epoch=2", "~mask_update",
        "model.base_outliers.fraction=0.02", "model.base_outliers.criterion=sensitivity",
        "model.base_outliers.calibration.samples=4",
        "model.base_outliers.calibration.max_seq_len=64"]  # fmt: skip


@pytest.mark.slow
def test_a_run_on_a_corrected_base_writes_merged_weights_with_its_outliers(run, tmp_path):
    from squash.nf4.base_outliers import module_outliers
    from squash.runs import checkpoint as ckpt

    proc = run(tmp_path, *KEYS)
    assert "NF4 + FFI outliers" in proc.stdout + proc.stderr
    losses = logged(tmp_path)
    # the base changed a little: not plain NF4's loss, near it
    assert losses[1] != PINNED[1] and losses[1] == pytest.approx(PINNED[1], rel=1e-2)
    epoch = tmp_path / "epoch_0"
    block = json.loads((epoch / "squash_adapter_config.json").read_text())["model"]
    assert block["base_outliers"]["criterion"] == "sensitivity"
    assert not any("outlier" in k for k in load_file(epoch / ckpt.SQUASH_ADAPTER_FILE))

    model = assembled_from_checkpoint(epoch, tmp_path / "reload")
    q = model.layers[0].attn.q_proj
    assert module_outliers(q) is not None
    merged = load_file(epoch / "model.safetensors")
    torch.testing.assert_close(merged["model.decoder.layers.0.self_attn.q_proj.weight"],
                               q.merged_weight(torch.float32), rtol=0, atol=1e-6)  # fmt: skip


@pytest.mark.slow
def test_an_adapter_only_checkpoint_merges_into_the_rebuilt_corrected_base(run, tmp_path):
    from squash.merge import load_checkpoint_model

    keys = [k.replace("=sensitivity", "=magnitude") for k in KEYS]
    run(tmp_path, *keys, "save_adapter_weights_only=True")
    epoch = tmp_path / "epoch_0"
    weights = load_checkpoint_model(epoch).weights  # squash export's and squash chat's merge
    model = assembled_from_checkpoint(epoch, tmp_path / "reload")
    want = model.layers[1].mlp.w2.merged_weight(torch.float32)  # fc2: dequant + S + B A
    torch.testing.assert_close(weights["model.decoder.layers.1.fc2.weight"], want, rtol=0,
                               atol=1e-6)  # fmt: skip


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_uninterrupted_losses_and_adapter(run, tmp_path):
    import os
    import signal
    import subprocess
    import time

    from tests.helpers import QUICK, TINY_CONFIG, TUNE

    keys = ["epochs=2", "max_steps_per_epoch=3", "save_every_n_steps=2", "keep_last_n=5",
            "model.base_outliers.fraction=0.02", "model.base_outliers.criterion=magnitude",
            "mask_update.every_n_steps=2", "mask_update.until_step=6"]  # fmt: skip
    run(tmp_path / "whole", *keys)
    whole = logged(tmp_path / "whole")
    assert sorted(whole) == list(range(1, 7))

    out = tmp_path / "killed"
    cmd = [TUNE, "run", "squash_finetune", "--config", str(TINY_CONFIG), f"output_dir={out}",
           *QUICK, *keys]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (out / "step_2" / "checkpoint.json").exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before step 2"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "epoch_1").exists()  # killed, not finished
    run(out, *keys, "resume_from_checkpoint=True")
    last = max((out / "logs").glob("log_*.txt"), key=os.path.getmtime)
    steps = [int(line.split()[1]) for line in last.read_text().splitlines()
             if line.startswith("Step ")]  # fmt: skip
    assert steps and min(steps) >= 3 and max(steps) == 6  # what the resumed run trained
    assert logged(out) == whole  # every step's loss, exactly

    for name in ("squash_adapter.safetensors", "model.safetensors"):  # adapter; dequant + S + BA
        a, b = (load_file(d / "epoch_1" / name) for d in (tmp_path / "whole", out))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
