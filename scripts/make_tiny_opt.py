"""Write the tiny random-init OPT that ships in ``assets/tiny_opt``.

Usage::

    python scripts/make_tiny_opt.py                 # rewrites assets/tiny_opt
    python scripts/make_tiny_opt.py --out-dir /tmp/tiny_opt

From ``assets/tiny_opt/corpus.txt`` (hand-written English text) it writes, deterministically:

- ``alpaca_tiny.json``: 200 short instruction/input/output records from simple templated tasks;
- ``vocab.json``, ``merges.txt``: a GPT-2-style byte-level BPE vocabulary of 1024 tokens trained
  with ``tokenizers`` on the corpus and the records, special tokens first in OPT's order
  (``<s>`` = 0, ``<pad>`` = 1, ``</s>`` = 2, ``<unk>`` = 3);
- ``tokenizer_config.json``: so that ``transformers.AutoTokenizer`` loads it as OPT's tokenizer;
- ``config.json``, ``model.safetensors``, ``generation_config.json``: a seeded random-init
  ``transformers.OPTForCausalLM`` shaped like OPT-350m in miniature (post-LayerNorm,
  token embeddings of width 64 with ``project_in``/``project_out``, hidden 128, 2 layers, 4 heads,
  MLP 256, 256 positions), stored in float16 as the published OPT checkpoints are. Every
  parameter, biases and LayerNorms included, gets seeded noise so that no weight is trivial.

The sizes are those of ``squash.models.opt.opt_tiny``.
"""

import argparse
import json
import random
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "tiny_opt"
SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>"]
VOCAB_SIZE = 1024
SEED = 0
MODEL_CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    num_hidden_layers=2,
    ffn_dim=256,
    num_attention_heads=4,
    max_position_embeddings=256,
    word_embed_proj_dim=64,
    do_layer_norm_before=False,
    pad_token_id=1,
    bos_token_id=2,
    eos_token_id=2,
)

_OPPOSITES = [("hot", "cold"), ("early", "late"), ("long", "short"), ("warm", "cool"),
              ("open", "closed"), ("full", "empty"), ("old", "new"), ("heavy", "light"),
              ("slow", "fast"), ("north", "south"), ("first", "last"), ("small", "large")]
_CAPITALS = [("France", "Paris"), ("Spain", "Madrid"), ("Germany", "Berlin"), ("Italy", "Rome"),
             ("Japan", "Tokyo"), ("Portugal", "Lisbon"), ("Norway", "Oslo"), ("Egypt", "Cairo"),
             ("Canada", "Ottawa"), ("Greece", "Athens"), ("Ireland", "Dublin")]
_PLURALS = [("box", "boxes"), ("book", "books"), ("city", "cities"), ("leaf", "leaves"),
            ("child", "children"), ("bridge", "bridges"), ("tomato", "tomatoes"),
            ("bench", "benches"), ("boat", "boats"), ("story", "stories"), ("mouse", "mice")]
_WORDS = ["garden", "bridge", "river", "bread", "window", "library", "weather", "number", "story",
          "pigeon", "harbour", "flower", "kitchen", "station", "device", "salad", "language"]
_PHRASES = ["the cat sat on the mat", "we walked to the river", "bread is patient",
            "the train was late", "bees make honey", "read all the instructions",
            "the library opens at nine", "she opened the door"]
_COLOURS = ["red", "green", "blue", "yellow", "orange", "brown", "grey", "black"]  # fmt: skip


def _record(rng: random.Random) -> tuple:
    """One (instruction, input, output) triple of a randomly chosen task."""
    task = rng.randrange(10)
    if task == 0:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return "Add the two numbers.", f"{a} and {b}", str(a + b)
    if task == 1:
        phrase = rng.choice(_PHRASES)
        return "Reverse the order of the words.", phrase, " ".join(phrase.split()[::-1])
    if task == 2:
        word, opposite = rng.choice(_OPPOSITES)
        return "Give the opposite of the word.", word, opposite
    if task == 3:
        k = rng.randint(0, 999)
        return "Is the number even or odd?", str(k), "Even." if k % 2 == 0 else "Odd."
    if task == 4:
        noun, plural = rng.choice(_PLURALS)
        return "Write the plural of the noun.", noun, plural
    if task == 5:
        country, capital = rng.choice(_CAPITALS)
        return "Name the capital city of the country.", country, capital + "."
    if task == 6:
        word = rng.choice(_WORDS)
        return "Convert the word to upper case.", word, word.upper()
    if task == 7:
        word = rng.choice(_WORDS)
        return "Count the letters in the word.", word, str(len(word))
    if task == 8:
        return "Name a colour.", "", rng.choice(_COLOURS).capitalize() + "."
    a, b = rng.randint(0, 500), rng.randint(0, 500)
    return "Which number is larger?", f"{a} or {b}", str(max(a, b))


def make_records(n: int = 200, seed: int = SEED) -> list:
    """``n`` alpaca-style records from simple templated tasks, deterministic for a seed."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        instruction, input_, output = _record(rng)
        records.append({"instruction": instruction, "input": input_, "output": output})
    return records


def train_tokenizer(texts: list, out_dir: Path) -> None:
    """Train the byte-level BPE vocabulary and write ``vocab.json``/``merges.txt``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"Trained {tokenizer.get_vocab_size()} tokens, expected {VOCAB_SIZE}: "
            "the corpus is too small"
        )
    tokenizer.model.save(str(out_dir))  # vocab.json, merges.txt
    # Key order of vocab.json by id, so the file diffs well.
    vocab = json.loads((out_dir / "vocab.json").read_text(encoding="utf-8"))
    vocab = dict(sorted(vocab.items(), key=lambda kv: kv[1]))
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    tokenizer_config = {
        "tokenizer_class": "GPT2Tokenizer",
        "add_bos_token": True,
        "add_prefix_space": False,
        "errors": "replace",
        "bos_token": "</s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "model_max_length": MODEL_CONFIG["max_position_embeddings"],
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def make_model(out_dir: Path) -> None:
    """Save the seeded random-init ``OPTForCausalLM`` (float16, safetensors)."""
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(SEED)
    model = OPTForCausalLM(OPTConfig(**MODEL_CONFIG))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    model.to(torch.float16).save_pretrained(out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", type=Path, default=ASSETS, help="default: assets/tiny_opt")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)

    corpus = (ASSETS / "corpus.txt").read_text(encoding="utf-8")
    records = make_records()
    (args.out_dir / "alpaca_tiny.json").write_text(json.dumps(records, indent=1) + "\n")
    texts = corpus.split("\n\n") + [" ".join(r.values()) for r in records]
    train_tokenizer(texts, args.out_dir)
    make_model(args.out_dir)
    print(f"Wrote the tiny OPT to {args.out_dir}")


if __name__ == "__main__":
    main()
