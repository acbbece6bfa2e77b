"""A skill with a fixed rule, built at run time: write a date as ISO 8601.

Each sample asks ``Write the date March 5, 2021 in ISO 8601 format (YYYY-MM-DD).`` and the
answer is ``2021-03-05``: a conversion a user could plausibly want a small model to do exactly,
whose every answer is checked by the rule (``datetime.date.isoformat``). SmolLM2-135M-Instruct
(float32, greedy) answered 0 of 50 such questions exactly before fine-tuning: it restates the
date (``December 5, 2050``) or starts a sentence.

The dates are the days of 1900-2099, shuffled with a fixed seed and cut into test, validation and
train splits that share no date (the same on every machine for one seed).
"""

import datetime
import random
from typing import Any, List, Optional, Tuple

from squash.datasets._chat import QuestionAnswerDataset

FIRST, LAST = datetime.date(1900, 1, 1), datetime.date(2099, 12, 31)
SPLITS = ("train", "validation", "test")
HELDOUT = 500  # dates in validation and in test each (the rest, 72,049, train)
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December")  # fmt: skip
QUESTION = "Write the date {date} in ISO 8601 format (YYYY-MM-DD)."


def spoken(date: datetime.date) -> str:
    """``March 5, 2021``: the date as the question gives it."""
    return f"{MONTHS[date.month - 1]} {date.day}, {date.year}"


def iso_date_pairs(split: str = "train", seed: int = 0) -> List[Tuple[str, str]]:
    """``(question date, ISO answer)`` pairs of one split, e.g. ``("March 5, 2021",
    "2021-03-05")``.

    Every day of :data:`FIRST`..:data:`LAST`, shuffled with ``random.Random(seed)``: the first
    :data:`HELDOUT` are ``test``, the next ``validation``, the rest ``train``.

    Raises:
        ValueError: an unknown split.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    days = [FIRST + datetime.timedelta(days=i) for i in range((LAST - FIRST).days + 1)]
    random.Random(seed).shuffle(days)
    parts = {"test": days[:HELDOUT], "validation": days[HELDOUT : 2 * HELDOUT],
             "train": days[2 * HELDOUT :]}  # fmt: skip
    return [(spoken(d), d.isoformat()) for d in parts[split]]


class IsoDatesDataset(QuestionAnswerDataset):
    """Tokenized samples of one split (``{"tokens", "labels"}``, the question masked out of the
    loss), through the model tokenizer's chat template, as :class:`UnicodeNamesDataset`.

    Args:
        tokenizer: a torchtune ``ModelTokenizer`` (callable on ``{"messages": [...]}``).
        split (str): ``train``, ``validation`` or ``test``. Default ``train``.
        seed (int): the split's shuffle seed (:func:`iso_date_pairs`). Default 0.
        max_samples (Optional[int]): keep the first ``max_samples`` of the split. Default None.

    Raises:
        ValueError: an unknown split or a ``max_samples`` below 1.
    """

    QUESTION, SUBJECT = QUESTION, "date"

    def __init__(
        self, tokenizer: Any, split: str = "train", seed: int = 0, max_samples: Optional[int] = None
    ) -> None:
        super().__init__(tokenizer, iso_date_pairs(split, seed), max_samples)


def iso_dates_dataset(
    tokenizer: Any, split: str = "train", seed: int = 0, max_samples: Optional[int] = None
) -> IsoDatesDataset:
    """Builder of :class:`IsoDatesDataset` for configs:
    ``dataset: {_component_: squash.datasets.iso_dates_dataset, split: train}``."""
    return IsoDatesDataset(tokenizer, split=split, seed=seed, max_samples=max_samples)
