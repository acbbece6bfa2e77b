"""OPT's tokenizer: GPT-2 byte-level BPE with OPT's special tokens, for torchtune datasets."""

import json
import os
from typing import Any, Dict, List, Mapping, Optional, Tuple

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torchtune.data import Message, PromptTemplate
from torchtune.data._prompt_templates import _get_prompt_template, _TemplateType
from torchtune.modules.transforms import Transform
from torchtune.modules.transforms.tokenizers import (
    ModelTokenizer,
    tokenize_messages_no_special_tokens,
)

# OPT's special tokens, in the order of its vocabulary.
_SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>")


class OPTTokenizer(ModelTokenizer, Transform):
    """OPT's GPT-2 byte-level BPE tokenizer as a torchtune model tokenizer.

    Encodes as ``transformers`` does for OPT: byte-level pre-tokenization with GPT-2's regex and
    no prefix space, ``</s>`` (id 2 in OPT's vocabulary) prepended as BOS, and the special tokens
    ``<s>``, ``<pad>``, ``</s>``, ``<unk>`` recognised in text. ``</s>`` is also EOS and the
    generation stop token; ``<pad>`` (id 1) pads.

    Args:
        vocab_path (str): path to ``vocab.json``.
        merges_path (str): path to ``merges.txt``.
        max_seq_len (Optional[int]): truncate tokenized messages to this length. Default None.
        prompt_template (Optional[PromptTemplate]): template applied to messages before
            tokenization, as in torchtune's tokenizers. Default None.

    Raises:
        FileNotFoundError: if ``vocab_path`` or ``merges_path`` does not exist (naming it).
        ValueError: if a file cannot be read as what it should be, or the vocabulary lacks one
            of OPT's special tokens (naming the file).
    """

    def __init__(
        self,
        vocab_path: str,
        merges_path: str,
        max_seq_len: Optional[int] = None,
        prompt_template: Optional[PromptTemplate] = None,
    ) -> None:
        for what, path in (("vocab.json", vocab_path), ("merges.txt", merges_path)):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"OPT tokenizer file not found ({what}): {path}")
        with open(merges_path, encoding="utf-8", errors="replace") as f:
            if not any(line.strip() and not line.startswith("#") for line in f):
                raise ValueError(f"{merges_path} holds no merges: an OPT merges.txt lists one a line")
        try:
            with open(vocab_path, encoding="utf-8") as f:
                vocab = json.load(f)
        except (UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"Cannot read {vocab_path} as a vocab.json (JSON): {e}") from e
        if not isinstance(vocab, dict):
            raise ValueError(f"{vocab_path} is not a vocab.json: a JSON object expected")
        missing = [t for t in _SPECIAL_TOKENS if t not in vocab]
        if missing:
            raise ValueError(f"{vocab_path} lacks OPT's special tokens {missing}")
        try:
            bpe = models.BPE.from_file(vocab_path, merges_path)
        except Exception as e:  # tokenizers raises a bare Exception naming neither file
            raise ValueError(
                f"Cannot build a BPE tokenizer from {vocab_path} and {merges_path}: {e}"
            ) from e
        self._tokenizer = Tokenizer(bpe)
        self._tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tokenizer.decoder = decoders.ByteLevel()
        self._tokenizer.add_special_tokens(list(_SPECIAL_TOKENS))

        self.special_tokens: Dict[str, int] = {t: vocab[t] for t in _SPECIAL_TOKENS}
        self.bos_id = self.special_tokens["</s>"]
        self.eos_id = self.special_tokens["</s>"]
        self.pad_id = self.special_tokens["<pad>"]
        self.stop_tokens = [self.eos_id]
        self.max_seq_len = max_seq_len
        self.prompt_template = prompt_template

    @property
    def vocab_size(self) -> int:
        """Number of tokens in the vocabulary."""
        return self._tokenizer.get_vocab_size()

    def encode(
        self,
        text: str,
        add_bos: bool = True,
        add_eos: bool = True,
        trim_leading_whitespace: bool = False,
    ) -> List[int]:
        """Encode a string.

        Args:
            text (str): the text.
            add_bos (bool): prepend BOS (``</s>``). Default True.
            add_eos (bool): append EOS (``</s>``). Default True.
            trim_leading_whitespace (bool): accepted for torchtune's
                ``tokenize_messages_no_special_tokens``; byte-level BPE adds no prefix space, so
                ``encode(a) + encode(b)`` already tokenizes ``a + b`` up to the BPE boundary and
                there is nothing to trim. Default False.

        Returns:
            List[int]: token ids.
        """
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, token_ids: List[int], skip_special_tokens: bool = True) -> str:
        """Decode token ids.

        Args:
            token_ids (List[int]): the ids.
            skip_special_tokens (bool): leave out ``<s>``, ``<pad>``, ``</s>``, ``<unk>``.
                Default True.

        Returns:
            str: the text (invalid UTF-8 byte sequences become U+FFFD).
        """
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def tokenize_messages(
        self, messages: List[Message], *, add_eos: bool = True
    ) -> Tuple[List[int], List[bool]]:
        """Tokenize messages one at a time and concatenate them: BOS at the start of each turn,
        EOS after each assistant message, truncated to ``max_seq_len``.

        Args:
            messages (List[Message]): the messages (text content only).
            add_eos (bool): append EOS after assistant messages. Default True.

        Returns:
            Tuple[List[int], List[bool]]: token ids, and for each a flag that is True where the
            token is masked from the loss.
        """
        if self.prompt_template is not None:
            messages = self.prompt_template(messages)
        return tokenize_messages_no_special_tokens(
            tokenizer=self,
            messages=messages,
            bos_id=self.bos_id,
            eos_id=self.eos_id if add_eos else None,
        )

    def __call__(self, sample: Mapping[str, Any], inference: bool = False) -> Mapping[str, Any]:
        """Replace ``sample["messages"]`` with ``"tokens"`` and ``"mask"``.

        Args:
            sample (Mapping[str, Any]): a sample with a ``"messages"`` list.
            inference (bool): unused; torchtune passes it to every model transform.

        Returns:
            Mapping[str, Any]: the sample, with ``"tokens"`` and ``"mask"``.
        """
        messages = sample.pop("messages")
        tokens, mask = self.tokenize_messages(messages)
        sample["tokens"] = tokens
        sample["mask"] = mask
        return sample


def opt_tokenizer(
    vocab_path: str,
    merges_path: str,
    max_seq_len: Optional[int] = None,
    prompt_template: Optional[_TemplateType] = None,
) -> OPTTokenizer:
    """Build OPT's tokenizer from ``vocab.json`` and ``merges.txt``.

    Args:
        vocab_path (str): path to ``vocab.json``.
        merges_path (str): path to ``merges.txt``.
        max_seq_len (Optional[int]): truncate tokenized messages to this length. Default None.
        prompt_template (Optional[_TemplateType]): a template applied to messages: the dotpath
            of a :class:`~torchtune.data.PromptTemplate` (e.g.
            ``"torchtune.data.AlpacaInstructTemplate"``) or a dict of role -> (prepend, append)
            tags, as for torchtune's tokenizer builders. Default None.

    Returns:
        OPTTokenizer: the tokenizer.
    """
    template = _get_prompt_template(prompt_template) if prompt_template is not None else None
    return OPTTokenizer(vocab_path, merges_path, max_seq_len, template)
