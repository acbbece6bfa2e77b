"""The main job as a user runs it: its config, copied out with ``squash cp`` into an empty
directory, trains the downloaded SmolLM2-135M-Instruct there (fp32 on the CPU), and the held-out
exact match rises from at most 10% to at least 60% of 50 dates, the printed example's answer
right after training. Its held-out loss before training equals transformers' LlamaForCausalLM's
on the same samples, its decoder linears dequantized from NF4 by torchao (the adapters start at
zero on the config's NF4 base); every answer is checked by the task's rule (datetime)."""

import datetime
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import nf4_reference_llama, run_env

BIN = Path(sys.executable).parent


@pytest.mark.smollm2
@pytest.mark.slow
def test_the_main_job_teaches_iso_dates_from_an_empty_directory(smollm2_checkpoint, tmp_path):
    from squash.datasets import iso_dates_dataset
    from squash.datasets.iso_dates import iso_date_pairs
    from squash.models.smollm2 import smollm2_tokenizer

    work = tmp_path / "empty"
    work.mkdir()
    subprocess.run([str(BIN / "squash"), "cp", "smollm2_135m", "my.yaml"], cwd=work, check=True)
    ckpt = str(smollm2_checkpoint)
    proc = subprocess.run(
        [str(BIN / "tune"), "run", "squash_finetune", "--config", "my.yaml",
         f"output_dir={tmp_path / 'out'}", f"checkpointer.checkpoint_dir={ckpt}",
         f"tokenizer.path={ckpt}",
         "device=cpu", "dtype=fp32"],  # the reference below is transformers' fp32 on the CPU
        cwd=work, capture_output=True, text=True, timeout=1800, env=run_env(),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert sorted(p.name for p in work.iterdir()) == ["my.yaml"]
    assert (tmp_path / "out" / "training.png").is_file()
    out = proc.stdout
    after, of, before = map(int, re.search(
        r"exact match: (\d+)/(\d+) held-out samples \(before: (\d+)\)", out).groups())  # fmt: skip
    assert of == 50 and before <= 5 and after >= 30, out[-2000:]
    question, answer = iso_date_pairs("validation")[0]
    assert answer == datetime.datetime.strptime(question, "%B %d, %Y").date().isoformat()
    assert f"expected answer:        {answer}" in out
    assert f"answer after training:  {answer}" in out
    assert f"answer before training: {answer}\n" not in out

    m = re.search(r"Held-out loss before training: ([\d.]+), after: ([\d.]+)", out)
    tok = smollm2_tokenizer(ckpt, max_seq_len=96)
    ds = iso_dates_dataset(tok, split="validation", max_samples=50)
    hf = nf4_reference_llama(ckpt)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(ds)):
            s = ds[i]
            labels = torch.tensor([s["labels"]])
            n = int((labels[:, 1:] != -100).sum())
            total += hf(input_ids=torch.tensor([s["tokens"]]), labels=labels).loss.item() * n
            count += n
    assert float(m.group(1)) == pytest.approx(total / count, abs=1e-3)
    assert float(m.group(2)) < float(m.group(1)) / 4
