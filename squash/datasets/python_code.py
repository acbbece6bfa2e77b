"""Continued pretraining on code, built at run time: the standard library's own Python source.

The text is the running CPython's standard library, its ``.py`` files as CPython's developers
wrote them (tests, IDLE, demos and installed packages left out, as in
:mod:`squash.datasets.python_docs`). Nothing is downloaded and nobody wrote it for squash; what a
split holds is fixed for one CPython release. CPython is under the PSF License Agreement
(permissive; https://docs.python.org/3/license.html).

Splits share no source: files are grouped by top-level package (``asyncio``, ``email``, ...; a
top-level module is its own group), the groups shuffled with a fixed seed and dealt whole to
``test`` and ``validation`` until each holds :data:`HELDOUT_FRACTION` of the characters (a group
that would take a split past 1.5x its share goes on to the next); the rest is ``train``. Held-out
perplexity is therefore measured on modules kept out of training.

A split's files (in path order, each headed by a ``# file: path`` line, joined by a blank line)
are tokenized as one text, without BOS/EOS, and cut into consecutive windows of ``max_seq_len``
tokens (the last, shorter piece dropped); ``labels == tokens`` (plain text completion).
``max_windows`` keeps that many windows spread evenly over the split (every
``len // max_windows``-th), so a short run still sees every part of it.
"""

import functools
import random
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from torch.utils.data import Dataset

from squash._checks import check_int
from squash.datasets.python_docs import _stdlib_files

SPLITS = ("train", "validation", "test")
# Fraction of the characters in validation and in test (the rest train).
HELDOUT_FRACTION = 0.05


@functools.lru_cache(maxsize=4)
def python_code_files(seed: int = 0) -> Dict[str, List[Tuple[str, Path]]]:
    """``{split: [(module name, path), ...]}`` in module order; splits disjoint by top-level
    package.

    Args:
        seed (int): the seed of the group shuffle. Default 0.
    """
    groups: Dict[str, List[Tuple[str, Path]]] = {}
    for module, path in _stdlib_files():
        groups.setdefault(module.split(".")[0], []).append((module, path))
    size = {g: sum(p.stat().st_size for _, p in files) for g, files in groups.items()}
    names = sorted(groups)
    random.Random(seed).shuffle(names)
    target = HELDOUT_FRACTION * sum(size.values())
    out: Dict[str, List[Tuple[str, Path]]] = {s: [] for s in SPLITS}
    held = {"test": 0, "validation": 0}
    for g in names:
        for split in ("test", "validation"):
            if held[split] < target and held[split] + size[g] <= 1.5 * target:
                out[split].extend(groups[g])
                held[split] += size[g]
                break
        else:
            out["train"].extend(groups[g])
    return {s: sorted(v) for s, v in out.items()}


def python_code_text(split: str = "train", seed: int = 0) -> str:
    """The text of one split: each file headed by ``# file: <module>``, joined by blank lines.

    Raises:
        ValueError: an unknown split.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return "\n\n".join(f"# file: {module}\n{path.read_text(encoding='utf-8', errors='replace')}"
                       for module, path in python_code_files(seed)[split])  # fmt: skip


class PythonCodeDataset(Dataset):
    """Fixed-length token windows of one split of the standard library's source, for continued
    pretraining: ``{"tokens": [...], "labels": [...]}`` with ``labels == tokens``.

    Args:
        tokenizer: a torchtune tokenizer with ``encode(text, add_bos=..., add_eos=...)``.
        split (str): ``train``, ``validation`` or ``test``. Default ``train``.
        max_seq_len (int): tokens per window. Default 128.
        seed (int): the split's seed (:func:`python_code_files`). Default 0.
        max_windows (Optional[int]): keep this many windows, spread evenly over the split.
            Default None (all).

    Raises:
        ValueError: an unknown split, a ``max_seq_len`` below 2, a ``max_windows`` below 1, or a
            split shorter than one window.
    """

    def __init__(self, tokenizer: Any, split: str = "train", max_seq_len: int = 128, seed: int = 0,
                 max_windows: Optional[int] = None) -> None:  # fmt: skip
        check_int("max_seq_len", max_seq_len, 2)
        if max_windows is not None:
            check_int("max_windows", max_windows, 1)
        ids = tokenizer.encode(python_code_text(split, seed), add_bos=False, add_eos=False)
        n = len(ids) // max_seq_len
        if n == 0:
            raise ValueError(
                f"split {split!r} has {len(ids)} tokens, fewer than max_seq_len={max_seq_len}"
            )
        starts = range(n)
        if max_windows is not None and max_windows < n:
            starts = [i * n // max_windows for i in range(max_windows)]
        self.split, self.max_seq_len, self.num_tokens = split, max_seq_len, len(ids)
        self.windows = [ids[i * max_seq_len : (i + 1) * max_seq_len] for i in starts]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> Dict[str, List[int]]:
        tokens = list(self.windows[index])
        return {"tokens": tokens, "labels": list(tokens)}


def python_code_dataset(tokenizer: Any, split: str = "train", max_seq_len: int = 128, seed: int = 0,
                        max_windows: Optional[int] = None) -> PythonCodeDataset:  # fmt: skip
    """Builder of :class:`PythonCodeDataset` for configs:
    ``dataset: {_component_: squash.datasets.python_code_dataset, split: train}``."""
    return PythonCodeDataset(tokenizer, split=split, max_seq_len=max_seq_len, seed=seed,
                             max_windows=max_windows)  # fmt: skip
