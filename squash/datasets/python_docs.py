"""A real prose task built at run time from the standard library's own source: explain an API.

Each sample asks ``Explain logging.LogRecord.getMessage from Python's standard library.`` and the
answer is the opening prose of that function's or class's docstring, as CPython's developers
wrote it: two to four sentences, up to :data:`MAX_ANSWER_CHARS` characters, e.g. ``Return the
message for this LogRecord. Return the message for this LogRecord after merging any
user-supplied arguments with the message.`` Nothing is downloaded and nobody wrote the text for
squash; it is read with :mod:`ast` from the ``.py`` files of the running CPython's standard
library (nothing is imported or run), so what a split holds is fixed for one CPython release (the
numbers in squash's docs are CPython 3.11's). CPython is under the PSF License Agreement
(permissive; https://docs.python.org/3/license.html).

What counts as prose: the docstring's paragraphs are read from the top while they are plain text
(a paragraph with a doctest, a literal block ``::``, a bullet or field list, or one that ends in
``:`` stops the reading), their sentences joined with single spaces, and cut after the last whole
sentence within :data:`MAX_ANSWER_CHARS`; an item is kept when that leaves at least
:data:`MIN_SENTENCES` sentences and :data:`MIN_ANSWER_CHARS` characters.

Splits share no source: items are grouped by top-level package (``asyncio``, ``email``, ...;
a top-level module is its own group), at most :data:`MAX_PER_GROUP` items a group (so no package
dominates), the groups shuffled with a fixed seed and dealt whole to ``test`` and ``validation``
until each holds :data:`HELDOUT_ITEMS` items; the rest is ``train``. Inside a split the items are
shuffled (the same seed), so the first ``max_samples`` of a split mix its packages.

The task metric beside the held-out loss is the answer's first sentence: :meth:`first_sentence`.
"""

import ast
import functools
import random
import re
import sys
import sysconfig
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from squash.datasets._chat import QuestionAnswerDataset

SPLITS = ("train", "validation", "test")
QUESTION = "Explain {name} from Python's standard library."
MIN_SENTENCES = 2
MAX_SENTENCES = 4
MIN_ANSWER_CHARS = 80
MAX_ANSWER_CHARS = 360
MAX_PER_GROUP = 24
HELDOUT_ITEMS = 120
# Folders and files of the standard library that are not its documented API: tests, IDLE, the
# demos, the installer's bundled wheels, installed packages, deprecated trees (and the build's
# config-* folder).
SKIP_TOP = {"test", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "site-packages",
            "distutils", "pydoc_data"}  # fmt: skip
# A sentence ends at . ! or ? followed by white space and a capital, a quote or a bracket.
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'`*])")
_NOT_PROSE_START = (">>>", "...", "- ", "* ", "+ ", ":")


def _prose(doc: str) -> Tuple[str, int]:
    """``(text, sentences)``: the opening prose of a docstring, cut at whole sentences."""
    paras = [p.strip() for p in re.split(r"\n\s*\n", doc) if p.strip()]
    kept: List[str] = []
    for p in paras:
        lines = p.splitlines()
        if (any(line.lstrip().startswith(_NOT_PROSE_START) for line in lines) or "::" in p
                or p.endswith(":")):  # fmt: skip
            break
        indents = {len(line) - len(line.lstrip()) for line in lines[1:]}
        if len(indents) > 1:  # an indented block inside the paragraph: a table or code
            break
        kept.append(" ".join(p.split()))
        if len(SENTENCE_END.split(" ".join(kept))) > MAX_SENTENCES:
            break
    sentences, out = SENTENCE_END.split(" ".join(kept)) if kept else [], []
    for s in sentences[:MAX_SENTENCES]:
        if len(" ".join(out + [s])) > MAX_ANSWER_CHARS:
            break
        out.append(s)
    return " ".join(out), len(out)


def _stdlib_files() -> List[Tuple[str, Path]]:
    """``(module name, path)`` of the standard library's public ``.py`` files, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in SKIP_TOP or rel.parts[0].startswith("config-"):
            continue
        if any(part.startswith("_") and part != "__init__.py" for part in rel.parts):
            continue
        out.append((".".join(rel.with_suffix("").parts).removesuffix(".__init__"), path))
    return out


@functools.lru_cache(maxsize=1)
def python_doc_items() -> List[Tuple[str, str]]:
    """Every kept ``(qualified name, answer)`` of the standard library, in file order."""
    items = []
    for module, path in _stdlib_files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue

        def visit(node: ast.AST, prefix: str) -> None:
            for child in getattr(node, "body", []):
                if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    continue
                if child.name.startswith("_"):
                    continue
                name = f"{prefix}.{child.name}"
                doc = ast.get_docstring(child)
                if doc:
                    text, n = _prose(doc)
                    if n >= MIN_SENTENCES and len(text) >= MIN_ANSWER_CHARS and text[-1] in ".!?)":
                        items.append((name, text))
                if isinstance(child, ast.ClassDef):
                    visit(child, name)

        visit(tree, module)
    return items


@functools.lru_cache(maxsize=4)
def python_doc_splits(seed: int = 0) -> Dict[str, List[Tuple[str, str]]]:
    """``{split: [(qualified name, answer), ...]}``; splits disjoint by top-level package.

    Args:
        seed (int): the seed of the group shuffle, each group's sample and each split's order.
    """
    rng = random.Random(seed)
    groups: Dict[str, List[Tuple[str, str]]] = {}
    for name, text in python_doc_items():
        groups.setdefault(name.split(".")[0], []).append((name, text))
    names = sorted(groups)
    rng.shuffle(names)
    out: Dict[str, List[Tuple[str, str]]] = {s: [] for s in SPLITS}
    for g in names:
        items = groups[g]
        if len(items) > MAX_PER_GROUP:
            items = sorted(rng.sample(items, MAX_PER_GROUP))
        for split in ("test", "validation"):
            if len(out[split]) < HELDOUT_ITEMS:
                out[split].extend(items)
                break
        else:
            out["train"].extend(items)
    for split in SPLITS:
        rng.shuffle(out[split])
    return out


def first_sentence(answer: str) -> str:
    """The first sentence of an answer (the task metric's span)."""
    return SENTENCE_END.split(answer, maxsplit=1)[0]


class PythonDocsDataset(QuestionAnswerDataset):
    """Tokenized samples of one split, as torchtune's chat datasets give them:
    ``{"tokens": [...], "labels": [...]}`` with the question's labels set to the ignore index.

    Args:
        tokenizer: a torchtune ``ModelTokenizer`` (callable on ``{"messages": [...]}``).
        split (str): ``train``, ``validation`` or ``test``. Default ``train``.
        seed (int): the split's seed (:func:`python_doc_splits`). Default 0.
        max_samples (Optional[int]): keep the first ``max_samples`` of the split. Default None.

    Raises:
        ValueError: an unknown split or a ``max_samples`` below 1.
    """

    QUESTION, SUBJECT = QUESTION, "name"

    def __init__(
        self, tokenizer: Any, split: str = "train", seed: int = 0, max_samples: Optional[int] = None
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        super().__init__(tokenizer, python_doc_splits(seed)[split], max_samples)

    def first_sentence(self, index: int) -> str:
        """The first sentence of sample ``index``'s answer."""
        return first_sentence(self.items[index][1])


def python_docs_dataset(
    tokenizer: Any, split: str = "train", seed: int = 0, max_samples: Optional[int] = None
) -> PythonDocsDataset:
    """Builder of :class:`PythonDocsDataset` for configs:
    ``dataset: {_component_: squash.datasets.python_docs_dataset, split: train}``."""
    return PythonDocsDataset(tokenizer, split=split, seed=seed, max_samples=max_samples)


def python_version() -> str:
    """The CPython release whose standard library the splits come from."""
    return ".".join(map(str, sys.version_info[:3]))
