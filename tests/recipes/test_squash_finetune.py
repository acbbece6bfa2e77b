"""The squash_finetune recipe, run for real through ``tune run`` on the tiny OPT in assets/."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import PINNED, REPO, logged

TINY = REPO / "assets" / "tiny_opt"


def _first_batch_loss_by_hand(tmp_path) -> float:
    """Cross-entropy of the first 4 samples (shuffle off) under the dense QLoRA model of the tiny
    OPT: at step 1 the adapter adds nothing (B = 0), so this is the base's loss."""
    from torchtune.data import padded_collate_sft
    from torchtune.datasets import alpaca_dataset

    from squash.models.opt import OPTCheckpointer, opt_tokenizer, qlora_opt_tiny

    tok = opt_tokenizer(str(TINY / "vocab.json"), str(TINY / "merges.txt"), max_seq_len=128)
    ds = alpaca_dataset(tok, source="json", data_files=str(TINY / "alpaca_tiny.json"),
                        split="train")
    batch = padded_collate_sft([ds[i] for i in range(4)], padding_idx=tok.pad_id)
    model = qlora_opt_tiny(["q_proj", "k_proj", "v_proj", "output_proj"], True, lora_rank=8)
    sd = OPTCheckpointer(str(TINY), ["model.safetensors"], str(tmp_path / "hand"))
    model.load_state_dict(sd.load_checkpoint()["model"], strict=False)
    with torch.no_grad():
        logits = model(batch["tokens"]).float()  # (b, s, v)
    labels = batch["labels"][:, 1:]
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
    ).item()


def test_first_step_loss_equals_the_base_models_loss_computed_by_hand(run, tmp_path):
    run(tmp_path, "shuffle=False", "epochs=1", "max_steps_per_epoch=1", "~mask_update",
        "save_adapter_weights_only=True")
    loss = logged(tmp_path)[1]
    assert loss == pytest.approx(_first_batch_loss_by_hand(tmp_path), rel=1e-5)


@pytest.mark.slow
def test_sparse_adapter_lowers_the_loss_against_the_same_run_with_the_adapter_off(run, tmp_path):
    steps = ["epochs=1", "max_steps_per_epoch=12"]
    run(tmp_path / "trained", *steps)
    # lr must be > 0 (0 is refused as a config error): at 1e-30, B stays ~1e-30 and the
    # adapter adds nothing an fp32 activation can hold
    run(tmp_path / "off", *steps, "optimizer.lr=1e-30")
    trained, off = logged(tmp_path / "trained"), logged(tmp_path / "off")
    assert sorted(trained) == sorted(off) == list(range(1, 13))
    for step in (1, 2):  # no update has reached the model yet (warm-up starts at lr 0)
        assert trained[step] == pytest.approx(off[step], rel=1e-6)
    late = range(9, 13)  # the same batches in both runs (same seed)
    gain = sum(off[s] - trained[s] for s in late) / len(late)
    assert gain > 0.05, (trained, off)
    for step, value in PINNED.items():
        assert trained[step] == pytest.approx(value, rel=1e-5), (step, trained)
    # the mask update of step 10 (every 10 steps, until 40, drop 0.3 cosine-decayed) replaced
    # round(drop * k) entries of each row: k = 13 for the 128-wide inputs, 26 for fc2's 256
    drop = 0.3 / 2 * (1 + math.cos(math.pi * 10 / 40))
    per_layer = [round(drop * 13)] * 5 + [round(drop * 26)]
    assert logged(tmp_path / "trained", "mask_update/replaced_per_row") == pytest.approx(
        {10: sum(per_layer) / len(per_layer)}
    )


@pytest.mark.slow
def test_resume_after_sigkill_reproduces_the_uninterrupted_losses(run, tmp_path):
    import os
    import signal
    import subprocess
    import time

    from tests.helpers import QUICK, TINY_CONFIG, TUNE

    keys = ["epochs=2", "max_steps_per_epoch=4", "save_every_n_steps=3", "keep_last_n=5",
            "gradient_accumulation_steps=2", "model.lora_dropout=0.1",  # dropout: RNG restored
            "mask_update.every_n_steps=2", "mask_update.until_step=8"]  # masks move at 2, 4, 6
    run(tmp_path / "whole", *keys)
    whole = logged(tmp_path / "whole")
    assert sorted(whole) == list(range(1, 9))

    out = tmp_path / "killed"
    cmd = [TUNE, "run", "squash_finetune", "--config", str(TINY_CONFIG), f"output_dir={out}",
           *QUICK, *keys]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (out / "step_3" / "checkpoint.json").exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before step 3"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "epoch_1").exists()  # it was killed, not finished

    run(out, *keys, "resume_from_checkpoint=True")
    resumed_log = max((out / "logs").glob("log_*.txt"), key=os.path.getmtime)
    resumed = {int(line.split()[1]): float(line.split("loss:")[1].split()[0])
               for line in resumed_log.read_text().splitlines() if line.startswith("Step ")}
    assert resumed and max(resumed) == 8 and min(resumed) >= 4
    assert sorted(resumed) == list(range(min(resumed), 9))
    for step, loss in resumed.items():
        assert loss == pytest.approx(whole[step], rel=1e-6, abs=1e-6), (step, resumed, whole)


def _rebuild(output_dir, name, quantize_base, svd=False):
    """squash's model rebuilt from a checkpoint's squash_adapter_config.json, base weights from
    the tiny OPT, adapter from the checkpoint."""
    import json

    from omegaconf import OmegaConf
    from torchtune import config

    from squash.models.opt import OPTCheckpointer
    from squash.runs import checkpoint as ckpt

    meta = json.loads((output_dir / name / "squash_adapter_config.json").read_text())
    model = config.instantiate(OmegaConf.create(meta["model"]), quantize_base=quantize_base,
                               init="lora")
    base = OPTCheckpointer(str(TINY), ["model.safetensors"], str(output_dir / "reload"))
    base_state_dict = base.load_checkpoint()["model"]
    model.load_state_dict(base_state_dict, strict=False)
    if svd:  # the base the run trained on: the residual of the same SVD
        from squash.modules import svd_initialize

        svd_initialize(model, base_state_dict)
    ckpt.load_adapter_into(model, ckpt.load_squash_adapter(output_dir / name), output_dir / name)
    return model.eval()


@pytest.mark.slow
def test_peft_adapter_and_merged_weights_load_into_transformers(run, tmp_path):
    import transformers
    from peft import PeftModel

    run(tmp_path, "epochs=1", "max_steps_per_epoch=3", "model.sparse_factor=both")
    epoch = tmp_path / "epoch_0"
    tokens = torch.randint(3, 1024, (2, 40), generator=torch.Generator().manual_seed(7))

    squash_dense_base = _rebuild(tmp_path, "epoch_0", quantize_base=False)
    assert any(m.lora_b.to_dense().abs().sum() > 0 for m in squash_dense_base.modules()
               if hasattr(m, "merged_weight"))  # the adapter really trained
    hf = transformers.OPTForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(hf, epoch / "adapter").eval()
    with torch.no_grad():
        ours, theirs = squash_dense_base(tokens), peft_model(tokens).logits
    assert (ours - theirs).abs().max() <= 1e-4

    squash_nf4 = _rebuild(tmp_path, "epoch_0", quantize_base=True)
    merged = transformers.OPTForCausalLM.from_pretrained(epoch, dtype=torch.float32).eval()
    with torch.no_grad():
        ours, theirs = squash_nf4(tokens), merged(tokens).logits
    assert (ours - theirs).abs().max() <= 1e-3
    # and the merge is not a no-op: the merged model differs from the base
    with torch.no_grad():
        assert (hf(tokens).logits - theirs).abs().max() > 1e-3


@pytest.mark.slow
def test_a_copied_recipe_runs_from_another_directory(run, tmp_path):
    import subprocess
    import sys

    work = tmp_path / "work"
    work.mkdir()
    squash_cli = str(Path(sys.executable).with_name("squash"))
    subprocess.run([squash_cli, "cp", "squash_finetune", str(work / "my_copy.py")], check=True)
    subprocess.run([squash_cli, "cp", "opt_tiny", str(work / "tiny.yaml")], check=True)
    run(tmp_path / "out", "epochs=1", "max_steps_per_epoch=2", recipe="my_copy",
        config=work / "tiny.yaml", cwd=work)
    losses = logged(tmp_path / "out")
    assert losses == pytest.approx({1: PINNED[1], 2: PINNED[2]}, rel=1e-5)


@pytest.mark.slow
def test_a_nan_loss_stops_the_run_naming_the_step_and_keeps_the_last_checkpoint(run, tmp_path):
    proc = run(tmp_path, "epochs=1", "max_steps_per_epoch=6", "save_every_n_steps=1",
               "optimizer.lr=1e30", "lr_scheduler.num_warmup_steps=0", "clip_grad_norm=null",
               "save_adapter_weights_only=True", check=False)
    assert proc.returncode != 0
    msg = [line for line in proc.stderr.splitlines() if "The loss became" in line]
    assert msg, proc.stderr[-3000:]
    step = int(msg[0].split(" at step ")[1].split()[0])
    assert step >= 2 and f"step_{step - 1}" in msg[0]
    assert (tmp_path / f"step_{step - 1}" / "checkpoint.json").is_file()
    assert not (tmp_path / f"step_{step}").exists() and not (tmp_path / "epoch_0").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    good = logged(tmp_path)
    assert all(math.isfinite(v) for v in good.values()) and max(good) == step - 1


@pytest.mark.slow
def test_svd_init_exports_merged_weights_near_the_original_and_a_peft_delta(run, tmp_path):
    """With ``model.init: svd`` the base becomes the residual of the top singular directions.
    The merged export is that residual (NF4) plus the adapter, so before any update it is the
    pretrained weight up to the residual's smaller NF4 error; the PEFT adapter (rank 2r,
    B A - B0 A0) applies to the original weights and gives squash's logits."""
    import transformers
    from peft import PeftModel
    from safetensors.torch import load_file

    from squash.nf4 import to_nf4

    run(tmp_path / "lr0", "epochs=1", "max_steps_per_epoch=1", "model.init=svd", "~mask_update")
    original = load_file(TINY / "model.safetensors")
    merged = load_file(tmp_path / "lr0" / "epoch_0" / "model.safetensors")
    key = "model.decoder.layers.0.self_attn.q_proj.weight"
    w = original[key].float()
    nf4_error = (to_nf4(w).get_original_weight() - w).norm()
    # step 1 ran at lr 0 (warm-up), so the adapter is still its SVD init
    assert (merged[key] - w).norm() < 0.95 * nf4_error

    run(tmp_path / "trained", "epochs=1", "max_steps_per_epoch=3", "model.init=svd",
        "~mask_update", "model.sparse_factor=both")
    epoch = tmp_path / "trained" / "epoch_0"
    config = json.loads((epoch / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (64, 128)  # 2 x (32, 64)
    model = _rebuild(tmp_path / "trained", "epoch_0", quantize_base=False, svd=True)
    hf = transformers.OPTForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(hf, epoch / "adapter").eval()
    tokens = torch.randint(3, 1024, (2, 40), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert (model(tokens) - peft_model(tokens).logits).abs().max() <= 1e-4
