"""opt_tokenizer against transformers' GPT-2 tokenizer and a from-scratch GPT-2 BPE; torchtune's
instruct, chat and packed datasets over the shipped tiny assets."""

import json
from functools import lru_cache

import pytest
import torch
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, Message, padded_collate_packed
from torchtune.datasets import alpaca_dataset, chat_dataset

from squash.models.opt import opt_tiny, opt_tokenizer

import transformers
import regex

MIXED_TEXT = (
    "Hello world!  The café costs 4.50€ — naïve résumé, 津波.\n\n"
    "new line\tTab   spaces   \n 12345 67 it's OK? don't_stop 3.14159\r\n"
    "    indented(code) {x: [1, 2]}  trailing  "
)


def _files(tiny_opt_dir):
    return str(tiny_opt_dir / "vocab.json"), str(tiny_opt_dir / "merges.txt")


@pytest.fixture
def tokenizer(tiny_opt_dir):
    return opt_tokenizer(*_files(tiny_opt_dir), max_seq_len=256)


def _reference_bpe(tiny_opt_dir):
    """GPT-2's byte-level BPE written out from its published description (OpenAI's encoder.py):
    split with GPT-2's regex, map bytes to printable characters, merge pairs by rank."""
    vocab_path, merges_path = _files(tiny_opt_dir)
    vocab = json.load(open(vocab_path, encoding="utf-8"))
    lines = open(merges_path, encoding="utf-8").read().split("\n")
    ranks = {tuple(line.split()): i for i, line in enumerate(lines[1:]) if line}
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in printable]
    byte_char = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(extra)}
    pattern = regex.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    )

    @lru_cache(maxsize=None)
    def bpe(word):
        parts = list(word)
        while len(parts) > 1:
            pairs = [(ranks.get(p, float("inf")), i) for i, p in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == float("inf"):
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        return tuple(parts)

    def encode(text):
        words = ("".join(byte_char[b] for b in w.encode("utf-8")) for w in pattern.findall(text))
        return [vocab[piece] for word in words for piece in bpe(word)]

    return encode


def test_matches_transformers_gpt2_tokenizer(tokenizer, tiny_opt_dir):
    vocab_path, merges_path = _files(tiny_opt_dir)
    hf = transformers.GPT2Tokenizer(
        vocab=vocab_path,
        merges=merges_path,
        bos_token="</s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        add_bos_token=True,
    )
    auto = transformers.AutoTokenizer.from_pretrained(tiny_opt_dir)
    text_with_special = MIXED_TEXT + " a </s> b<pad>"
    for text in (MIXED_TEXT, text_with_special, "", " ", "\n\n\n"):
        ours = tokenizer.encode(text, add_bos=True, add_eos=False)
        assert ours == hf(text)["input_ids"] == auto(text)["input_ids"], repr(text)
        assert ours[0] == 2
    assert tokenizer.encode("hi", add_bos=False, add_eos=True)[-1] == 2


def test_matches_reference_bpe_and_round_trips(tokenizer, tiny_opt_dir):
    reference = _reference_bpe(tiny_opt_dir)
    ids = tokenizer.encode(MIXED_TEXT, add_bos=False, add_eos=False)
    assert ids == reference(MIXED_TEXT)
    assert tokenizer.decode(ids) == MIXED_TEXT
    assert tokenizer.decode(tokenizer.encode(MIXED_TEXT)) == MIXED_TEXT
    assert tokenizer.decode([2, *ids, 1], skip_special_tokens=False).startswith("</s>Hello")
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (2, 2, 1)
    assert tokenizer.vocab_size == 1024 and tokenizer.stop_tokens == [2]


def test_tokenize_messages_masks_and_truncates(tiny_opt_dir):
    tokenizer = opt_tokenizer(*_files(tiny_opt_dir), max_seq_len=12)
    messages = [
        Message(role="user", content="Add the two numbers. 1 and 2\n", masked=True),
        Message(role="assistant", content="3"),
    ]
    full = opt_tokenizer(*_files(tiny_opt_dir))
    tokens, mask = full.tokenize_messages(messages)
    user = full.encode("Add the two numbers. 1 and 2\n", add_bos=False, add_eos=False)
    answer = full.encode("3", add_bos=False, add_eos=False)
    assert tokens == [2, *user, *answer, 2]
    assert mask == [True] * (1 + len(user)) + [False] * (len(answer) + 1)
    tokens, mask = tokenizer.tokenize_messages(messages * 4)
    assert len(tokens) == len(mask) == 12 and tokens[-1] == 2


def test_alpaca_dataset_yields_tokens_and_labels(tokenizer, tiny_opt_dir, tmp_path):
    dataset = alpaca_dataset(
        tokenizer,
        source="json",
        data_files=str(tiny_opt_dir / "alpaca_tiny.json"),
        split="train",
        train_on_input=False,
        cache_dir=str(tmp_path / "hf_cache"),
    )
    records = json.loads((tiny_opt_dir / "alpaca_tiny.json").read_text())
    assert len(dataset) == len(records) == 200
    for i in (0, 1, 57):
        sample = dataset[i]
        tokens, labels = sample["tokens"], sample["labels"]
        assert len(tokens) == len(labels) and tokens[0] == 2 and tokens[-1] == 2
        trained = [t for t, label in zip(tokens, labels) if label != CROSS_ENTROPY_IGNORE_IDX]
        assert trained == [*tokenizer.encode(records[i]["output"], add_bos=False, add_eos=False), 2]
        assert records[i]["instruction"] in tokenizer.decode(tokens)


def test_chat_dataset(tokenizer, tmp_path):
    turns = [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue."}]
    data = [{"conversations": turns}] * 3
    (tmp_path / "chat.json").write_text(json.dumps(data))
    dataset = chat_dataset(
        tokenizer,
        source="json",
        data_files=str(tmp_path / "chat.json"),
        conversation_column="conversations",
        conversation_style="sharegpt",
        split="train",
        cache_dir=str(tmp_path / "hf_cache"),
    )
    sample = dataset[0]
    pairs = zip(sample["tokens"], sample["labels"])
    trained = [t for t, label in pairs if label != CROSS_ENTROPY_IGNORE_IDX]
    assert tokenizer.decode(trained) == "Blue."


def test_packed_alpaca_positions_restart_per_sample(
    tokenizer, tiny_opt_dir, squash_loader, tmp_path
):
    """A pack from torchtune's PackedDataset, collated as recipes do, gives each sample the
    logits it gets alone: the model reads positions from the pack's input_pos."""
    dataset = alpaca_dataset(
        tokenizer,
        source="json",
        data_files=str(tiny_opt_dir / "alpaca_tiny.json"),
        split="train",
        packed=True,
        cache_dir=str(tmp_path / "hf_cache"),
    )
    batch = padded_collate_packed([dataset[0]])
    seq_lens = dataset[0]["seq_lens"].tolist()
    assert batch["input_pos"][0, seq_lens[0]] == 0
    model, _ = squash_loader(tiny_opt_dir, tmp_path / "out")
    assert model.max_seq_len == opt_tiny().max_seq_len
    with torch.no_grad():
        packed = model(batch["tokens"], mask=batch["mask"], input_pos=batch["input_pos"])
        start, checked = 0, 0
        for n in seq_lens:
            segment = batch["tokens"][:, start : start + n]
            # The pack's padding (positions not restarting) is not a sample; it has no labels.
            if (batch["labels"][:, start : start + n] != CROSS_ENTROPY_IGNORE_IDX).any():
                alone = model(segment)
                assert (packed[:, start : start + n] - alone).abs().max() <= 1e-4
                checked += 1
            start += n
        assert checked >= 2


def test_missing_or_broken_tokenizer_files_are_named(tmp_path):
    import shutil
    from pathlib import Path

    assets = Path(__file__).resolve().parents[3] / "assets" / "tiny_opt"
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    shutil.copy(assets / "vocab.json", vocab)
    with pytest.raises(FileNotFoundError, match=str(merges)):
        opt_tokenizer(str(vocab), str(merges))
    merges.write_text("#version: 0.2\nthis line has three parts\n")
    with pytest.raises(ValueError, match=str(merges)):
        opt_tokenizer(str(vocab), str(merges))
    shutil.copy(assets / "merges.txt", merges)
    vocab.write_text("{broken")
    with pytest.raises(ValueError, match=str(vocab)):
        opt_tokenizer(str(vocab), str(merges))
