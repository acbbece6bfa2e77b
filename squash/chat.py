"""``squash chat``: talk to a fine-tuned checkpoint with the model's own chat template.

Two ways to load a checkpoint directory (``<run>/epoch_N``):

- merged weights (the default): the Hugging Face model the recipe wrote beside the adapter,
  through transformers (``config.json``, ``model*.safetensors``, ``tokenizer.json``);
- ``--base DIR``: the base model from the HF checkpoint ``DIR`` rebuilt as squash trained it
  (the ``model`` block of ``squash_adapter_config.json``: the NF4 base and the FFI adapter), with
  ``squash_adapter.safetensors`` loaded on top; for runs saved with
  ``save_adapter_weights_only``.

Decoding is greedy (``temperature`` 0) or sampled (``temperature``, ``top_k``, ``seed``); tokens
are streamed as they are decoded, up to ``max_new_tokens`` or the end-of-turn token.
"""

import argparse
import inspect
import json
import sys
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, TextIO, Tuple

import torch
from torch import nn

from squash.training import checkpoint as ckpt

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


def _has_merged_weights(directory: Path) -> bool:
    return (directory / "config.json").is_file() and (
        any(directory.glob("model*.safetensors"))
    )


def load_merged(checkpoint_dir: Path, device: str = "cpu") -> ChatModel:
    """The merged HF weights of ``checkpoint_dir`` through transformers, with a KV cache.

    Raises:
        FileNotFoundError: no such directory, or no merged weights in it.
    """
    from transformers import AutoModelForCausalLM

    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise FileNotFoundError(f"Checkpoint directory {checkpoint_dir} does not exist")
    if not _has_merged_weights(checkpoint_dir):
        raise FileNotFoundError(
            f"No merged weights (config.json + model*.safetensors) in {checkpoint_dir}; for an "
            "adapter-only checkpoint give the base model with --base DIR"
        )
    model = AutoModelForCausalLM.from_pretrained(
        str(checkpoint_dir), dtype=torch.float32, local_files_only=True
    ).to(device).eval()
    tokenizer = _tokenizer(checkpoint_dir)

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

    return ChatModel(session, tokenizer, _eos_ids(checkpoint_dir, tokenizer))


def _base_state_dict(base_dir: Path, model_cfg) -> Dict[str, torch.Tensor]:
    """The base HF checkpoint's weights with torchtune's keys, for the family of its config."""
    from squash.export.gguf import load_merged_checkpoint

    config, weights = load_merged_checkpoint(base_dir)
    family = config.get("model_type")
    if family == "opt":
        from squash.models.opt import opt_hf_to_tune

        return opt_hf_to_tune(weights)
    heads = int(config["num_attention_heads"])
    kwargs = dict(
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        dim=int(config["hidden_size"]),
        head_dim=config.get("head_dim"),
    )
    if family == "llama":
        from torchtune.models.convert_weights import hf_to_tune

        sd = hf_to_tune(weights, **kwargs)
    elif family == "qwen2":
        from torchtune.models.qwen2._convert_weights import qwen2_hf_to_tune

        sd = qwen2_hf_to_tune(weights, **kwargs, tie_word_embeddings=False)
    else:
        raise ValueError(f"{base_dir}/config.json: model_type {family!r} is not one squash chat loads")
    if config.get("tie_word_embeddings"):
        sd.pop("output.weight", None)  # torchtune's tied models share tok_embeddings.weight
    return sd


def load_adapter(checkpoint_dir: Path, base_dir: Path, device: str = "cpu") -> ChatModel:
    """The base model of ``base_dir`` built as squash trained it (NF4 base, FFI adapter) with
    the squash adapter of ``checkpoint_dir`` (no KV cache: each token reruns the sequence).

    Raises:
        FileNotFoundError: a missing directory, adapter or adapter config.
        ValueError: an adapter or base that does not fit the model its config describes, or an
            ``init: svd`` adapter (whose base was changed in training: use the merged weights).
    """
    from omegaconf import OmegaConf
    from torchtune import config as tt_config

    checkpoint_dir, base_dir = Path(checkpoint_dir), Path(base_dir)
    for d in (checkpoint_dir, base_dir):
        if not d.is_dir():
            raise FileNotFoundError(f"Directory {d} does not exist")
    cfg_path = checkpoint_dir / ckpt.SQUASH_ADAPTER_CONFIG_FILE
    if not cfg_path.is_file():
        raise FileNotFoundError(f"No {ckpt.SQUASH_ADAPTER_CONFIG_FILE} in {checkpoint_dir}")
    model_cfg = OmegaConf.create(json.loads(cfg_path.read_text())["model"])
    if model_cfg.get("init") == "svd":
        raise ValueError(
            f"{cfg_path}: an init: svd adapter was trained against a base with its principal "
            "components removed; chat with the merged weights instead (leave out --base)"
        )
    adapter = ckpt.load_squash_adapter(checkpoint_dir)
    with torch.device(device):
        model: nn.Module = tt_config.instantiate(model_cfg)
    base = _base_state_dict(base_dir, model_cfg)
    missing, unexpected = model.load_state_dict(base, strict=False)
    missing = [k for k in missing if ".lora_" not in k]
    if missing or unexpected:
        raise ValueError(
            f"The base model in {base_dir} does not fit {model_cfg._component_}: missing "
            f"{missing[:5]}, unexpected {list(unexpected)[:5]}"
        )
    ckpt.load_adapter_into(model, adapter, checkpoint_dir / ckpt.SQUASH_ADAPTER_FILE)
    model.eval()
    has_tokenizer = any((checkpoint_dir / f).is_file() for f in ("tokenizer.json", "vocab.json"))
    tok_dir = checkpoint_dir if has_tokenizer else base_dir
    tokenizer = _tokenizer(tok_dir)

    def session() -> LogitsFn:
        seen: List[torch.Tensor] = []

        @torch.no_grad()
        def step(new: torch.Tensor) -> torch.Tensor:
            seen.append(new)
            return model(torch.cat(seen, dim=1).to(device))[0, -1]

        return step

    return ChatModel(session, tokenizer, _eos_ids(base_dir, tokenizer))


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
        if args.base is not None:
            chat = load_adapter(Path(args.checkpoint), Path(args.base), args.device)
        else:
            chat = load_merged(Path(args.checkpoint), args.device)
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
        answer = stream(chat, ids, sys.stdout)
        history.append({"role": "assistant", "content": chat.tokenizer.decode(answer, skip_special_tokens=True)})
    return 0
