"""Which skill can a short run teach SmolLM2-135M-Instruct? The base model's exact match on each
candidate task, before any fine-tuning (a task for the main job must start at <= 10%).

Candidates, each built at run time from what ships with Python and checked by a rule:
- ``date``: a spoken date to ISO 8601 (``squash.datasets.iso_dates``, its validation split);
- ``roman``: an integer in 1..3999 to Roman numerals;
- ``snake``: a camelCase name of the standard library (``getLogger``) to snake_case.

The base model (float32, transformers, greedy, its chat template, 20 new tokens) answers
``--n`` questions of each; an answer counts when, stripped, it equals the expected one.

    python benchmarks/task_screen.py --checkpoint-dir /tmp/squash/smollm2-135m-instruct
"""

import argparse
import importlib
import random
import re
import time
from pathlib import Path

import torch

from squash.datasets.iso_dates import QUESTION, iso_date_pairs

ROMAN = ((1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"), (50, "L"),
         (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I"))  # fmt: skip
CAMEL_MODULES = ("unittest", "logging", "xml.dom.minidom", "threading", "ctypes", "email.message",
                 "http.client", "optparse", "xml.sax.handler", "urllib.request", "asyncio",
                 "inspect")  # fmt: skip


def roman(n: int) -> str:
    out = ""
    for value, numeral in ROMAN:
        while n >= value:
            out, n = out + numeral, n - value
    return out


def snake(name: str) -> str:
    """``getLoggerClass`` -> ``get_logger_class``."""
    return re.sub(r"(?<!^)([A-Z])", r"_\1", name).lower()


def camel_names() -> list:
    """Every camelCase attribute name (``getLogger``) of :data:`CAMEL_MODULES` and their classes."""
    names = set()
    for m in CAMEL_MODULES:
        mod = importlib.import_module(m)
        for obj in [mod] + [v for v in vars(mod).values() if isinstance(v, type)]:
            names.update(a for a in dir(obj) if re.fullmatch(r"[a-z]+(?:[A-Z][a-z]+)+", a))
    return sorted(names)


def candidates(n: int) -> dict:
    rng = random.Random(0)
    return {
        "date": [(QUESTION.format(date=d), a) for d, a in iso_date_pairs("validation")[:n]],
        "roman": [(f"Write {k} in Roman numerals. Answer with the numeral only.", roman(k))
                  for k in rng.sample(range(1, 4000), n)],  # fmt: skip
        "snake": [(f"Convert the Python name {k} from camelCase to snake_case. Answer with the "
                   "name only.", snake(k))
                  for k in rng.sample(camel_names(), n)],  # fmt: skip
    }


def exact_match(model, tok, items, batch: int = 10):
    hits, shown = 0, []
    for i in range(0, len(items), batch):
        chunk = items[i : i + batch]
        texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                         add_generation_prompt=True) for q, _ in chunk]  # fmt: skip
        enc = tok(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=20, do_sample=False)
        for (_, want), row in zip(chunk, out[:, enc["input_ids"].shape[1] :]):
            got = tok.decode(row, skip_special_tokens=True).strip()
            hits += got == want
            shown.append((want, got))
    return hits, shown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint-dir", default="/tmp/squash/smollm2-135m-instruct")
    parser.add_argument("--n", type=int, default=50)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.checkpoint_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint_dir, dtype=torch.float32).eval()
    print(f"| task | exact match before fine-tuning | seconds | an answer |\n|---|---:|---:|---|")
    for name, items in candidates(args.n).items():
        t0 = time.perf_counter()
        hits, shown = exact_match(model, tok, items)
        want, got = shown[0]
        print(f"| {name} | {hits}/{len(items)} | {time.perf_counter() - t0:.0f} | "
              f"{got!r} for {want!r} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
