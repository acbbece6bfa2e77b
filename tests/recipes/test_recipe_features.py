"""torchtune's training features in squash_finetune give the losses of the plain run (the same
math computed another way), and other data formats train what a hand computation says."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import PINNED, REPO, logged

TINY = REPO / "assets" / "tiny_opt"
FOUR = ["epochs=1", "max_steps_per_epoch=4"]


@pytest.mark.parametrize(
    "overrides, env",
    [
        (["enable_activation_checkpointing=True"], {}),
        (["batch_size=2", "gradient_accumulation_steps=2"], {}),  # the same 4 samples a step
        (["compile=True"], {"TORCH_COMPILE_BACKEND": "aot_eager"}),  # traces the FFI ops
        (["lora_plus_lr_ratio=1.0"], {}),  # LoRA+ at ratio 1: two groups at one lr
    ],
    ids=["activation_checkpointing", "gradient_accumulation", "compile", "lora_plus_ratio_1"],
)
@pytest.mark.slow
def test_feature_gives_the_losses_of_the_plain_run(run, tmp_path, overrides, env):
    run(tmp_path, *FOUR, *overrides, env=env)
    assert logged(tmp_path) == pytest.approx(PINNED, rel=2e-6)


@pytest.mark.slow
def test_lora_plus_ratio_reaches_the_optimizer(run, tmp_path):
    """At ratio 16 the first step (before any update) is the plain run's and the later ones are
    not: the key reaches the optimizer (the groups' arithmetic: tests/training/test_lora_plus.py)."""
    run(tmp_path, *FOUR, "lora_plus_lr_ratio=16")
    losses = logged(tmp_path)
    assert losses[1] == pytest.approx(PINNED[1], rel=2e-6)
    assert all(abs(losses[s] - PINNED[s]) > 1e-4 for s in (3, 4))


@pytest.mark.slow
def test_packed_text_completion_data_first_step_equals_a_hand_computation(run, tmp_path):
    from torchtune.data import padded_collate_packed
    from torchtune.datasets import text_completion_dataset

    from squash.models.opt import OPTCheckpointer, opt_tokenizer, qlora_opt_tiny

    dataset = ["dataset._component_=torchtune.datasets.text_completion_dataset",
               "dataset.source=text", f"dataset.data_files={TINY / 'corpus.txt'}",
               "dataset.packed=True", "~dataset.split", "shuffle=False", "tokenizer.max_seq_len=64"]
    run(tmp_path, "epochs=1", "max_steps_per_epoch=2", *dataset)
    losses = logged(tmp_path)
    assert sorted(losses) == [1, 2]

    tok = opt_tokenizer(str(TINY / "vocab.json"), str(TINY / "merges.txt"), max_seq_len=64)
    ds = text_completion_dataset(tok, source="text", data_files=str(TINY / "corpus.txt"),
                                 packed=True)
    batch = padded_collate_packed([ds[i] for i in range(4)])
    assert batch["tokens"].shape == (4, 64)  # packed: every row is full
    model = qlora_opt_tiny(["q_proj", "k_proj", "v_proj", "output_proj"], True, lora_rank=8)
    base = OPTCheckpointer(str(TINY), ["model.safetensors"], str(tmp_path / "hand"))
    model.load_state_dict(base.load_checkpoint()["model"], strict=False)
    with torch.no_grad():  # B = 0: the base's loss, with the packed documents' masks and positions
        logits = model(batch["tokens"], mask=batch["mask"], input_pos=batch["input_pos"])
    labels = batch["labels"][:, 1:]
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               ignore_index=-100).item()
    assert losses[1] == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
def test_local_jsonl_chat_data_first_step_equals_a_hand_computation(run, tmp_path):
    """torchtune's chat_dataset on a local JSONL file (ShareGPT style), loss on the replies."""
    import json

    from torchtune.data import padded_collate_sft
    from torchtune.datasets import chat_dataset

    from squash.models.opt import OPTCheckpointer, opt_tokenizer, qlora_opt_tiny

    records = json.loads((TINY / "alpaca_tiny.json").read_text())[:16]
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"conversations": [
        {"from": "human", "value": f"{r['instruction']} {r['input']}"},
        {"from": "gpt", "value": r["output"]},
    ]}) for r in records) + "\n")
    dataset = ["dataset._component_=torchtune.datasets.chat_dataset", "dataset.source=json",
               f"dataset.data_files={data}", "dataset.conversation_column=conversations",
               "dataset.conversation_style=sharegpt", "~dataset.packed", "shuffle=False"]
    run(tmp_path / "out", "epochs=1", "max_steps_per_epoch=1", *dataset)
    losses = logged(tmp_path / "out")

    tok = opt_tokenizer(str(TINY / "vocab.json"), str(TINY / "merges.txt"), max_seq_len=128)
    ds = chat_dataset(tok, source="json", data_files=str(data), split="train",
                      conversation_column="conversations", conversation_style="sharegpt")
    batch = padded_collate_sft([ds[i] for i in range(4)], padding_idx=tok.pad_id)
    assert (batch["labels"] != -100).sum() < (batch["tokens"] != tok.pad_id).sum() / 2
    model = qlora_opt_tiny(["q_proj", "k_proj", "v_proj", "output_proj"], True, lora_rank=8)
    base = OPTCheckpointer(str(TINY), ["model.safetensors"], str(tmp_path / "hand"))
    model.load_state_dict(base.load_checkpoint()["model"], strict=False)
    with torch.no_grad():
        logits = model(batch["tokens"])
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                               batch["labels"][:, 1:].reshape(-1), ignore_index=-100).item()
    assert losses[1] == pytest.approx(expected, rel=1e-5)
