"""A short squash_finetune run on the downloaded SmolLM2-135M-Instruct with the main job's config
(NF4 base, both factors 90% sparse; masks updated every step): its PEFT adapter, applied by PEFT
to transformers' LlamaForCausalLM on the unquantized base, gives the logits of squash's own model
rebuilt on the unquantized base; its merged weights, loaded by transformers, give those of
squash's model on its NF4 base. A run killed with SIGKILL after its step-2 checkpoint and resumed
logs the losses of the uninterrupted run."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import QUICK, REPO, TUNE, logged, nf4_reference_llama, tune_run

CONFIG = REPO / "configs" / "smollm2_135m.yaml"
TEXT = "The capital of France is Paris. Unicode names characters: LATIN SMALL LETTER N WITH TILDE."


def _overrides(ckpt: Path):
    return [f"checkpointer.checkpoint_dir={ckpt}", f"tokenizer.path={ckpt}",
            "max_steps_per_epoch=4", "batch_size=2", "save_every_n_steps=2", "keep_last_n=4",
            "save_adapter_weights_only=False", "mask_update.every_n_steps=1",
            "mask_update.until_step=4", "heldout.dataset.max_samples=2", "heldout.prompt_index=0",
            "heldout.max_new_tokens=2"]  # fmt: skip


def _squash_logits(ckpt: Path, epoch_dir: Path, ids: torch.Tensor, quantize_base: bool):
    """squash's model as the config builds it (NF4 base or not), the base from ``ckpt``, the
    adapter from the squash adapter file of ``epoch_dir``."""
    from omegaconf import OmegaConf
    from torchtune import config
    from torchtune.training import FullModelHFCheckpointer

    from squash.runs import checkpoint as ckpt_lib

    cfg = OmegaConf.load(CONFIG)
    assert cfg.model.quantize_base  # the run trained on an NF4 base
    model = config.instantiate(cfg.model, quantize_base=quantize_base)
    base = FullModelHFCheckpointer(
        checkpoint_dir=str(ckpt), checkpoint_files=["model.safetensors"], model_type="LLAMA3_2",
        output_dir=str(epoch_dir.parent / "unused"),
    ).load_checkpoint()["model"]
    missing, unexpected = model.load_state_dict(base, strict=False)
    assert not unexpected and all(".lora_" in k for k in missing)
    adapter = ckpt_lib.load_squash_adapter(epoch_dir)
    ckpt_lib.load_adapter_into(model, adapter, epoch_dir / ckpt_lib.SQUASH_ADAPTER_FILE)
    with torch.no_grad():
        return model.eval()(ids)


@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_run_exports_peft_and_merged_weights_and_resumes_after_sigkill(smollm2_checkpoint, tmp_path):
    import transformers
    from peft import PeftModel

    ckpt = smollm2_checkpoint
    out = tmp_path / "run"
    tune_run(out, *_overrides(ckpt), config=CONFIG, timeout=2400)
    uninterrupted = logged(out)
    assert sorted(uninterrupted) == [1, 2, 3, 4]

    epoch = out / "epoch_0"
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    ids = torch.tensor([tok(TEXT)["input_ids"]])
    ours_fp32 = _squash_logits(ckpt, epoch, ids, quantize_base=False)
    ours_nf4 = _squash_logits(ckpt, epoch, ids, quantize_base=True)

    base = transformers.LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, epoch / "adapter").eval()
    with torch.no_grad():
        peft_logits = peft(ids).logits
        merged = transformers.LlamaForCausalLM.from_pretrained(epoch, dtype=torch.float32).eval()
        merged_logits = merged(ids).logits
        plain = transformers.LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()(ids).logits
        nf4_plain = nf4_reference_llama(ckpt)(ids).logits
    assert (peft_logits - ours_fp32).abs().max().item() <= 1e-3
    assert (merged_logits - ours_nf4).abs().max().item() <= 1e-3
    # the adapter moved the model, and the NF4 base differs from the fp32 one: neither
    # comparison is one of two equal models
    assert (plain - ours_fp32).abs().max().item() > 1e-2
    assert (nf4_plain - ours_nf4).abs().max().item() > 1e-2
    assert (ours_nf4 - ours_fp32).abs().max().item() > 1e-2

    # the same run killed (SIGKILL) once its step-2 checkpoint is complete, then resumed
    killed = tmp_path / "killed"
    cmd = [TUNE, "run", "squash_finetune", "--config", str(CONFIG), f"output_dir={killed}",
           *QUICK, *_overrides(ckpt)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 2400
    while not (killed / "step_2" / "checkpoint.json").exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before step 2"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "epoch_0").exists() and not (killed / "step_4").exists()
    tune_run(killed, *_overrides(ckpt), "resume_from_checkpoint=True", config=CONFIG, timeout=2400)
    resumed = logged(killed)
    for step in (3, 4):
        assert resumed[step] == pytest.approx(uninterrupted[step], abs=1e-6)
