"""GGUF export and chat on SmolLM2-135M-Instruct (the download, used as the merged checkpoint):
the exported files, read back by transformers' GGUF loader, against the checkpoint itself, and
their metadata key by key against the upstream GGUF the download was made from."""

import json
import math

import pytest
import torch

import gguf
from squash.chat import load_checkpoint
from squash.export import export_gguf

pytestmark = pytest.mark.smollm2

# Held-out text (written for this test): a few hundred tokens of plain English prose.
TEXT = (
    "The harbour town woke slowly. Fishing boats came in with the tide, their hulls heavy with "
    "the night's catch, and the gulls followed them in wide, noisy circles. On the quay, an old "
    "man mended nets with quick, patient fingers, while two children raced between the crates "
    "and argued about which boat was fastest. Behind them the bakery opened its shutters, and "
    "the smell of warm bread drifted down the narrow street towards the water. By nine o'clock "
    "the market was full. Farmers from the hills sold apples, cheese and honey; a woman in a "
    "green coat sold flowers she had grown in her garden; and a young musician played the "
    "violin beside the fountain, hoping for a few coins. Nobody in the town was in a hurry. "
    "The ferry to the island left twice a day, in the morning and in the late afternoon, and "
    "if you missed it you simply waited, drank a cup of coffee and watched the harbour. In "
    "winter the storms were fierce, and the waves broke over the sea wall, but in summer the "
    "water was calm and clear, and on the best days you could see the island's white "
    "lighthouse from the end of the pier."
)
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "def fibonacci(n):",
    "Water boils at a temperature of",
]


def _hf(directory, gguf_file=None):
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, **kwargs).eval()


@pytest.fixture(scope="module")
def exported(smollm2_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf")
    for dtype in ("f16", "q8_0"):
        export_gguf(smollm2_checkpoint, dtype, out / f"smollm2-{dtype}.gguf")
    return out


@pytest.fixture(scope="module")
def tokenizer(smollm2_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_checkpoint))


def _nll(model, ids):
    with torch.no_grad():
        logits = model(ids).logits[0, :-1]
    return torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item()


@pytest.mark.slow
def test_f16_logits_and_greedy_continuations_match_the_checkpoint(smollm2_checkpoint, exported, tokenizer):
    ref, f16 = _hf(smollm2_checkpoint), _hf(exported, "smollm2-f16.gguf")
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    assert ids.shape[1] >= 200
    rounded = _hf(smollm2_checkpoint)
    with torch.no_grad():
        for p in rounded.parameters():  # what F16 stores: 2-D weights rounded to float16
            if p.ndim == 2:
                p.copy_(p.half().float())
        got = f16(ids).logits
        # The file is the checkpoint up to float16 rounding and nothing else (measured: 0.0).
        # Against the float32 checkpoint itself the rounding moves logits by up to 0.053
        # (logit std 5.9) on these 239 tokens.
        torch.testing.assert_close(got, rounded(ids).logits, atol=1e-4, rtol=0)
    for prompt in PROMPTS:
        p = tokenizer(prompt, return_tensors="pt")
        kw = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=2)
        a = ref.generate(**p, **kw)[0, p.input_ids.shape[1]:].tolist()
        b = f16.generate(**p, **kw)[0, p.input_ids.shape[1]:].tolist()
        assert a == b, (prompt, tokenizer.decode(a), tokenizer.decode(b))


@pytest.mark.slow
def test_q8_0_perplexity_within_2_percent_of_f16(exported, tokenizer):
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    ppl_f16 = math.exp(_nll(_hf(exported, "smollm2-f16.gguf"), ids))
    ppl_q8 = math.exp(_nll(_hf(exported, "smollm2-q8_0.gguf"), ids))
    assert abs(ppl_q8 / ppl_f16 - 1) <= 0.02, (ppl_f16, ppl_q8)


def test_metadata_is_the_checkpoints_tokenizer_and_template(smollm2_checkpoint, exported, tokenizer):
    from transformers import AutoTokenizer

    fields = gguf.GGUFReader(exported / "smollm2-q8_0.gguf").fields
    tok = json.loads((smollm2_checkpoint / "tokenizer.json").read_text())
    tokens = fields["tokenizer.ggml.tokens"].contents()
    vocab = dict(tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]})
    assert len(tokens) == 49152 and all(tokens[i] == t for t, i in vocab.items())
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    assert fields["tokenizer.ggml.merges"].contents() == merges
    types = fields["tokenizer.ggml.token_type"].contents()
    special = {t["id"] for t in tok["added_tokens"] if t["special"]}
    assert {i for i, t in enumerate(types) if t == 3} == special
    assert fields["tokenizer.chat_template"].contents() == tokenizer.chat_template
    assert fields["tokenizer.ggml.bos_token_id"].contents() == tokenizer.bos_token_id
    assert fields["tokenizer.ggml.eos_token_id"].contents() == tokenizer.eos_token_id
    assert fields["llama.rope.freq_base"].contents() == 100000.0
    # transformers' own GGUF tokenizer conversion encodes as the checkpoint's tokenizer does
    from_gguf = AutoTokenizer.from_pretrained(str(exported), gguf_file="smollm2-q8_0.gguf")
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    assert from_gguf(TEXT).input_ids == tokenizer(TEXT).input_ids
    assert from_gguf.apply_chat_template(messages, add_generation_prompt=True) == (
        tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    )


# Where an export of the download may differ from the upstream file: the weight type, and the
# note that squash wrote it (docs/export_chat_eval.md lists these).
DIFFERENT_BY_DESIGN = {"general.file_type", "general.description"}


def _fields(path):
    fields = gguf.GGUFReader(path).fields
    return {k: f.contents() for k, f in fields.items() if not k.startswith("GGUF.")}


def test_metadata_equals_the_upstream_gguf_key_by_key(exported, smollm2_upstream_gguf):
    import squash

    ours, upstream = _fields(exported / "smollm2-q8_0.gguf"), _fields(smollm2_upstream_gguf)
    assert upstream["tokenizer.ggml.pre"] == "smollm" and upstream["general.file_type"] == 3
    assert set(ours) == set(upstream) | {"general.description"}
    differ = {k for k in upstream if ours[k] != upstream[k]}
    assert differ == {"general.file_type"}, {k: (ours[k], upstream[k]) for k in differ}
    assert ours["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    assert ours["general.description"] == (
        f"GGUF written by squash {squash.__version__} from the Hugging Face checkpoint "
        "smollm2-135m-instruct"
    )
    readers = [gguf.GGUFReader(p) for p in (exported / "smollm2-q8_0.gguf", smollm2_upstream_gguf)]
    names = [[t.name for t in r.tensors] for r in readers]
    assert sorted(names[0]) == sorted(names[1])


def test_the_downloaded_tokenizer_splits_digits_as_smollm2_does(tokenizer):
    """GPT-2's split alone (what transformers' GGUF conversion writes) would keep the space of
    an indented number with the number; SmolLM2's pre-tokenizer splits each digit first."""
    assert tokenizer.tokenize("\n        12") == ["ĊĠĠĠĠĠĠĠĠ", "1", "2"]
    assert tokenizer.tokenize("x ²") == ["x", "Ġ", "Â²"]
    assert tokenizer.decode(tokenizer("Hi , you !").input_ids) == "Hi , you !"


def test_chat_greedy_tokens_equal_transformers_generate(smollm2_checkpoint, tokenizer):
    chat = load_checkpoint(smollm2_checkpoint)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = chat.prompt_ids(messages)
    ref_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ref_prompt = ref_prompt["input_ids"] if hasattr(ref_prompt, "keys") else ref_prompt
    assert prompt == list(ref_prompt)
    got = list(chat.generate(prompt, 24))
    out = _hf(smollm2_checkpoint).generate(
        torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
    )[0, len(prompt):].tolist()  # fmt: skip
    ref = out[: out.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in out else out
    assert got == ref and "Paris" in tokenizer.decode(got)
