"""A small real task built at run time from the Unicode Character Database: name a character.

Each sample asks ``What is the Unicode name of the character 'ñ'?`` and the answer is the
character's name in the Unicode Character Database, ``LATIN SMALL LETTER N WITH TILDE``. The data
come from Python's standard library (``unicodedata.ucd_3_2_0``: the UCD 3.2.0 tables every
Python 3 ships, so the selection does not depend on the Python version; character names never
change once assigned, by Unicode's stability policy). Nobody wrote them for squash. The Unicode
Character Database is under the Unicode License v3 (permissive; https://www.unicode.org/license.txt).

The characters are the letters and symbols of a few fixed blocks (Latin-1 Supplement, Latin
Extended-A and -B, Greek, Cyrillic, currency symbols, arrows, mathematical operators), shuffled
with a fixed seed and cut into train / validation / test splits that share no character.
"""

import random
import unicodedata
from typing import Any, List, Optional, Tuple

from torchtune.data import Message

from squash.datasets._chat import QuestionAnswerDataset

# (first, last) code points of the blocks drawn from, inclusive.
BLOCKS = (
    (0x00C0, 0x00FF),  # Latin-1 Supplement letters
    (0x0100, 0x017F),  # Latin Extended-A
    (0x0180, 0x024F),  # Latin Extended-B
    (0x0370, 0x03FF),  # Greek and Coptic
    (0x0400, 0x04FF),  # Cyrillic
    (0x20A0, 0x20CF),  # Currency Symbols
    (0x2190, 0x21FF),  # Arrows
    (0x2200, 0x22FF),  # Mathematical Operators
)
# Kept: letters and symbols (no marks, digits, punctuation, controls or unassigned code points).
CATEGORIES = ("Lu", "Ll", "Lt", "Lo", "Sm", "Sc", "So")
SPLITS = ("train", "validation", "test")
# Fraction of the characters in validation and in test (the rest train).
HELDOUT_FRACTION = 0.1
QUESTION = "What is the Unicode name of the character '{char}'?"

_UCD = unicodedata.ucd_3_2_0


def characters() -> List[str]:
    """Every character of :data:`BLOCKS` in :data:`CATEGORIES` that has a name in UCD 3.2.0,
    in code point order."""
    out = []
    for first, last in BLOCKS:
        for cp in range(first, last + 1):
            c = chr(cp)
            if _UCD.category(c) in CATEGORIES and _UCD.name(c, None) is not None:
                out.append(c)
    return out


def unicode_name_pairs(split: str = "train", seed: int = 0) -> List[Tuple[str, str]]:
    """``(character, name)`` pairs of one split.

    The characters are shuffled with ``random.Random(seed)``; the first 10% are ``test``, the
    next 10% ``validation``, the rest ``train``, so the splits are disjoint by character and the
    same on every machine for one seed.

    Args:
        split (str): ``train``, ``validation`` or ``test``. Default ``train``.
        seed (int): the shuffle's seed. Default 0.

    Raises:
        ValueError: an unknown split.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    chars = characters()
    random.Random(seed).shuffle(chars)
    n = round(HELDOUT_FRACTION * len(chars))
    parts = {"test": chars[:n], "validation": chars[n : 2 * n], "train": chars[2 * n :]}
    return [(c, _UCD.name(c)) for c in parts[split]]


def unicode_name_messages(char: str, name: str) -> List[Message]:
    """The chat of one sample: the question (masked out of the loss), then the name."""
    return [
        Message(role="user", content=QUESTION.format(char=char), masked=True),
        Message(role="assistant", content=name),
    ]


class UnicodeNamesDataset(QuestionAnswerDataset):
    """Tokenized samples of one split, as torchtune's chat/instruct datasets give them:
    ``{"tokens": [...], "labels": [...]}`` with the prompt's labels set to the ignore index.

    The tokenizer applies its model's chat template (``tokenizer({"messages": ...})``, the
    torchtune model-tokenizer transform), so the same data serve any torchtune model.

    Args:
        tokenizer: a torchtune ``ModelTokenizer`` (callable on ``{"messages": [...]}``).
        split (str): ``train``, ``validation`` or ``test``. Default ``train``.
        seed (int): the split's shuffle seed (:func:`unicode_name_pairs`). Default 0.
        max_samples (Optional[int]): keep the first ``max_samples`` of the split. Default None.

    Raises:
        ValueError: an unknown split or a ``max_samples`` below 1.
    """

    QUESTION, SUBJECT = QUESTION, "char"

    def __init__(
        self, tokenizer: Any, split: str = "train", seed: int = 0, max_samples: Optional[int] = None
    ) -> None:
        super().__init__(tokenizer, unicode_name_pairs(split, seed), max_samples)

    @property
    def pairs(self) -> List[Tuple[str, str]]:
        """``(character, name)`` of each sample (the items)."""
        return self.items


def unicode_names_dataset(
    tokenizer: Any, split: str = "train", seed: int = 0, max_samples: Optional[int] = None
) -> UnicodeNamesDataset:
    """Builder of :class:`UnicodeNamesDataset` for configs:
    ``dataset: {_component_: squash.datasets.unicode_names_dataset, split: train}``."""
    return UnicodeNamesDataset(tokenizer, split=split, seed=seed, max_samples=max_samples)
