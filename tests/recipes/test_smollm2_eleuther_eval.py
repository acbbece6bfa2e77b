"""``tune run squash_eleuther_eval`` (torchtune's eleuther_eval, offline) on SmolLM2 with the local
squash_facts task: its scores equal the same metrics computed by hand with transformers."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
TUNE = str(Path(sys.executable).with_name("tune"))
TASK_DATA = REPO / "squash" / "eval_tasks" / "squash_facts.jsonl"


def _hand_scores(checkpoint: Path):
    """acc and acc_norm of lm-eval's multiple_choice, by hand: for each question the sum of the
    log-probabilities of each choice's tokens (" " + choice, tokenized as lm-eval does: the
    whole string minus the context's tokens, no BOS) after "Question: ...\\nAnswer:"; acc_norm
    divides by the choice's length in characters."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    docs = [json.loads(line) for line in TASK_DATA.read_text().splitlines()]
    acc = acc_norm = 0
    for doc in docs:
        context = f"Question: {doc['question']}\nAnswer:"
        ctx = tok(context, add_special_tokens=False).input_ids
        lls = []
        for choice in doc["choices"]:
            whole = tok(context + " " + choice, add_special_tokens=False).input_ids
            cont = whole[len(ctx):]
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
            lls.append(sum(logp[len(whole) - len(cont) - 1 + i, t].item() for i, t in enumerate(cont)))
        norm = [ll / len(" " + c) for ll, c in zip(lls, doc["choices"])]
        acc += max(range(4), key=lls.__getitem__) == doc["answer"]
        acc_norm += max(range(4), key=norm.__getitem__) == doc["answer"]
    return acc / len(docs), acc_norm / len(docs)


@pytest.mark.smollm2
@pytest.mark.slow
def test_eleuther_eval_scores_equal_a_hand_computation(smollm2_checkpoint, tmp_path):
    cmd = [TUNE, "run", "squash_eleuther_eval", "--config",
           str(REPO / "configs" / "smollm2_eleuther_eval.yaml"),
           f"checkpointer.checkpoint_dir={smollm2_checkpoint}", f"output_dir={tmp_path}",
           "batch_size=8", "device=cpu", "dtype=fp32"]  # fmt: skip  (squash_facts is found without
    # include_path; fp32 on the CPU, as _hand_scores computes)
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    scores = dict(re.findall(r"\|(acc|acc_norm)\s*\|[^|]*\|\s*([0-9.]+)\s*\|", out))
    acc, acc_norm = _hand_scores(smollm2_checkpoint)
    assert float(scores["acc"]) == pytest.approx(acc, abs=1e-9), out[-2000:]
    assert float(scores["acc_norm"]) == pytest.approx(acc_norm, abs=1e-9), out[-2000:]
    assert 0.25 < acc_norm < 1.0  # an instruct model does better than chance, not perfectly
