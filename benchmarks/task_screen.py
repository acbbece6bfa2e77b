"""Which skill can a short run teach SmolLM2-135M-Instruct? The base model's exact match on each
candidate task, before any fine-tuning (a task for the main job must start at <= 10%).

Candidates, each built at run time from what ships with Python and checked by a rule:
- ``date``: a spoken date to ISO 8601 (``squash.datasets.iso_dates``, its validation split);
- ``roman``: an integer in 1..3999 to Roman numerals;
- ``snake``: a camelCase name of the standard library (``getLogger``) to snake_case.

The base model (float32, transformers, greedy, its chat template, 20 new tokens) answers
``--n`` questions of each; an answer counts when, stripped, it equals the expected one.

    python benchmarks/task_screen.py --checkpoint-dir /tmp/squash/smollm2-135m-instruct

``--finetune`` instead runs the main job (``configs/smollm2_135m.yaml``, ``tune run``) on each
task: its validation split is the 50 questions screened above, its train split every other
question of the task (the dates: ``squash.datasets.iso_dates``'s splits), and prints the
held-out exact match before and after, the held-out loss and the run's wall time (``--set``
passes more overrides, e.g. ``dtype=fp32``).
"""

import argparse
import importlib
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import Any, List, Optional, Tuple

import torch

from squash.datasets._chat import QuestionAnswerDataset
from squash.datasets.iso_dates import QUESTION, iso_date_pairs

HERE = Path(__file__).resolve().parent
HELDOUT = 50  # the validation questions of each task: candidates(HELDOUT)

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


def candidate_split(task: str, split: str) -> List[Tuple[str, str]]:
    """``(question, answer)`` pairs of one split of ``roman`` or ``snake``: ``validation`` is
    :func:`candidates`'s :data:`HELDOUT` questions, ``train`` every other question of the task
    (numbers 1..3999 or the camelCase names), shuffled with a fixed seed.

    Raises:
        ValueError: another task or split.
    """
    if task not in ("roman", "snake") or split not in ("train", "validation"):
        raise ValueError(f"task must be roman or snake and split train or validation, got "
                         f"{task!r}, {split!r}")  # fmt: skip
    held = candidates(HELDOUT)[task]
    if split == "validation":
        return held
    if task == "roman":
        taken = {int(q.split()[1]) for q, _ in held}
        rest = [(f"Write {k} in Roman numerals. Answer with the numeral only.", roman(k))
                for k in range(1, 4000) if k not in taken]  # fmt: skip
    else:
        taken = {q.split()[4] for q, _ in held}
        rest = [(f"Convert the Python name {k} from camelCase to snake_case. Answer with the "
                 "name only.", snake(k)) for k in camel_names() if k not in taken]  # fmt: skip
    random.Random(1).shuffle(rest)
    return rest


class CandidateDataset(QuestionAnswerDataset):
    """One split of ``roman`` or ``snake`` (:func:`candidate_split`) as the recipes' datasets
    are: a chat, the question masked out of the loss."""

    QUESTION, SUBJECT = "{question}", "question"

    def __init__(self, tokenizer: Any, task: str, split: str = "train",
                 max_samples: Optional[int] = None) -> None:  # fmt: skip
        super().__init__(tokenizer, candidate_split(task, split), max_samples)


def candidate_dataset(tokenizer: Any, task: str, split: str = "train",
                      max_samples: Optional[int] = None) -> CandidateDataset:  # fmt: skip
    """Builder for configs: ``dataset: {_component_: task_screen.candidate_dataset, task: roman}``
    (``benchmarks/`` on ``PYTHONPATH``)."""
    return CandidateDataset(tokenizer, task, split, max_samples)


def finetune(task: str, checkpoint_dir: str, out: Path, extra: List[str]) -> dict:
    """The main job on ``task`` through ``tune run``; what it printed and its wall time."""
    sys.path.insert(0, str(HERE))
    from main_job import run_recipe

    if task == "date":
        data = {"_component_": "squash.datasets.iso_dates_dataset"}
    else:
        data = {"_component_": "task_screen.candidate_dataset", "task": task}
    sets = [f"output_dir={out / task}", f"checkpointer.checkpoint_dir={checkpoint_dir}",
            f"tokenizer.path={checkpoint_dir}", "heldout.max_new_tokens=20",
            f"heldout.dataset.max_samples={HELDOUT}", f"heldout.exact_match_samples={HELDOUT}"]  # fmt: skip
    for block, split in (("dataset", "train"), ("heldout.dataset", "validation")):
        sets += [f"{block}.{k}={v}" for k, v in data.items()] + [f"{block}.split={split}"]
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    return run_recipe(HERE.parent / "configs" / "smollm2_135m.yaml", sets + extra,
                      {"PYTHONPATH": path})  # fmt: skip


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
    parser.add_argument("--finetune", action="store_true", help="run the main job on each task")
    parser.add_argument("--tasks", nargs="+", default=["date", "roman", "snake"])
    parser.add_argument("--out", type=Path, default=Path("/tmp/squash/task_screen"))
    parser.add_argument("--set", nargs="*", default=[], help="more key=value overrides")
    args = parser.parse_args()
    if args.finetune:
        print("| task | exact match before | after | held-out loss before -> after | seconds | "
              "the first answer after |\n|---|---:|---:|---|---:|---|")  # fmt: skip
        for task in args.tasks:
            r = finetune(task, args.checkpoint_dir, args.out, args.set)
            print(f"| {task} | {r['exact_before']}/{r['of']} | {r['exact_after']}/{r['of']} | "
                  f"{r['loss_before']:.4f} -> {r['loss_after']:.4f} | {r['wall_s']:.0f} | "
                  f"{r['answer_after']!r} |", flush=True)  # fmt: skip
        return
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
