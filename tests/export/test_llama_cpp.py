"""Every GGUF file squash writes, run by llama.cpp itself (llama-cpp-python built from source:
``pip install -e ".[gguf-check]"``), F16 and Q8_0, for the tiny test model of each exported
architecture (Llama with GPT-2's tokenizer split, Llama 3, Qwen 2) and for SmolLM2-135M-Instruct
(the download, and a short fine-tune saved adapter-only): llama.cpp loads it without a warning
(SmolLM2: none the upstream GGUF does not print too), tokenizes as the checkpoint's
``tokenizer.json``, stops at the checkpoint's end tokens, and computes what transformers computes
on the file's own weights (read back by transformers' GGUF loader, in the checkpoint's
architecture): next-token argmax over a few hundred positions, perplexity within 1%, and (F16)
the same greedy chat answers.

Measured (Xeon host, llama-cpp-python 0.3.36, one thread; docs/export_chat_eval.md): F16 agrees
at 99.5-100% of positions (a flip at a gap of 0.005 between transformers' two best; largest
logit difference 0.035, float16 activations in llama.cpp); Q8_0, whose products llama.cpp
computes on activations rounded to 8 bits per block of 32, moves logits by up to 1.2 and agrees
at 94-97% (SmolLM2), with perplexity within 0.3%.
"""

import math
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import torch

try:
    import llama_cpp  # noqa: F401
except (ImportError, OSError, RuntimeError) as err:  # not installed, or its library fails to load
    pytest.skip(
        f"llama.cpp cannot be imported ({type(err).__name__}: {err}); `pip install -e "
        "'.[gguf-check]'` builds llama-cpp-python from source (10-30 minutes on 2 cores, then "
        "kept in pip's wheel cache)",
        allow_module_level=True,
    )
from tests.export.llama_cpp_model import LlamaCppModel  # noqa: E402

import gguf  # noqa: E402
from squash.export import export_gguf  # noqa: E402

pytestmark = pytest.mark.gguf_check

# Text the tokenizers split differently (digits after indentation, a superscript after a space,
# contractions, unicode, a special token); and chat prompts the answers are compared on.
TRICKY = [
    "def f(x):\n        return 12 * x  # 1234 x ²\n",
    "It's 3:45 p.m., isn't it? Ünïcödé: 漢字 — “quotes” ½",
    "<|im_start|>user\nHi<|im_end|>\n",
]
PROMPTS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write one sentence about the sea.",
]
# Next-token argmax agreement with transformers at least: F16, where llama.cpp rounds activations
# to float16 (logits within 2% of their spread, asserted; a flip needs a near-tie, measured 0-1 of
# 216 positions); Q8_0, where llama.cpp also rounds activations to 8 bits per block of 32 (logits
# move by up to 1.2, measured 94-97% agreement on SmolLM2).
MIN_AGREEMENT = {"f16": 0.98, "q8_0": 0.9}


def _reference(source: Path, gguf_path: Path):
    """transformers' model of ``source``'s config.json holding the weights of ``gguf_path`` as
    transformers' GGUF loader reads them (dequantized, llama.cpp's layout undone): what the
    file holds, computed in float32 by another program."""
    from transformers import AutoModelForCausalLM

    from_file = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(from_file.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model.eval()


def _tokenizer(source: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(source))


def _eos_ids(source: Path, tokenizer) -> set:
    from squash.chat import _eos_ids

    return set(_eos_ids(source, tokenizer))


def _nll(logits: np.ndarray, ids: List[int]) -> float:
    loss = torch.nn.functional.cross_entropy(torch.tensor(logits[:-1]), torch.tensor(ids[1:]))
    return loss.item()


def check_in_llama_cpp(gguf_path: Path, source: Path, text: str, dtype: str, max_new: int,
                       allowed_warnings: List[str] = ()) -> Dict[str, float]:  # fmt: skip
    """Load ``gguf_path`` in llama.cpp and check it against transformers on its own weights
    (``source``: the checkpoint's config and tokenizer). Returns what was measured."""
    tokenizer = _tokenizer(source)
    llm = LlamaCppModel(gguf_path)
    try:
        assert [w for w in llm.warnings if w not in allowed_warnings] == [], llm.warnings
        assert _eos_ids(source, tokenizer) <= llm.end_of_generation()
        for sample in [text, *TRICKY]:
            want = tokenizer(sample, add_special_tokens=False).input_ids
            assert llm.tokenize(sample) == want, sample

        ref_model = _reference(source, gguf_path)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        ids = ids[: min(llm.n_ctx, ref_model.config.max_position_embeddings)]
        assert len(ids) >= 200
        with torch.no_grad():
            ref = ref_model(torch.tensor([ids])).logits[0].numpy()
        got = llm.logits(ids)
        agree = ref.argmax(-1) == got.argmax(-1)
        top2 = np.sort(ref, axis=-1)[:, -2:]
        gaps = (top2[:, 1] - top2[:, 0])[~agree]
        ppl_ref, ppl_got = math.exp(_nll(ref, ids)), math.exp(_nll(got, ids))
        measured = {
            "positions": len(ids), "agree": float(agree.mean()), "ppl_transformers": ppl_ref,
            "ppl_llama_cpp": ppl_got, "max_abs_logit_diff": float(np.abs(ref - got).max()),
            "logit_std": float(ref.std()), "flipped_top2_gaps": gaps.round(4).tolist(),
        }  # fmt: skip
        print(f"{gguf_path.name}: {measured}")
        assert abs(ppl_got / ppl_ref - 1) <= 0.01, measured
        assert agree.mean() >= MIN_AGREEMENT[dtype], measured
        if dtype == "q8_0":
            return measured
        # float16 activations (2^-11 relative): the logits stay within 2% of their spread
        assert measured["max_abs_logit_diff"] <= 0.02 * measured["logit_std"], measured

        template = gguf.GGUFReader(gguf_path).fields["tokenizer.chat_template"].contents()
        assert template == tokenizer.chat_template
        for prompt in PROMPTS:
            messages = [{"role": "user", "content": prompt}]
            rendered = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            prompt_ids = tokenizer(rendered, add_special_tokens=False).input_ids
            assert llm.tokenize(rendered) == prompt_ids
            answer = llm.greedy(prompt_ids, max_new)
            stop = sorted(llm.end_of_generation())
            with torch.no_grad():
                out = ref_model.generate(
                    torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids)),
                    max_new_tokens=max_new, do_sample=False, eos_token_id=stop,
                    pad_token_id=tokenizer.eos_token_id,
                )[0, len(prompt_ids):].tolist()  # fmt: skip
            out = [t for t in out if t not in stop]
            assert answer == out, (prompt, tokenizer.decode(answer), tokenizer.decode(out))
            measured[prompt] = tokenizer.decode(answer)
        return measured
    finally:
        llm.close()


TEXT = (  # prose written for this test: a few hundred tokens
    "The harbour town woke slowly. Fishing boats came in with the tide, their hulls heavy with "
    "the night's catch, and the gulls followed them in wide, noisy circles. On the quay, an old "
    "man mended nets with quick, patient fingers, while two children raced between the crates "
    "and argued about which boat was fastest. Behind them the bakery opened its shutters, and "
    "the smell of warm bread drifted down the narrow street towards the water. By nine o'clock "
    "the market was full. Farmers from the hills sold apples, cheese and honey; a woman in a "
    "green coat sold flowers she had grown in her garden; and a young musician played the "
    "violin beside the fountain, hoping for a few coins. The ferry to the island left twice a "
    "day, at 7:15 and at 16:40, and if you missed it you simply waited, drank a cup of coffee "
    "and watched the harbour. In winter the storms were fierce, and the waves broke over the "
    "sea wall, but in summer the water was calm and clear."
)


# ---- the tiny models of each architecture -------------------------------------------------------
@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
@pytest.mark.parametrize("family", ["tiny_llama", "tiny_llama3", "tiny_qwen2"])
def test_tiny_models_in_llama_cpp(family, dtype, request, tmp_path):
    source = request.getfixturevalue(family)
    path = export_gguf(source, dtype, tmp_path / f"{family}-{dtype}.gguf")
    check_in_llama_cpp(path, source, TEXT, dtype, max_new=12)


# ---- SmolLM2-135M-Instruct ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def upstream_warnings(smollm2_upstream_gguf) -> List[str]:
    """What llama.cpp warns about when it loads the upstream SmolLM2 GGUF (and its end tokens)."""
    llm = LlamaCppModel(smollm2_upstream_gguf)
    try:
        return llm.warnings, llm.end_of_generation()
    finally:
        llm.close()


@pytest.mark.smollm2
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_smollm2_download_in_llama_cpp(dtype, smollm2_checkpoint, upstream_warnings, tmp_path):
    path = export_gguf(smollm2_checkpoint, dtype, tmp_path / f"smollm2-{dtype}.gguf")
    warnings, eog = upstream_warnings
    check_in_llama_cpp(path, smollm2_checkpoint, TEXT, dtype, 32, allowed_warnings=warnings)
    llm = LlamaCppModel(path)
    try:
        assert llm.end_of_generation() == eog
    finally:
        llm.close()


@pytest.mark.smollm2
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_smollm2_finetune_in_llama_cpp(
    dtype, smollm2_finetune, smollm2_checkpoint, upstream_warnings
):
    """The fine-tune as the config saves it (adapter-only, merged by ``squash export``): the same
    tensors as the recipe's own export of its merged weights, and right in llama.cpp."""
    ours = gguf.GGUFReader(smollm2_finetune[dtype])
    recipes = gguf.GGUFReader(smollm2_finetune[f"recipe_{dtype}"])
    assert [t.name for t in ours.tensors] == [t.name for t in recipes.tensors]
    for a, b in zip(ours.tensors, recipes.tensors):
        assert a.tensor_type == b.tensor_type and np.array_equal(a.data, b.data), a.name
    warnings, _ = upstream_warnings
    check_in_llama_cpp(smollm2_finetune[dtype], smollm2_checkpoint, TEXT, dtype, 32,
                       allowed_warnings=warnings)  # fmt: skip
