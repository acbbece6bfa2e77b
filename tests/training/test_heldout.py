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
    greedy_batch,
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


class _NoCache(torch.nn.Module):
    """The model without torchtune's cache methods: greedy_batch reruns the whole batch."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, **kwargs):
        return self.model(tokens, **kwargs)


def _hf_greedy(hf, prompt, n, stop):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=1, min_new_tokens=n)[0, len(prompt):]  # fmt: skip
    out = out.tolist()
    cut = [i for i, t in enumerate(out) if t in stop]
    return out[: cut[0]] if cut else out


@pytest.mark.parametrize("cached", [True, False])
def test_batched_greedy_answers_equal_transformers_one_prompt_at_a_time(tiny, cached):
    """Prompts of different lengths in one left-padded batch, with and without the KV cache,
    against transformers' greedy generate of each prompt alone; a stop token that ends some
    answers early while the others go on."""
    model, hf, tok = tiny
    ds = unicode_names_dataset(tok, split="validation")
    prompts = [prompt_tokens(ds[i]) for i in (0, 1, 6, 3)]
    assert len({len(p) for p in prompts}) > 1  # the batch is padded
    runner = model if cached else _NoCache(model)
    free = [_hf_greedy(hf, p, 5, []) for p in prompts]
    assert greedy_batch(runner, prompts, max_new_tokens=5, stop_tokens=[], pad_id=tok.pad_id) == free
    stop = [free[1][0]]  # ends the second answer at once, not the first
    expected = [_hf_greedy(hf, p, 5, stop) for p in prompts]
    assert expected[1] == [] and len(expected[0]) == 5
    got = greedy_batch(runner, prompts, max_new_tokens=5, stop_tokens=stop, pad_id=tok.pad_id)
    assert got == expected
    assert not model.caches_are_setup()  # the cache is gone after the batch


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


def test_batched_greedy_on_a_sparse_nf4_llama_equals_one_prompt_at_a_time():
    """Rotary positions counted from each left-padded prompt's first token, an NF4 base with
    sparse adapters (B nonzero, so they count), chunked output: the batch answers as
    :func:`greedy_tokens` answers each prompt alone without a cache."""
    from torchtune.models.llama3_2 import lora_llama3_2

    from squash.modules import swap_lora_linear

    torch.manual_seed(0)
    model = lora_llama3_2(
        lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_mlp=True, vocab_size=256,
        num_layers=2, num_heads=4, num_kv_heads=4, embed_dim=128, max_seq_len=64,
        intermediate_dim=256, lora_rank=4, lora_alpha=8.0, quantize_base=True,
    )  # fmt: skip
    swap_lora_linear(model, sparsity=0.5, sparse_factor="both")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_b" in name:
                p.normal_(0, 0.1)
    model.set_num_output_chunks(4)
    model.eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 11, 7, 1)]
    expected = [greedy_tokens(model, p, max_new_tokens=8, stop_tokens=[]) for p in prompts]
    got = greedy_batch(model, prompts, max_new_tokens=8, stop_tokens=[], pad_id=0)
    assert got == expected and all(len(e) == 8 for e in expected)


def test_a_sample_cut_by_max_seq_len_is_refused_naming_the_key(tiny):
    _, _, tok = tiny
    settings = parse_heldout({
        "dataset": {"_component_": "squash.datasets.unicode_names_dataset", "split": "validation",
                    "max_samples": 3},
    })
    longest = max(len(s["tokens"]) for s in HeldoutEvaluator(settings, tok, torch.device("cpu"), -100).samples)
    cut = opt_tokenizer(str(TINY / "vocab.json"), str(TINY / "merges.txt"), max_seq_len=longest - 1)
    with pytest.raises(ConfigKeyError, match=rf"heldout.dataset: sample \d is {longest - 1} tokens, "
                                             rf"tokenizer.max_seq_len is {longest - 1}: the sample "
                                             "may have been cut"):  # fmt: skip
        HeldoutEvaluator(settings, cut, torch.device("cpu"), -100)


def test_a_multi_line_answer_prints_on_one_line(tiny, capsys, monkeypatch):
    model, _, tok = tiny
    settings = parse_heldout({
        "dataset": {"_component_": "squash.datasets.unicode_names_dataset", "split": "validation",
                    "max_samples": 2},
        "max_new_tokens": 2,
    })
    ev = HeldoutEvaluator(settings, tok, torch.device("cpu"), -100)
    monkeypatch.setattr(ev, "answers", lambda model, indices: ["December 1, 2091\n\nThis  is"])
    ev.report(model)
    ev.report(model)
    out = capsys.readouterr().out
    assert "  answer before training: December 1, 2091 This is\n" in out
    assert "  answer after training:  December 1, 2091 This is\n" in out
