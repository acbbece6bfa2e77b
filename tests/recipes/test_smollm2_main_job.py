"""The main job's config, copied out with ``squash cp`` into an empty directory, runs there on
the downloaded SmolLM2-135M-Instruct; its held-out loss before training equals transformers'
LlamaForCausalLM's on the same samples, its decoder linears dequantized from NF4 by torchao (the
adapters start at zero on the config's NF4 base)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import nf4_reference_llama

BIN = Path(sys.executable).parent


@pytest.mark.smollm2
@pytest.mark.slow
def test_copied_smollm2_config_runs_from_an_empty_directory(smollm2_checkpoint, tmp_path):
    from squash.datasets import unicode_names_dataset
    from squash.models.smollm2 import smollm2_tokenizer

    work = tmp_path / "empty"
    work.mkdir()
    subprocess.run([str(BIN / "squash"), "cp", "smollm2_135m", "my.yaml"], cwd=work, check=True)
    ckpt = str(smollm2_checkpoint)
    proc = subprocess.run(
        [str(BIN / "tune"), "run", "squash_finetune", "--config", "my.yaml",
         f"output_dir={tmp_path / 'out'}", f"checkpointer.checkpoint_dir={ckpt}",
         f"tokenizer.path={ckpt}", "max_steps_per_epoch=2", "batch_size=2",
         "heldout.dataset.max_samples=3", "heldout.max_new_tokens=3", "heldout.prompt_index=0",
         "mask_update.every_n_steps=1", "mask_update.until_step=2",
         "device=cpu", "dtype=fp32"],  # the reference below is transformers' fp32 on the CPU
        cwd=work, capture_output=True, text=True, timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert sorted(p.name for p in work.iterdir()) == ["my.yaml"]
    m = re.search(r"Held-out loss before training: ([\d.]+), after: ([\d.]+)", proc.stdout)
    assert m, proc.stdout[-3000:]
    before = float(m.group(1))

    tok = smollm2_tokenizer(ckpt, max_seq_len=96)
    ds = unicode_names_dataset(tok, split="validation", max_samples=3)
    hf = nf4_reference_llama(ckpt)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(3):
            s = ds[i]
            labels = torch.tensor([s["labels"]])
            n = int((labels[:, 1:] != -100).sum())
            total += hf(input_ids=torch.tensor([s["tokens"]]), labels=labels).loss.item() * n
            count += n
    assert before == pytest.approx(total / count, abs=1e-3)
