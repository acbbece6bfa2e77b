"""SmolLM2's tokenizer with its ChatML chat template, for torchtune's chat and instruct datasets.

Encoding and decoding are torchtune's ``HuggingFaceBaseTokenizer`` on the checkpoint's
``tokenizer.json`` (BOS and EOS from ``tokenizer_config.json``); messages are rendered as
SmolLM2's chat template renders them (the template ``squash download`` writes into
``tokenizer_config.json``)::

    <|im_start|>system
    You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
    <|im_start|>user
    {content}<|im_end|>
    <|im_start|>assistant
    {content}<|im_end|>

with the default system message when the conversation does not open with one. Each message's
``role\\ncontent`` is encoded as one string, so the tokens equal those of the rendered template.
"""

import json
import os
from typing import Any, List, Mapping, Optional, Tuple

from torchtune.data import Message, PromptTemplate, truncate
from torchtune.modules.transforms import Transform
from torchtune.modules.transforms.tokenizers import HuggingFaceBaseTokenizer, ModelTokenizer

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


class SmolLM2Tokenizer(ModelTokenizer, Transform):
    """SmolLM2's byte-level BPE tokenizer and ChatML chat format as a torchtune model tokenizer.

    ``bos_id``/``eos_id``/``pad_id`` are the ``bos_token``/``eos_token``/``pad_token`` of
    ``tokenizer_config.json`` (SmolLM2-Instruct: ``<|im_start|>`` 1, ``<|im_end|>`` 2,
    ``<|im_end|>`` 2); ``<|im_end|>`` ends every message and stops generation.

    Args:
        path (str): ``tokenizer.json``, or the checkpoint directory holding it.
        tokenizer_config_path (Optional[str]): ``tokenizer_config.json``; default: beside
            ``tokenizer.json``.
        max_seq_len (Optional[int]): truncate tokenized messages to this length. Default: None
        prompt_template (Optional[PromptTemplate]): applied to messages before they are
            rendered, as in torchtune's tokenizers. Default: None
        default_system (Optional[str]): system message put first when a conversation has none,
            as SmolLM2's template does; None for no default. Default: SmolLM2's.

    Raises:
        FileNotFoundError: naming a missing ``tokenizer.json`` or ``tokenizer_config.json``.
        ValueError: a vocabulary without ``<|im_start|>``/``<|im_end|>``, or a config whose
            special tokens the vocabulary lacks (naming the file).
    """

    def __init__(
        self,
        path: str,
        tokenizer_config_path: Optional[str] = None,
        max_seq_len: Optional[int] = None,
        prompt_template: Optional[PromptTemplate] = None,
        default_system: Optional[str] = DEFAULT_SYSTEM,
    ) -> None:
        tokenizer_json = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        config_json = tokenizer_config_path or os.path.join(
            os.path.dirname(tokenizer_json), "tokenizer_config.json"
        )
        for what, file in (("tokenizer.json", tokenizer_json), ("tokenizer_config", config_json)):
            if not os.path.isfile(file):
                raise FileNotFoundError(f"SmolLM2 tokenizer file not found ({what}): {file}")
        try:
            self._base = HuggingFaceBaseTokenizer(
                tokenizer_json, tokenizer_config_json_path=config_json
            )
        except Exception as e:  # tokenizers' "EOF while parsing ..." names no file
            raise ValueError(
                f"Cannot read {tokenizer_json} (with {config_json}) as a tokenizer: {e}"
            ) from e
        vocab = self._base.tokenizer
        self.im_start_id = vocab.token_to_id(IM_START)
        self.im_end_id = vocab.token_to_id(IM_END)
        if self.im_start_id is None or self.im_end_id is None:
            raise ValueError(f"{tokenizer_json} lacks ChatML's {IM_START} / {IM_END} tokens")
        with open(config_json, encoding="utf-8") as f:
            pad = json.load(f).get("pad_token")
        pad = pad.get("content") if isinstance(pad, dict) else pad
        self.bos_id = self._base.bos_id
        self.eos_id = self._base.eos_id
        self.pad_id = vocab.token_to_id(pad) if pad is not None else self.eos_id
        if self.pad_id is None:
            raise ValueError(f"{config_json}: pad_token {pad!r} is not in the vocabulary")
        self.stop_tokens = sorted({self.eos_id, self.im_end_id})
        self.max_seq_len = max_seq_len
        self.prompt_template = prompt_template
        self.default_system = default_system

    @property
    def vocab_size(self) -> int:
        """Number of tokens in the vocabulary (special tokens included)."""
        return self._base.tokenizer.get_vocab_size()

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> List[int]:
        """Encode text (special tokens in it are recognised), with BOS/EOS if asked.

        Args:
            text (str): the text.
            add_bos (bool): prepend ``bos_id``. Default: True
            add_eos (bool): append ``eos_id``. Default: True

        Returns:
            List[int]: token ids.
        """
        return self._base.encode(text, add_bos=add_bos, add_eos=add_eos)

    def decode(self, token_ids: List[int], skip_special_tokens: bool = True) -> str:
        """Decode token ids (special tokens left out unless ``skip_special_tokens=False``)."""
        return self._base.tokenizer.decode(
            list(token_ids), skip_special_tokens=skip_special_tokens
        )

    def tokenize_messages(
        self, messages: List[Message], *, add_eos: bool = True
    ) -> Tuple[List[int], List[bool]]:
        """Render and tokenize messages in ChatML.

        Args:
            messages (List[Message]): the conversation (text content only).
            add_eos (bool): close the last message with ``<|im_end|>\\n``. With False, a last
                assistant message is left open, so an empty one is the generation prompt
                ``<|im_start|>assistant\\n``. Default: True

        Returns:
            Tuple[List[int], List[bool]]: token ids, and per token True where it is masked from
            the loss (the message's ``masked``; the default system message is masked). Longer
            than ``max_seq_len``, they are cut to it, the last token made EOS (and, with
            ``add_eos``, masked), as torchtune's ``truncate`` does.

        Raises:
            ValueError: a message with non-text content.
        """
        if self.prompt_template is not None:
            messages = self.prompt_template(messages)
        if self.default_system is not None and (not messages or messages[0].role != "system"):
            messages = [Message("system", self.default_system, masked=True), *messages]
        newline = self.encode("\n", add_bos=False, add_eos=False)
        tokens: List[int] = []
        mask: List[bool] = []
        for i, message in enumerate(messages):
            if any(item["type"] != "text" for item in message.content):
                raise ValueError(f"SmolLM2 takes text messages only, got {message.content}")
            text = "".join(item["content"] for item in message.content)
            ids = [self.im_start_id] + self.encode(f"{message.role}\n{text}", False, False)
            last_open = not add_eos and i == len(messages) - 1 and message.role == "assistant"
            if not last_open:
                ids += [self.im_end_id] + newline
            tokens += ids
            mask += [message.masked] * len(ids)
            if self.max_seq_len and len(tokens) >= self.max_seq_len:
                break
        if self.max_seq_len and len(tokens) > self.max_seq_len:  # cut, ending in EOS
            tokens = truncate(tokens, self.max_seq_len, self.eos_id if add_eos else None)
            mask = truncate(mask, self.max_seq_len, True if add_eos else None)
        return tokens, mask

    def __call__(self, sample: Mapping[str, Any], inference: bool = False) -> Mapping[str, Any]:
        """Replace ``sample["messages"]`` with ``"tokens"`` and ``"mask"`` (torchtune's
        dataset transform protocol); ``inference`` leaves the last assistant message open."""
        messages = sample.pop("messages")
        tokens, mask = self.tokenize_messages(messages, add_eos=not inference)
        sample["tokens"] = tokens
        sample["mask"] = mask
        return sample


def smollm2_tokenizer(
    path: str,
    max_seq_len: Optional[int] = None,
    prompt_template: Optional[PromptTemplate] = None,
) -> SmolLM2Tokenizer:
    """SmolLM2's tokenizer from a checkpoint directory (or its ``tokenizer.json``).

    Args:
        path (str): the directory ``squash download`` wrote, or its ``tokenizer.json``.
        max_seq_len (Optional[int]): truncate tokenized messages to this length. Default: None
        prompt_template (Optional[PromptTemplate]): template applied before rendering.

    Returns:
        SmolLM2Tokenizer: the tokenizer.
    """
    return SmolLM2Tokenizer(path, max_seq_len=max_seq_len, prompt_template=prompt_template)
