"""What squash's question-answer datasets share: a sample is a chat (``messages(index)``),
tokenized by the model tokenizer, with the prompt left out of the loss."""

from typing import Any, Dict, List, Optional, Sequence

from torch.utils.data import Dataset
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, Message


class ChatDataset(Dataset):
    """A dataset of chats: the first ``max_samples`` of a split's ``items`` (all for None),
    tokenized by ``tokenizer`` (torchtune's model tokenizer, called on ``{"messages": ...}``); a
    subclass says each sample's :meth:`messages`.

    Raises:
        ValueError: ``max_samples`` not an integer >= 1.
    """

    def __init__(self, tokenizer: Any, items: Sequence, max_samples: Optional[int] = None) -> None:
        self._tokenizer = tokenizer
        self.items = first_samples(items, max_samples)

    def __len__(self) -> int:
        return len(self.items)

    def messages(self, index: int) -> List[Message]:
        raise NotImplementedError

    def __getitem__(self, index: int) -> Dict[str, List[int]]:
        """``{"tokens", "labels"}`` of sample ``index``: the labels are the tokens, with every
        masked (prompt) position set to ``CROSS_ENTROPY_IGNORE_IDX``."""
        out = self._tokenizer({"messages": self.messages(index)})
        tokens, mask = list(out["tokens"]), list(out["mask"])
        labels = [CROSS_ENTROPY_IGNORE_IDX if m else t for t, m in zip(tokens, mask)]
        return {"tokens": tokens, "labels": labels}


class QuestionAnswerDataset(ChatDataset):
    """A :class:`ChatDataset` whose items are ``(subject, answer)`` pairs: each sample asks the
    subclass's ``QUESTION`` with the subject in its ``{SUBJECT}`` field (masked out of the loss)
    and is answered by the answer."""

    QUESTION = "{subject}"
    SUBJECT = "subject"

    def messages(self, index: int) -> List[Message]:
        """The untokenized chat of sample ``index``."""
        return [
            Message(role="user", content=self.question(index), masked=True),
            Message(role="assistant", content=self.answer(index)),
        ]

    def question(self, index: int) -> str:
        """The question of sample ``index``."""
        return self.QUESTION.format(**{self.SUBJECT: self.items[index][0]})

    def answer(self, index: int) -> str:
        """The expected answer of sample ``index``."""
        return self.items[index][1]


def first_samples(items: Sequence, max_samples: Optional[int]) -> Sequence:
    """The first ``max_samples`` of ``items`` (all of them for None).

    Raises:
        ValueError: ``max_samples`` not an integer >= 1.
    """
    if max_samples is None:
        return items
    if isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < 1:
        raise ValueError(f"max_samples must be an integer >= 1, got {max_samples!r}")
    return items[:max_samples]
