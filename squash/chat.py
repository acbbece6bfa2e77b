"""``squash chat``: talk to a fine-tuned checkpoint with the model's own chat template.

A checkpoint directory (``<run>/epoch_N``, or any Hugging Face model directory) is loaded by
:func:`squash.merge.load_checkpoint_model` and run by transformers with a KV cache: its merged
weights where the run wrote them, else (``save_adapter_weights_only``, the shipped configs'
default) its adapter merged in memory into the base model the checkpoint records, checked
against the recorded hashes (``--base DIR`` names the base if it moved, or for a checkpoint
written before runs recorded those hashes).

Decoding is greedy (``temperature`` 0) or sampled (``temperature``, ``top_k``, ``seed``); tokens
are streamed as they are decoded, up to ``max_new_tokens`` or the end-of-turn token.
"""

import argparse
import inspect
import json
import sys
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, TextIO

import torch
from torch import nn


LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # new token ids (1, n) -> last logits (vocab,)


class ChatModel:
    """A next-token function and the tokenizer (transformers' ``PreTrainedTokenizer``, carrying
    the chat template) of one checkpoint."""

    def __init__(self, step: Callable[[], LogitsFn], tokenizer, eos_ids: List[int]) -> None:
        self._new_session = step
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids

    def prompt_ids(self, messages: List[Dict[str, str]]) -> List[int]:
        """Token ids of ``messages`` through the chat template, ending with the assistant's turn."""
        if not self.tokenizer.chat_template:
            raise ValueError("The checkpoint's tokenizer has no chat template (chat_template.jinja)")
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def generate(
        self,
        prompt_ids: List[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
    ) -> Iterator[int]:
        """Yield up to ``max_new_tokens`` new token ids (stopping after an end token, which is
        not yielded). ``temperature`` 0 is greedy; otherwise softmax sampling of the logits over
        ``temperature``, among the ``top_k`` most likely tokens if given."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if temperature < 0 or (top_k is not None and top_k < 1):
            raise ValueError(f"temperature must be >= 0 and top_k >= 1 (got {temperature}, {top_k})")
        step = self._new_session()
        new = torch.tensor([prompt_ids], dtype=torch.long)
        for _ in range(max_new_tokens):
            logits = step(new).float()  # (vocab,)
            if temperature == 0:
                token = int(torch.argmax(logits))
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.numel():
                    kth = torch.topk(logits, top_k).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
            if token in self.eos_ids:
                return
            yield token
            new = torch.tensor([[token]], dtype=torch.long)


# ---- loading ------------------------------------------------------------------------------------
def _tokenizer(directory: Path):
    from transformers import AutoTokenizer

    if not any((directory / f).is_file() for f in ("tokenizer.json", "vocab.json")):
        raise FileNotFoundError(f"No tokenizer (tokenizer.json or vocab.json) in {directory}")
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"Cannot load the tokenizer in {directory}: {e}") from e


def _eos_ids(directory: Path, tokenizer) -> List[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = directory / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return sorted(ids)


def load_checkpoint(
    checkpoint_dir: Path, base: Optional[Path] = None, device: str = "cpu", template: bool = True
) -> ChatModel:
    """The model of ``checkpoint_dir`` through transformers, with a KV cache: its merged weights,
    or its adapter merged in memory into the base its ``checkpoint.json`` records (checked
    against the recorded hashes; ``base`` names the base if it moved), see :mod:`squash.merge`.
    ``template=False`` accepts a tokenizer without a chat template, for generation from token
    ids alone.

    Raises:
        FileNotFoundError: no such directory, or neither merged weights nor an adapter in it.
        ValueError: a checkpoint or base that fails its checks, that transformers cannot load,
            or whose tokenizer has no chat template (unless ``template`` is False).
    """
    from squash.merge import load_checkpoint_model

    loaded = load_checkpoint_model(Path(checkpoint_dir), base)
    tokenizer = _tokenizer(loaded.tokenizer_dir)
    if template and not tokenizer.chat_template:  # before the model is built, not at a prompt
        raise ValueError(
            f"{loaded.tokenizer_dir} has no chat template (chat_template.jinja, or chat_template "
            "in tokenizer_config.json), which chat needs to turn messages into a prompt; add the "
            "base model's template there"
        )
    model = _transformers_model(loaded.config, loaded.weights, loaded.tokenizer_dir).to(device)

    # transformers 5.x names the KV cache ``cache``; 4.x ``past_key_values``
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def session() -> LogitsFn:
        state = {cache_arg: None}

        @torch.no_grad()
        def step(new: torch.Tensor) -> torch.Tensor:
            out = model(new.to(device), use_cache=True, **state)
            state[cache_arg] = out[cache_arg]
            return out.logits[0, -1]

        return step

    return ChatModel(session, tokenizer, _eos_ids(loaded.tokenizer_dir, tokenizer))


def _transformers_model(config: Dict, weights: Dict[str, torch.Tensor], source: Path) -> nn.Module:
    """transformers' model of ``config`` (a ``config.json``) holding ``weights``, float32, eval."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        hf_config = AutoConfig.for_model(**config)
        model_class = AutoModelForCausalLM._model_mapping[type(hf_config)]
        model = model_class.from_pretrained(
            None, config=hf_config, state_dict=weights, dtype=torch.float32
        )
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ValueError(f"transformers cannot build the model of {source}/config.json: {e}") from e
    return model.eval()


# ---- the command --------------------------------------------------------------------------------
def stream(chat: ChatModel, ids: Iterator[int], out: TextIO) -> List[int]:
    """Write the decoded text of ``ids`` to ``out`` as it grows; returns the ids."""
    tokens: List[int] = []
    shown = ""
    for token in ids:
        tokens.append(token)
        text = chat.tokenizer.decode(tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            out.write(text[len(shown):])
            out.flush()
            shown = text
    text = chat.tokenizer.decode(tokens, skip_special_tokens=True)
    out.write(text[len(shown):] + "\n")
    out.flush()
    return tokens


def main(args: argparse.Namespace) -> int:
    """``squash chat`` with the arguments :mod:`squash.cli` parsed."""
    try:
        base = Path(args.base) if args.base is not None else None
        chat = load_checkpoint(Path(args.checkpoint), base, args.device)
    except (OSError, ValueError) as e:
        print(f"squash chat: {e}", file=sys.stderr)
        return 1
    generator = torch.Generator().manual_seed(args.seed) if args.seed is not None else None
    prompts = [args.prompt] if args.prompt is not None else (line.rstrip("\n") for line in sys.stdin)
    history: List[Dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    for prompt in prompts:
        if not prompt.strip():
            continue
        history.append({"role": "user", "content": prompt})
        ids = chat.generate(
            chat.prompt_ids(history), args.max_new_tokens, args.temperature, args.top_k, generator
        )
        try:
            answer = stream(chat, ids, sys.stdout)
        except ValueError as e:  # a bad --max-new-tokens, --temperature or --top-k
            print(f"squash chat: {' '.join(str(e).split())}", file=sys.stderr)
            return 1
        history.append({"role": "assistant", "content": chat.tokenizer.decode(answer, skip_special_tokens=True)})
    return 0
