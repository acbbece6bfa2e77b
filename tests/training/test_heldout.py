"""Held-out loss and greedy answers (squash.training.heldout) on the tiny OPT, against
transformers' OPTForCausalLM on the same weights: its own loss over the answer tokens and its
own greedy ``generate``."""

import json
from pathlib import Path

import pytest
import torch
import transformers

from squash.config.keys import ConfigKeyError
from squash.datasets import unicode_names_dataset
from squash.models.opt import OPTCheckpointer, opt, opt_args_from_hf_config, opt_tokenizer
from squash.training.heldout import (
    HeldoutEvaluator,
    greedy_tokens,
    heldout_loss,
    parse_heldout,
    prompt_tokens,
)

TINY = Path(__file__).resolve().parents[2] / "assets" / "tiny_opt"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    config = json.loads((TINY / "config.json").read_text())
    ckpt = OPTCheckpointer(str(TINY), ["model.safetensors"], str(tmp_path_factory.mktemp("out")))
    model = opt(**opt_args_from_hf_config(config))
    model.load_state_dict(ckpt.load_checkpoint()["model"], strict=True)
    hf = transformers.OPTForCausalLM.from_pretrained(str(TINY), dtype=torch.float32).eval()
    tok = opt_tokenizer(str(TINY / "vocab.json"), str(TINY / "merges.txt"))
    return model.eval(), hf, tok


def test_heldout_loss_equals_transformers_mean_over_answer_tokens(tiny):
    model, hf, tok = tiny
    samples = [unicode_names_dataset(tok, split="validation")[i] for i in range(5)]
    # batches of 2 pad the shorter samples; padding must not change the result
    got = heldout_loss(model, samples, pad_id=tok.pad_id, batch_size=2)
    total, count = 0.0, 0
    with torch.no_grad():
        for s in samples:
            labels = torch.tensor([s["labels"]])
            n = int((labels[:, 1:] != -100).sum())  # transformers shifts inside
            out = hf(input_ids=torch.tensor([s["tokens"]]), labels=labels)
            total += out.loss.item() * n
            count += n
    assert got["tokens"] == count
    assert got["loss"] == pytest.approx(total / count, rel=1e-5)


def test_greedy_tokens_equal_transformers_greedy_generate(tiny):
    model, hf, tok = tiny
    sample = unicode_names_dataset(tok, split="validation")[3]
    prompt = prompt_tokens(sample)
    assert len(prompt) < len(sample["tokens"])
    assert sample["labels"][len(prompt)] != -100 and all(x == -100 for x in sample["labels"][: len(prompt)])
    ours = greedy_tokens(model, prompt, max_new_tokens=6, stop_tokens=[tok.eos_id])
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                             eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)[0, len(prompt):].tolist()
    if tok.eos_id in theirs:
        theirs = theirs[: theirs.index(tok.eos_id)]
    assert ours == theirs and len(ours) > 0


def test_report_prints_before_and_after(tiny, capsys):
    model, _, tok = tiny
    settings = parse_heldout({
        "dataset": {"_component_": "squash.datasets.unicode_names_dataset", "split": "validation",
                    "max_samples": 3},
        "max_new_tokens": 2, "exact_match_samples": 2, "prompt_index": 1,
    })
    ev = HeldoutEvaluator(settings, tok, torch.device("cpu"), -100)
    first = ev.report(model)
    with torch.no_grad():
        model.tok_embeddings.weight.mul_(0.5)  # a different model: a different loss
    try:
        second = ev.report(model)
    finally:
        with torch.no_grad():
            model.tok_embeddings.weight.mul_(2.0)
    out = capsys.readouterr().out
    expected_name = unicode_names_dataset(tok, split="validation").answer(1)
    assert f"expected answer:        {expected_name}" in out
    change = 100 * (second["loss"] - first["loss"]) / first["loss"]
    assert f"before training: {first['loss']:.4f}, after: {second['loss']:.4f} ({change:+.1f}%)" in out
    assert first["exact_match"] == 0 and first["exact_match_of"] == 2  # a random model
    assert model.training is False


def test_a_prompt_index_past_the_samples_names_the_key(tiny):
    from squash.config.keys import ConfigKeyError

    _, _, tok = tiny
    settings = parse_heldout({
        "dataset": {"_component_": "squash.datasets.unicode_names_dataset", "split": "validation",
                    "max_samples": 3},
        "prompt_index": 3,
    })
    with pytest.raises(ConfigKeyError, match="heldout.prompt_index is 3, but heldout.dataset "
                                             "has 3 samples"):  # fmt: skip
        HeldoutEvaluator(settings, tok, torch.device("cpu"), -100)


@pytest.mark.parametrize("block, match", [
    ({"dataset": {"_component_": "squash.datasets.unicode_names_dataset"}, "max_new_tokns": 3},
     "heldout.max_new_tokns .*max_new_tokens"),
    ({"batch_size": 2}, "heldout needs a dataset"),
    ({"dataset": {"_component_": "squash.datasets.unicode_names_dataset", "splt": "test"}},
     "heldout.dataset.splt"),
    ({"dataset": {"_component_": "squash.datasets.unicode_names_dataset"}, "batch_size": 0},
     "heldout.batch_size must be an integer >= 1"),
])
def test_bad_heldout_blocks_name_the_key(block, match):
    with pytest.raises(ConfigKeyError, match=match):
        parse_heldout(block)


def test_the_prompt_runs_past_the_answer_turns_header():
    # a chat template that labels the turn header ("assistant\n") with the answer, as ChatML does
    vocab = {10: "Q", 11: "?", 20: "assistant", 21: "\n", 30: "LAT", 31: "IN", 2: ""}
    sample = {"tokens": [10, 11, 20, 21, 30, 31, 2], "labels": [-100, -100, 20, 21, 30, 31, 2]}

    def decode(ids):
        return "".join(vocab[i] for i in ids)

    assert prompt_tokens(sample, "LATIN", decode) == [10, 11, 20, 21]
    assert prompt_tokens(sample) == [10, 11]  # no answer known: up to the first label
    with pytest.raises(ValueError, match="no label tokens"):
        prompt_tokens({"tokens": [1, 2], "labels": [-100, -100]})


def test_next_token_loss_against_a_float64_sum_by_hand():
    from squash.training.heldout import next_token_loss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g)
    labels = torch.tensor([[-100, -100, 3, 1, 6], [-100, 2, 0, -100, -100]])
    total, count = next_token_loss(logits, labels)
    want, n = 0.0, 0
    for b in range(2):
        for t in range(4):  # position t predicts labels[b, t + 1]
            y = int(labels[b, t + 1])
            if y != -100:
                want -= float(torch.log_softmax(logits[b, t].double(), -1)[y])
                n += 1
    assert count == n == 5 and total.dtype == torch.float64
    assert abs(float(total) - want) < 1e-5
