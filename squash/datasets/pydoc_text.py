"""Real English prose for text completion, from Python's standard library: the Language Reference.

The text is ``pydoc_data.topics.topics``, the help topics ``pydoc`` shows (``help("if")``): 79
sections of the Python Language and Library Reference (about 465 kB in CPython 3.11), written by
people for people, shipped with every CPython under the PSF License. Nothing is downloaded, and
nobody wrote it for squash. The topics depend on the Python version: what a split holds is fixed
for one CPython release.

Some topics repeat others (``specialnames`` holds ``customization`` and ``attribute-access``;
``compound`` holds ``if``, ``while``, ``try`` ...), so a split by topic alone would put the same
paragraphs in train and test. Topics that share any run of :data:`SHINGLE_WORDS` words are
therefore joined into one document first (union-find over shared word runs); inside a document a
paragraph that repeats an earlier one (:data:`MIN_DEDUP_CHARS` characters or more) is dropped.
The documents are shuffled with a fixed seed and dealt to ``test`` and ``validation`` until each
holds :data:`HELDOUT_FRACTION` of the characters (a document that would take a split past 1.5x
its share goes on to the next); the rest is ``train``. So the splits share no run of
:data:`SHINGLE_WORDS` words.

A split's documents (in name order, joined by a blank line) are tokenized as one text, without
BOS/EOS, and cut into consecutive windows of ``max_seq_len`` tokens (the last, shorter piece is
dropped). Each window is one sample with ``labels == tokens``: every token after a window's first
is predicted (plain text completion, no chat template).
"""

import functools
import random
import string
from typing import Any, Dict, List, Optional, Tuple

from torch.utils.data import Dataset

from squash._checks import check_int

SPLITS = ("train", "validation", "test")
# Fraction of the characters in validation and in test (the rest train).
HELDOUT_FRACTION = 0.1
# Topics sharing a run of this many words are one document (the length of n-gram overlap
# checks for test-set contamination, e.g. GPT-3's 13-grams).
SHINGLE_WORDS = 13
# A paragraph this long or longer that repeats an earlier one of its document is dropped.
MIN_DEDUP_CHARS = 60
DOCUMENT_SEPARATOR = "\n\n"


def pydoc_topics() -> Dict[str, str]:
    """The standard library's help topics: ``{topic name: text}``."""
    from pydoc_data.topics import topics

    return dict(topics)


def _shingles(text: str, n: int = SHINGLE_WORDS) -> set:
    words = text.split()
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


@functools.lru_cache(maxsize=4)
def pydoc_documents(seed: int = 0) -> Dict[str, List[Tuple[Tuple[str, ...], str]]]:
    """The documents of each split: ``{split: [(topic names, text), ...]}``, names sorted.

    Args:
        seed (int): the seed of the documents' shuffle before they are dealt. Default 0.
    """
    topics = pydoc_topics()
    names = sorted(topics)
    parent = {k: k for k in names}

    def root(k: str) -> str:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    owner: Dict[str, str] = {}
    for name in names:
        for s in _shingles(topics[name]):
            if s in owner:
                a, b = root(owner[s]), root(name)
                if a != b:
                    parent[max(a, b)] = min(a, b)
            else:
                owner[s] = name
    groups: Dict[str, List[str]] = {}
    for name in names:
        groups.setdefault(root(name), []).append(name)
    docs = []
    for members in groups.values():
        seen, kept = set(), []
        for name in members:
            for para in topics[name].split("\n\n"):
                para = para.strip("\n")
                key = para.strip()
                if not key or (len(key) >= MIN_DEDUP_CHARS and key in seen):
                    continue
                seen.add(key)
                kept.append(para)
        docs.append((tuple(members), "\n\n".join(kept)))
    docs.sort()
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    target = HELDOUT_FRACTION * sum(len(text) for _, text in docs)
    out: Dict[str, list] = {s: [] for s in SPLITS}
    size = {"test": 0, "validation": 0}
    for i in order:
        n = len(docs[i][1])
        for split in ("test", "validation"):
            if size[split] < target and size[split] + n <= 1.5 * target:
                out[split].append(docs[i])
                size[split] += n
                break
        else:
            out["train"].append(docs[i])
    return {s: sorted(v) for s, v in out.items()}


def pydoc_text(split: str = "train", seed: int = 0) -> str:
    """The text of one split: its documents in name order, joined by a blank line.

    Raises:
        ValueError: an unknown split.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return DOCUMENT_SEPARATOR.join(text for _, text in pydoc_documents(seed)[split])


def letter_cipher(seed: int) -> Dict[str, str]:
    """A substitution cipher of the 26 Latin letters: ``{plain: cipher}``, lower case (upper
    case maps alike), a permutation drawn with ``random.Random(seed)`` in which no letter maps to
    itself (re-drawn until so)."""
    letters = list(string.ascii_lowercase)
    rng = random.Random(seed)
    while True:
        perm = letters[:]
        rng.shuffle(perm)
        if all(a != b for a, b in zip(letters, perm)):
            return dict(zip(letters, perm))


def encipher(text: str, seed: int) -> str:
    """``text`` with every Latin letter replaced by :func:`letter_cipher`'s (case kept);
    everything else (digits, punctuation, white space) as it was."""
    table = letter_cipher(seed)
    table.update({a.upper(): b.upper() for a, b in list(table.items())})
    return text.translate(str.maketrans(table))


class PydocTextDataset(Dataset):
    """Fixed-length token windows of one split of the Language Reference text, for text
    completion: ``{"tokens": [...], "labels": [...]}`` with ``labels == tokens``.

    Args:
        tokenizer: a torchtune tokenizer with ``encode(text, add_bos=..., add_eos=...)``.
        split (str): ``train``, ``validation`` or ``test``. Default ``train``.
        max_seq_len (int): tokens per window. Default 256.
        seed (int): the split's seed (:func:`pydoc_documents`). Default 0.
        max_windows (Optional[int]): keep the first ``max_windows`` windows. Default None.
        cipher_seed (Optional[int]): encipher the text first (:func:`encipher`: every letter
            through a fixed substitution), a language the model has never read whose structure
            is English's. Default None (plain text).

    Raises:
        ValueError: an unknown split, a ``max_seq_len`` below 2, a ``max_windows`` below 1, or a
            split shorter than one window.
    """

    def __init__(
        self,
        tokenizer: Any,
        split: str = "train",
        max_seq_len: int = 256,
        seed: int = 0,
        max_windows: Optional[int] = None,
        cipher_seed: Optional[int] = None,
    ) -> None:
        check_int("max_seq_len", max_seq_len, 2)
        if max_windows is not None:
            check_int("max_windows", max_windows, 1)
        text = pydoc_text(split, seed)
        if cipher_seed is not None:
            text = encipher(text, check_int("cipher_seed", cipher_seed, 0))
        ids = tokenizer.encode(text, add_bos=False, add_eos=False)
        n = len(ids) // max_seq_len
        if n == 0:
            raise ValueError(
                f"split {split!r} has {len(ids)} tokens, fewer than max_seq_len={max_seq_len}"
            )
        if max_windows is not None:
            n = min(n, max_windows)
        self.split = split
        self.max_seq_len = max_seq_len
        self.num_tokens = len(ids)  # of the whole split, before windowing
        self.windows = [ids[i * max_seq_len : (i + 1) * max_seq_len] for i in range(n)]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> Dict[str, List[int]]:
        tokens = list(self.windows[index])
        return {"tokens": tokens, "labels": list(tokens)}


def pydoc_text_dataset(
    tokenizer: Any,
    split: str = "train",
    max_seq_len: int = 256,
    seed: int = 0,
    max_windows: Optional[int] = None,
    cipher_seed: Optional[int] = None,
) -> PydocTextDataset:
    """Builder of :class:`PydocTextDataset` for configs:
    ``dataset: {_component_: squash.datasets.pydoc_text_dataset, split: train, max_seq_len: 256}``."""
    return PydocTextDataset(
        tokenizer, split=split, max_seq_len=max_seq_len, seed=seed, max_windows=max_windows,
        cipher_seed=cipher_seed,
    )  # fmt: skip
