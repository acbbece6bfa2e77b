"""squash_distill and squash_eval, run for real through ``tune run``.

The distillation test needs a teacher worth distilling: the shipped tiny OPT has random weights,
so the test first trains one with ``scripts/distill_teacher.py`` (transformers' OPTForCausalLM,
the tiny OPT's architecture, full training) on the generated word-bigram corpus that script
writes; see its docstring for why that corpus and not the templated alpaca records.
"""

import importlib.util
import json
import math
import shutil
import subprocess

import pytest
import torch

from tests.helpers import REPO, TUNE, logged, tune_run

TINY = REPO / "assets" / "tiny_opt"
DISTILL = REPO / "configs" / "opt_tiny_distill.yaml"
EVAL = REPO / "configs" / "opt_tiny_eval.yaml"


def _script():
    spec = importlib.util.spec_from_file_location("distill_teacher",
                                                  REPO / "scripts" / "distill_teacher.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


teacher_script = _script()


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """The script's teacher: trained until its held-out loss is far below uniform."""
    out = tmp_path_factory.mktemp("teacher")
    held, entropy = teacher_script.train_teacher(out)
    return out, held


def _eval(tmp_path, name, teacher_dir, *overrides):
    """``tune run squash_eval --config configs/opt_tiny_eval.yaml ...`` on the held-out records."""
    out = tmp_path / f"eval_{name}"
    held = teacher_script.dataset_overrides(teacher_dir, held_out=True)
    cmd = [TUNE, "run", "squash_eval", "--config", str(EVAL), f"output_dir={out}", *held,
           "device=cpu", "dtype=fp32", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads((out / "eval_results.json").read_text())


@pytest.mark.slow
def test_squarehead_distillation_recovers_more_than_plain_ce(teacher, tmp_path):
    teacher_dir, teacher_loss = teacher
    assert teacher_loss < 0.5 * math.log(1024)  # far below uniform (6.93)
    base = [f"checkpointer.checkpoint_dir={teacher_dir}"]
    fp32 = _eval(tmp_path, "teacher", teacher_dir, *base, "model.quantize_base=False")
    nf4 = _eval(tmp_path, "nf4", teacher_dir, *base)
    assert fp32["loss"] == pytest.approx(teacher_loss, abs=1e-4)  # squash_eval vs by hand

    def student(name, task, kd, sh):
        out = tmp_path / name
        tune_run(out, *base, f"teacher_checkpointer.checkpoint_dir={teacher_dir}",
                 *teacher_script.dataset_overrides(teacher_dir),
                 "batch_size=8", "epochs=1", "max_steps_per_epoch=30", "optimizer.lr=3e-3",
                 f"task_weight={task}", f"kd_weight={kd}", f"squarehead_weight={sh}",
                 recipe="squash_distill", config=DISTILL)
        return out, _eval(tmp_path, name, teacher_dir, *base, f"adapter_dir={out / 'epoch_0'}")

    out, distilled = student("distill", 0, 1, 1)  # SquareHead + logit KL
    _, plain = student("ce", 1, 0, 0)  # the same steps, batches and data, plain CE

    gap_start = nf4["perplexity"] - fp32["perplexity"]
    gap_distill = distilled["perplexity"] - fp32["perplexity"]
    gap_ce = plain["perplexity"] - fp32["perplexity"]
    print(f"teacher {fp32['perplexity']:.4f} nf4 {nf4['perplexity']:.4f} "
          f"distilled {distilled['perplexity']:.4f} plain CE {plain['perplexity']:.4f}")
    assert gap_start > 2.0  # NF4's loss is measurable
    assert abs(gap_distill) <= 0.5 * gap_start
    assert abs(gap_distill) < abs(gap_ce)

    # squash_eval on the merged weights of the distilled run: transformers' loss by hand
    import transformers

    from squash.models.opt import opt_tokenizer

    merged_dir = out / "epoch_0"
    merged = _eval(tmp_path, "merged", teacher_dir, f"checkpointer.checkpoint_dir={merged_dir}",
                   "model.quantize_base=False")
    hf = transformers.OPTForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    tok = opt_tokenizer(str(TINY / "vocab.json"), str(TINY / "merges.txt"), max_seq_len=128)
    held = teacher_script.records(tok, teacher_dir / "corpus.jsonl",
                                  f"train[{teacher_script.TRAIN}:]")
    by_hand = teacher_script.hf_loss(hf, held)
    assert merged["loss"] == pytest.approx(by_hand, abs=1e-3)
    assert distilled["loss"] == pytest.approx(by_hand, abs=1e-3)  # NF4 + adapter = merged
    assert merged["tokens"] > 5000 and merged["tokens_per_second"] > 0


@pytest.mark.slow
def test_task_loss_alone_reproduces_squash_finetune(tmp_path):
    """With kd_weight = squarehead_weight = 0, squash_distill is squash_finetune: the same
    losses as squash_finetune's pinned ones on configs/opt_tiny.yaml's settings."""
    from tests.helpers import PINNED

    tune_run(tmp_path, "task_weight=1", "kd_weight=0", "squarehead_weight=0",
             "dataset.split=train",
             "lr_scheduler.num_warmup_steps=5", "epochs=3", "max_steps_per_epoch=4",
             "save_adapter_weights_only=True", recipe="squash_distill", config=DISTILL)
    losses = logged(tmp_path)
    for step, value in PINNED.items():
        assert losses[step] == pytest.approx(value, rel=1e-5), (step, losses)


@pytest.mark.slow
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


@pytest.mark.slow
def test_bad_distill_keys_name_the_key(tmp_path):
    proc = tune_run(tmp_path, "squarehead_wieght=1", recipe="squash_distill", config=DISTILL,
                    check=False)
    assert proc.returncode != 0 and "did you mean 'squarehead_weight'" in proc.stderr
    proc = tune_run(tmp_path, "squarehead_layers=[5]", recipe="squash_distill", config=DISTILL,
                    check=False)
    assert proc.returncode != 0 and "squarehead_layers: [5] outside" in proc.stderr
