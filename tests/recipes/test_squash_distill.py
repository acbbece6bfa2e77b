"""squash_distill and squash_eval, run for real through ``tune run``.

The distillation test needs a teacher worth distilling: the shipped tiny OPT has random weights,
so the test first trains one (full fine-tune, plain PyTorch, transformers' OPTForCausalLM) on the
first 160 records of assets/tiny_opt/alpaca_tiny.json and writes it with ``save_pretrained``. It
is the tiny OPT's architecture with ``init_std=0.3`` instead of 0.02: from the default init, the
trained model's NF4 copy is within 1e-4 of its held-out loss (too close to measure a recovery),
while the larger weights of this init make NF4's error cost about 2.9 perplexity points.
"""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.recipes.conftest import REPO, logged, tune_run

TINY = REPO / "assets" / "tiny_opt"
DISTILL = REPO / "configs" / "opt_tiny_distill.yaml"
EVAL = REPO / "configs" / "opt_tiny_eval.yaml"
HELD_OUT = "train[160:]"  # what configs/opt_tiny_eval.yaml scores


def _records(tokenizer, split):
    from torchtune.datasets import alpaca_dataset

    return alpaca_dataset(tokenizer, source="json", data_files=str(TINY / "alpaca_tiny.json"),
                          split=split, train_on_input=True)


def _hf_loss(model, samples, batch_size=8):
    """Token-weighted next-token cross-entropy of a transformers model, by hand."""
    from torchtune.data import padded_collate_sft

    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(samples), batch_size):
            batch = padded_collate_sft(samples[i : i + batch_size], padding_idx=1)
            logits = model(batch["tokens"]).logits[:, :-1].double()
            labels = batch["labels"][:, 1:]
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                     ignore_index=-100, reduction="sum").item()
            count += int((labels != -100).sum())
    return total / count


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A tiny OPT trained on the first 160 records until its held-out loss is far below uniform."""
    import transformers

    from squash.models.opt import opt_tokenizer

    out = tmp_path_factory.mktemp("teacher")
    tok = opt_tokenizer(str(TINY / "vocab.json"), str(TINY / "merges.txt"), max_seq_len=128)
    train, held = list(_records(tok, "train[:160]")), list(_records(tok, HELD_OUT))
    cfg = transformers.OPTConfig.from_pretrained(TINY, init_std=0.3, dropout=0.0,
                                                 attention_dropout=0.0)
    torch.manual_seed(0)
    model = transformers.OPTForCausalLM(cfg).float()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    steps, g = 300, torch.Generator().manual_seed(0)
    from torchtune.data import padded_collate_sft

    for step in range(steps):
        idx = torch.randperm(len(train), generator=g)[:16].tolist()
        batch = padded_collate_sft([train[i] for i in idx], padding_idx=tok.pad_id)
        logits = model(batch["tokens"]).logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                               batch["labels"][:, 1:].reshape(-1), ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad()
        for group in opt.param_groups:  # cosine decay to 0
            group["lr"] = 3e-3 * 0.5 * (1 + math.cos(math.pi * (step + 1) / steps))
    model.eval().save_pretrained(out)
    return out, _hf_loss(model, held)


def _eval(tmp_path, name, *overrides):
    """``tune run squash_eval --config configs/opt_tiny_eval.yaml ...``; its results."""
    import subprocess

    from tests.recipes.conftest import TUNE

    out = tmp_path / f"eval_{name}"
    cmd = [TUNE, "run", "squash_eval", "--config", str(EVAL), f"output_dir={out}", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads((out / "eval_results.json").read_text())


@pytest.mark.slow
def test_squarehead_distillation_recovers_most_of_what_nf4_loses(teacher, tmp_path):
    teacher_dir, teacher_loss = teacher
    assert teacher_loss < 0.2 * math.log(1024)  # far below uniform (6.93)
    base = [f"checkpointer.checkpoint_dir={teacher_dir}"]
    fp32 = _eval(tmp_path, "teacher", *base, "model.quantize_base=False")
    nf4 = _eval(tmp_path, "nf4", *base)
    assert fp32["loss"] == pytest.approx(teacher_loss, abs=1e-4)  # squash_eval vs by hand

    steps = ["epochs=2", "max_steps_per_epoch=15"]  # 30 steps, 8 records each
    out = tmp_path / "distill"
    tune_run(out, *base, f"teacher_checkpointer.checkpoint_dir={teacher_dir}", *steps,
             "task_weight=0", "kd_weight=1", "squarehead_weight=1", recipe="squash_distill",
             config=DISTILL)
    student = _eval(tmp_path, "student", *base, f"adapter_dir={out / 'epoch_1'}")

    gap_start = nf4["perplexity"] - fp32["perplexity"]
    gap_end = student["perplexity"] - fp32["perplexity"]
    print(f"teacher {fp32['perplexity']:.4f} nf4 {nf4['perplexity']:.4f} "
          f"student {student['perplexity']:.4f}")
    assert gap_start > 1.0  # NF4's loss is measurable
    assert abs(gap_end) <= 0.5 * gap_start

    # squash_eval on the merged weights of that run: the same loss as transformers by hand
    import transformers

    from squash.models.opt import opt_tokenizer

    merged_dir = out / "epoch_1"
    merged = _eval(tmp_path, "merged", f"checkpointer.checkpoint_dir={merged_dir}",
                   "model.quantize_base=False")
    hf = transformers.OPTForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    tok = opt_tokenizer(str(TINY / "vocab.json"), str(TINY / "merges.txt"), max_seq_len=128)
    by_hand = _hf_loss(hf, list(_records(tok, HELD_OUT)))
    assert merged["loss"] == pytest.approx(by_hand, abs=1e-3)
    assert student["loss"] == pytest.approx(by_hand, abs=1e-3)  # NF4 + adapter = merged
    assert merged["tokens"] > 500 and merged["tokens_per_second"] > 0


def test_task_loss_alone_reproduces_squash_finetune(tmp_path):
    """With kd_weight = squarehead_weight = 0, squash_distill is squash_finetune: the same
    losses as squash_finetune's pinned ones on configs/opt_tiny.yaml's settings."""
    from tests.recipes.test_squash_finetune import PINNED

    tune_run(tmp_path, "task_weight=1", "kd_weight=0", "squarehead_weight=0",
             "dataset.split=train",
             "lr_scheduler.num_warmup_steps=5", "epochs=3", "max_steps_per_epoch=4",
             "save_adapter_weights_only=True", recipe="squash_distill", config=DISTILL)
    losses = logged(tmp_path)
    for step, value in PINNED.items():
        assert losses[step] == pytest.approx(value, rel=1e-5), (step, losses)


def test_resume_reproduces_the_uninterrupted_losses(tmp_path):
    keys = ["epochs=1", "max_steps_per_epoch=4", "save_every_n_steps=2", "keep_last_n=5",
            "mask_update.every_n_steps=2", "save_adapter_weights_only=True"]  # masks move at 2
    whole = tmp_path / "whole"
    tune_run(whole, *keys, recipe="squash_distill", config=DISTILL)
    expected = logged(whole)
    assert sorted(expected) == [1, 2, 3, 4]

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(whole / "step_2", resumed / "step_2")  # as if killed after step 2
    tune_run(resumed, *keys, "resume_from_checkpoint=True", recipe="squash_distill",
             config=DISTILL)
    got = logged(resumed)
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        for key in ("loss", "task_loss", "kd_loss", "squarehead_loss"):
            assert logged(resumed, key)[step] == pytest.approx(logged(whole, key)[step], rel=1e-6)
    assert expected[4] != expected[1]  # it trained


def test_bad_distill_keys_name_the_key(tmp_path):
    proc = tune_run(tmp_path, "squarehead_wieght=1", recipe="squash_distill", config=DISTILL,
                    check=False)
    assert proc.returncode != 0 and "did you mean 'squarehead_weight'" in proc.stderr
    proc = tune_run(tmp_path, "squarehead_layers=[5]", recipe="squash_distill", config=DISTILL,
                    check=False)
    assert proc.returncode != 0 and "squarehead_layers: [5] outside" in proc.stderr
