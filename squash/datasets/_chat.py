"""What squash's question-answer datasets share: a sample is a chat (``messages(index)``),
tokenized by the model tokenizer, with the prompt left out of the loss."""

from typing import Dict, List

from torch.utils.data import Dataset
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, Message


class ChatDataset(Dataset):
    """A dataset of chats: a subclass holds ``self._tokenizer`` (torchtune's model tokenizer,
    called on ``{"messages": ...}``) and says each sample's :meth:`messages`."""

    def messages(self, index: int) -> List[Message]:
        raise NotImplementedError

    def __getitem__(self, index: int) -> Dict[str, List[int]]:
        """``{"tokens", "labels"}`` of sample ``index``: the labels are the tokens, with every
        masked (prompt) position set to ``CROSS_ENTROPY_IGNORE_IDX``."""
        out = self._tokenizer({"messages": self.messages(index)})
        tokens, mask = list(out["tokens"]), list(out["mask"])
        labels = [CROSS_ENTROPY_IGNORE_IDX if m else t for t, m in zip(tokens, mask)]
        return {"tokens": tokens, "labels": labels}
