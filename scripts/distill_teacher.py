"""A teacher worth distilling, for the tiny OPT: a generated corpus and a model trained on it.

    python scripts/distill_teacher.py /tmp/squash/teacher     # about a minute on 2 CPU cores

Writes ``OUT/corpus.jsonl`` (one ``{"text": ...}`` record a line; the first ``TRAIN`` records to
train on, the rest held out) and, beside it, an OPT checkpoint in HF format (``config.json``,
``model.safetensors`` and the tiny OPT's tokenizer files): the shipped tiny OPT's architecture,
trained from scratch with transformers (not squash) on the training records. Prints the held-out
loss next to the corpus's entropy rate and the uniform loss.

Why generated text: distillation can only beat plain cross-entropy where the teacher's soft
predictions say more than the data's hard labels. On the templated records of
``assets/tiny_opt/alpaca_tiny.json`` a trained model predicts its labels almost surely (held-out
loss 0.4), so the two coincide. Here every word is drawn from a fixed random successor
distribution (a word-bigram chain, about 1.7 nats a word over 200 words that are one token each
in the tiny OPT's vocabulary), so the labels are noisy samples while a trained teacher's
predictions approach the distribution itself. ``random.Random`` makes the corpus the same on
every machine and Python version.

``init_std=0.2`` (the tiny OPT's is 0.02) makes NF4 cost something measurable: from the default
init the linear layers hold so little of what the model learned that its NF4 copy is within 0.2%
of its perplexity.
"""

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path
from typing import List, Tuple

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "assets" / "tiny_opt"
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")
RECORDS, TRAIN = 3000, 2600  # records in the corpus; the first TRAIN are the training split


def one_token_words() -> List[str]:
    """Lower-case words that the tiny OPT's tokenizer writes as one token after a space."""
    from squash.models.opt import opt_tokenizer

    tok = opt_tokenizer(str(TINY / "vocab.json"), str(TINY / "merges.txt"))
    vocab = json.loads((TINY / "vocab.json").read_text())
    words = (k[1:] for k in vocab if k.startswith("Ġ") and k[1:].isascii() and k[1:].isalpha())
    return sorted(w for w in words if w.islower()
                  and len(tok.encode(" " + w, add_bos=False, add_eos=False)) == 1)


def write_corpus(path: Path, records: int = RECORDS, words: int = 200, successors: int = 8,
                 seed: int = 0) -> float:
    """Write the word-bigram corpus to ``path``; return its entropy rate in nats a word (the
    mean over words of the successor distribution's entropy)."""
    rng = random.Random(seed)
    vocab = sorted(rng.sample(one_token_words(), words))
    succ = [rng.sample(range(words), successors) for _ in range(words)]
    weights = []
    for _ in range(words):  # Dirichlet(1, ..., 1): normalised exponentials
        e = [rng.expovariate(1.0) for _ in range(successors)]
        total = sum(e)
        weights.append([x / total for x in e])
    lines = []
    for _ in range(records):
        w = rng.randrange(words)
        text = [vocab[w]]
        for _ in range(rng.randrange(20, 40)):
            w = rng.choices(succ[w], weights=weights[w])[0]
            text.append(vocab[w])
        lines.append(json.dumps({"text": " ".join(text)}))
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    return sum(-sum(p * math.log(p) for p in ws) for ws in weights) / words


def dataset_overrides(out: Path, held_out: bool = False) -> List[str]:
    """``tune run`` overrides that point a tiny config's dataset at the training records (or the
    held-out ones) of ``out/corpus.jsonl``."""
    split = f"train[{TRAIN}:]" if held_out else f"train[:{TRAIN}]"
    return ["dataset._component_=torchtune.datasets.text_completion_dataset",
            "dataset.source=json", f"dataset.data_files={Path(out) / 'corpus.jsonl'}",
            "dataset.column=text", "~dataset.train_on_input", f"dataset.split={split}"]


def records(tokenizer, corpus: Path, split: str) -> list:
    """The tokenized records of ``split`` (e.g. ``train[:2600]``), as the recipes read them."""
    from torchtune.datasets import text_completion_dataset

    return list(text_completion_dataset(tokenizer, source="json", data_files=str(corpus),
                                        split=split, column="text"))


def hf_loss(model, samples: list, batch_size: int = 32) -> float:
    """Token-weighted next-token cross-entropy of a transformers model on ``samples``, by hand in
    float64: the independent reference ``tests/recipes/test_squash_distill.py`` holds
    ``squash_eval`` (:func:`squash.training.heldout.token_loss`) against, so not computed by it."""
    from torchtune.data import padded_collate_sft

    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(samples), batch_size):
            batch = padded_collate_sft(samples[i : i + batch_size], padding_idx=1)
            logits = model(batch["tokens"]).logits[:, :-1].double()
            labels = batch["labels"][:, 1:]
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                     ignore_index=-100, reduction="sum").item()
            count += int((labels != -100).sum())
    return total / count


def train_teacher(out: Path, steps: int = 1000, lr: float = 1e-3, batch_size: int = 32,
                  init_std: float = 0.2, seed: int = 0) -> Tuple[float, float]:
    """Write the corpus and a teacher trained on it to ``out``; return (held-out loss, corpus
    entropy rate in nats a word)."""
    import transformers

    from squash.models.opt import opt_tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    entropy = write_corpus(out / "corpus.jsonl")
    tok = opt_tokenizer(str(TINY / "vocab.json"), str(TINY / "merges.txt"), max_seq_len=128)
    train = records(tok, out / "corpus.jsonl", f"train[:{TRAIN}]")
    held = records(tok, out / "corpus.jsonl", f"train[{TRAIN}:]")
    cfg = transformers.OPTConfig.from_pretrained(TINY, init_std=init_std, dropout=0.0,
                                                 attention_dropout=0.0)
    torch.manual_seed(seed)
    model = transformers.OPTForCausalLM(cfg).float()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    from torchtune.data import padded_collate_sft

    start = time.perf_counter()
    for step in range(steps):
        idx = torch.randperm(len(train), generator=g)[:batch_size].tolist()
        batch = padded_collate_sft([train[i] for i in idx], padding_idx=tok.pad_id)
        logits = model(batch["tokens"]).logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                               batch["labels"][:, 1:].reshape(-1), ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad()
        for group in opt.param_groups:  # cosine decay to 0
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * (step + 1) / steps))
        if (step + 1) % 100 == 0:
            print(f"teacher step {step + 1}/{steps}: loss {loss.item():.4f} "
                  f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    model.eval().save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(TINY / name, out / name)
    return hf_loss(model, held), entropy


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="directory for corpus.jsonl and the teacher")
    args = parser.parse_args(argv)
    held, entropy = train_teacher(args.out)
    print(f"held-out loss {held:.4f} (perplexity {math.exp(held):.2f}); uniform "
          f"{math.log(1024):.4f}; corpus entropy {entropy:.3f} nats a word")
    print(f"train on: dataset.data_files={args.out / 'corpus.jsonl'} dataset.split=train[:{TRAIN}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
