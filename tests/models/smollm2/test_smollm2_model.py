"""SmolLM2-135M-Instruct from ``squash download`` in squash's builders, against transformers'
``LlamaForCausalLM`` on the same checkpoint and torchao's NF4 with hand-computed block sizes."""

import gc

import pytest
import torch
from torchtune.training import FullModelHFCheckpointer

from squash.modules import SparseLoRALinear
from squash.nf4 import NF4Tensor, to_nf4

pytestmark = pytest.mark.smollm2

ALL_ATTN = ["q_proj", "k_proj", "v_proj", "output_proj"]
LINEARS = [f"attn.{n}" for n in ALL_ATTN] + ["mlp.w1", "mlp.w2", "mlp.w3"]
# (out, in) -> NF4 (block_size, scaler_block_size), by hand: 576x576 has 5184 blocks of 64 and
# 192x576 1728, whose largest divisor <= 256 is 216; the MLP's 13824 blocks take torchao's 256.
SIZES = {(576, 576): (64, 216), (192, 576): (64, 216), (1536, 576): (64, 256),
         (576, 1536): (64, 256)}  # fmt: skip


@pytest.fixture(scope="module")
def state_dict(smollm2_checkpoint, tmp_path_factory):
    """The checkpoint through torchtune's own HF checkpointer (Llama 3.2 key map)."""
    checkpointer = FullModelHFCheckpointer(
        checkpoint_dir=str(smollm2_checkpoint),
        checkpoint_files=["model.safetensors"],
        model_type="LLAMA3_2",
        output_dir=str(tmp_path_factory.mktemp("smollm2_out")),
    )
    return checkpointer.load_checkpoint()["model"]


def test_logits_equal_transformers(smollm2_checkpoint, state_dict):
    """fp32, 300 tokens: squash's smollm2_135m and lora_smollm2_135m (all seven linears, adapters
    at init) give transformers' logits; the tied checkpoint has no output key."""
    from transformers import LlamaForCausalLM

    from squash.models.smollm2 import lora_smollm2_135m, smollm2_135m

    assert "output.weight" not in state_dict and len(state_dict) == 1 + 30 * 9 + 1
    tokens = torch.randint(0, 49152, (1, 300), generator=torch.Generator().manual_seed(3))
    hf = LlamaForCausalLM.from_pretrained(str(smollm2_checkpoint), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(tokens).logits
    del hf
    model = smollm2_135m().eval()
    model.load_state_dict(state_dict)  # strict
    with torch.no_grad():
        assert (model(tokens) - want).abs().max().item() <= 1e-3
    del model
    lora = lora_smollm2_135m(ALL_ATTN, apply_lora_to_mlp=True).eval()
    missing, unexpected = lora.load_state_dict(state_dict, strict=False)
    assert not unexpected and missing and all("lora_" in k for k in missing)
    assert len(missing) == 30 * 7 * 2
    with torch.no_grad():
        assert (lora(tokens) - want).abs().max().item() <= 1e-3
    gc.collect()


@pytest.fixture(scope="module")
def torchao_reference(state_dict):
    """torchao's to_nf4 of each checkpoint linear with the hand-computed block sizes,
    dequantized (computed once, on first use, for both builders)."""
    cache = {}

    def reference(key):
        if key not in cache:
            w = state_dict[key]
            cache[key] = to_nf4(w, *SIZES[tuple(w.shape)]).get_original_weight()
        return cache[key]

    return reference


@pytest.mark.parametrize("builder", ["qlora_smollm2_135m", "squash_smollm2_135m"])
def test_nf4_base_of_every_linear_equals_torchao(state_dict, torchao_reference, builder):
    """Every one of the 210 adapted bases dequantizes to exactly torchao's to_nf4 of the
    checkpoint weight with the hand-computed block sizes, after a state-dict load."""
    import squash.models.smollm2 as smollm2

    model = getattr(smollm2, builder)(ALL_ATTN, apply_lora_to_mlp=True)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    assert not unexpected and all("lora_" in k for k in missing)
    for i, layer in enumerate(model.layers):
        for name in LINEARS:
            module = layer.get_submodule(name)
            if builder.startswith("squash"):
                assert isinstance(module, SparseLoRALinear), name
            weight = module.weight
            assert isinstance(weight, NF4Tensor), (i, name)
            key = f"layers.{i}.{name}.weight"
            sizes = SIZES[tuple(state_dict[key].shape)]
            assert (weight.block_size, weight.scaler_block_size) == sizes, (i, name)
            assert torch.equal(weight.get_original_weight(), torchao_reference(key)), (i, name)
    # what a checkpoint saves of the model (the merged export's base): the same values, in the
    # model's dtype (fp32 here), not rounded to torchtune's bf16 default
    saved = model.state_dict()
    for key in (f"layers.{i}.{name}.weight" for i in (0, 29) for name in LINEARS):
        assert saved[key].dtype == torch.float32 and not isinstance(saved[key], NF4Tensor)
        assert torch.equal(saved[key], torchao_reference(key)), key
    del model, saved
    gc.collect()


def test_chat_template_equals_transformers(smollm2_checkpoint):
    """squash's tokenizer renders conversations as transformers' apply_chat_template does with
    the checkpoint's template (default system message, generation prompt), with HF's ids."""
    from torchtune.data import Message
    from transformers import AutoTokenizer

    from squash.models.smollm2 import smollm2_tokenizer

    tok = smollm2_tokenizer(str(smollm2_checkpoint))
    hf = AutoTokenizer.from_pretrained(str(smollm2_checkpoint))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (
        hf.bos_token_id, hf.eos_token_id, hf.pad_token_id,
    )  # fmt: skip
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"},
         {"role": "assistant", "content": "The capital of France is Paris."}],
        [{"role": "system", "content": "Answer in one word."},
         {"role": "user", "content": "  Leading spaces,\n\nblank lines\tand tabs "},
         {"role": "assistant", "content": "\nOkay"},
         {"role": "user", "content": "Ünïcödé ✓ 😀 and digits 12345"},
         {"role": "assistant", "content": "Yes."}],
    ]  # fmt: skip
    for conv in conversations:
        messages = [Message(m["role"], m["content"]) for m in conv]
        tokens, mask = tok.tokenize_messages(messages)
        assert tokens == list(hf.apply_chat_template(conv, tokenize=True, return_dict=False))
        assert len(mask) == len(tokens)
        prompt, _ = tok.tokenize_messages([*messages[:-1], Message("assistant", "")], add_eos=False)
        want = hf.apply_chat_template(
            conv[:-1], tokenize=True, add_generation_prompt=True, return_dict=False
        )
        assert prompt == list(want)
    # masks: the default system message and the user's are masked, the assistant's are not
    tokens, mask = tok.tokenize_messages(
        [Message("user", "Hi", masked=True), Message("assistant", "Hello")]
    )
    unmasked = [t for t, m in zip(tokens, mask) if not m]
    assert unmasked == hf("<|im_start|>assistant\nHello<|im_end|>\n")["input_ids"]
    assert tokens[-len(unmasked):] == unmasked


def test_torchtune_instruct_dataset_tokens_and_labels(smollm2_checkpoint, tmp_path):
    """torchtune's instruct_dataset with squash's tokenizer: the tokens are transformers'
    rendering of the (user, assistant) pair, the labels ignore all but the assistant's turn; a
    too-long sample is cut to max_seq_len ending in EOS."""
    import json

    from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, Message
    from torchtune.datasets import instruct_dataset
    from transformers import AutoTokenizer

    from squash.models.smollm2 import smollm2_tokenizer

    rows = [{"input": "Name a colour.", "output": "Blue."}]
    (tmp_path / "data.json").write_text(json.dumps(rows))
    tok = smollm2_tokenizer(str(smollm2_checkpoint), max_seq_len=64)
    hf = AutoTokenizer.from_pretrained(str(smollm2_checkpoint))
    ds = instruct_dataset(tok, source="json", data_files=str(tmp_path / "data.json"), split="train")
    sample = ds[0]
    conv = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]
    assert sample["tokens"] == list(hf.apply_chat_template(conv, tokenize=True, return_dict=False))
    answer = hf("<|im_start|>assistant\nBlue.<|im_end|>\n")["input_ids"]
    labels = [int(x) for x in sample["labels"]]
    assert labels[-len(answer):] == answer
    assert set(labels[: -len(answer)]) == {CROSS_ENTROPY_IGNORE_IDX}
    short = smollm2_tokenizer(str(smollm2_checkpoint), max_seq_len=10)
    tokens, mask = short.tokenize_messages([Message("assistant", "hello there " * 10)])
    full, _ = tok.tokenize_messages([Message("assistant", "hello there " * 10)])
    assert tokens == full[:9] + [tok.eos_id] and len(mask) == 10 and mask[-1]
