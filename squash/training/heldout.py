"""Held-out evaluation a recipe runs before and after training, so a user sees what changed.

A config's ``heldout`` block names a dataset of held-out samples (the same kind of block as
``dataset``) and what to report::

    heldout:
      dataset:
        _component_: squash.datasets.unicode_names_dataset
        split: validation
        max_samples: 32
      batch_size: 8         # samples per forward pass of the held-out loss
      prompt_index: 0       # the sample whose greedy answer is printed
      max_new_tokens: 24    # the greedy answer's length limit
      exact_match_samples: 0  # greedy-answer this many samples and count exact matches

The held-out loss is the mean cross-entropy per label token (the answer tokens of a chat
sample: those whose label is not the ignore index), token-weighted over all samples, computed as
the training loss is (labels shifted by one). The greedy answer decodes the argmax token after
the prompt (the tokens before the first label token) until a stop token or ``max_new_tokens``;
the answers are decoded ``batch_size`` prompts at a time (left-padded, with a KV cache where the
model has torchtune's), the same tokens as one prompt at a time without a cache.
"""

import contextlib
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, padded_collate_sft
from torchtune.generation import (
    get_causal_mask_from_padding_mask,
    get_position_ids_from_padding_mask,
)
from torchtune.modules.common_utils import local_kv_cache
from tqdm import tqdm

from squash.config.blocks import (  # noqa: F401  (parse_heldout: heldout.* as before)
    HELDOUT_KEYS,
    parse_heldout,
)
from squash.config.keys import ConfigKeyError
from squash.training.data import instantiate_dataset

def _logits(model: nn.Module, tokens: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    out = model(tokens, **kwargs)
    if isinstance(out, list):  # chunked output (CEWithChunkedOutputLoss)
        out = torch.cat(out, dim=1)
    return out.float()  # (b, s, vocab)


def token_loss(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = CROSS_ENTROPY_IGNORE_IDX
) -> Tuple[torch.Tensor, int]:
    """The summed cross-entropy of each position's logits against its own target: the one place a
    held-out loss is computed (:func:`next_token_loss`, :func:`heldout_loss`, the ``squash_eval``
    recipe, the quality benchmarks).

    Each token's loss is taken over the last dimension (float32, or float64 logits as they are)
    and the sum is taken in float64: torch's CPU ``cross_entropy`` with the classes in a middle
    dimension, or a float32 sum, is off by up to about 1e-4 nats a token at a 49k vocabulary.

    Args:
        logits (torch.Tensor): ``(b, s, vocab)``.
        targets (torch.Tensor): ``(b, s)``, ``ignore_index`` left out.
        ignore_index (int): the label of tokens outside the loss. Default -100.

    Returns:
        Tuple[torch.Tensor, int]: the sum (a float64 scalar on the CPU) and the number of target
        tokens scored.
    """
    if logits.dtype != torch.float64:
        logits = logits.float()
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                ignore_index=ignore_index, reduction="none")  # fmt: skip
    return per_token.double().sum().cpu(), int((targets != ignore_index).sum())


def next_token_loss(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = CROSS_ENTROPY_IGNORE_IDX
) -> Tuple[torch.Tensor, int]:
    """:func:`token_loss` of each position's prediction of the next label token.

    Args:
        logits (torch.Tensor): ``(b, s, vocab)``.
        labels (torch.Tensor): ``(b, s)``; position ``t``'s logits are scored against
            ``labels[:, t + 1]``, ``ignore_index`` left out.
        ignore_index (int): the label of tokens outside the loss. Default -100.

    Returns:
        Tuple[torch.Tensor, int]: the float64 sum and the number of label tokens scored.
    """
    return token_loss(logits[:, :-1], labels[:, 1:], ignore_index)


@torch.no_grad()
def heldout_loss(
    model: nn.Module,
    samples: List[Dict[str, List[int]]],
    *,
    pad_id: int,
    batch_size: int = 8,
    device: torch.device = torch.device("cpu"),
    ignore_index: int = CROSS_ENTROPY_IGNORE_IDX,
) -> Dict[str, float]:
    """Mean cross-entropy per label token over ``samples``.

    Args:
        model (nn.Module): a torchtune decoder, ``model(tokens) -> (b, s, vocab)`` logits (or a
            list of chunks along ``s``).
        samples (List[Dict[str, List[int]]]): ``{"tokens", "labels"}`` samples.
        pad_id (int): the padding token.
        batch_size (int): samples per forward pass. Default 8.
        device (torch.device): where the model is. Default CPU.
        ignore_index (int): the label of tokens outside the loss. Default -100.

    Returns:
        Dict[str, float]: ``loss`` (nats per token) and ``tokens`` (label tokens counted).

    Raises:
        ValueError: if no sample has a label token.
    """
    total, count = torch.zeros((), dtype=torch.float64), 0
    for start in range(0, len(samples), batch_size):
        batch = padded_collate_sft(
            samples[start : start + batch_size], padding_idx=pad_id, ignore_idx=ignore_index
        )
        tokens = batch["tokens"].to(device)  # (b, s)
        labels = batch["labels"].to(device)  # (b, s)
        loss, n = next_token_loss(_logits(model, tokens), labels, ignore_index)
        total, count = total + loss, count + n
    if count == 0:
        raise ValueError("the held-out samples have no label tokens to score")
    return {"loss": float(total / count), "tokens": float(count)}


def prompt_tokens(
    sample: Dict[str, List[int]],
    answer: Optional[str] = None,
    decode: Optional[Any] = None,
    ignore_index: int = CROSS_ENTROPY_IGNORE_IDX,
) -> List[int]:
    """The tokens a model answers from: those before a sample's first label token, extended by
    the label tokens of the answer's turn header when ``answer`` is known.

    A chat template often puts a header (``<|im_start|>assistant\n``) in the labelled turn
    before the answer itself; with ``answer`` and ``decode`` given, the prompt runs to the last
    position from which the remaining tokens still decode (special tokens skipped, whitespace
    stripped) to ``answer``, which is where a generation prompt ends.

    Raises:
        ValueError: a sample without label tokens.
    """
    first = next((i for i, lab in enumerate(sample["labels"]) if lab != ignore_index), None)
    if first is None:
        raise ValueError("the sample has no label tokens, so no answer to generate")
    tokens = list(sample["tokens"])
    end = first
    if answer is not None and decode is not None:
        for j in range(first, len(tokens)):
            if decode(tokens[j:]).strip() == answer:
                end = j
    return tokens[:end]


@torch.no_grad()
def greedy_tokens(
    model: nn.Module,
    prompt: List[int],
    *,
    max_new_tokens: int,
    stop_tokens: List[int],
    device: torch.device = torch.device("cpu"),
) -> List[int]:
    """Greedy decoding without a KV cache: append the argmax token until a stop token (not
    returned) or ``max_new_tokens``."""
    tokens = torch.tensor([prompt], device=device)  # (1, s)
    out: List[int] = []
    for _ in range(max_new_tokens):
        nxt = int(_logits(model, tokens)[0, -1].argmax())
        if nxt in stop_tokens:
            break
        out.append(nxt)
        tokens = torch.cat((tokens, torch.tensor([[nxt]], device=device)), dim=1)
    return out


def _cacheable(model: nn.Module) -> bool:
    """Whether ``model`` takes torchtune's KV caches (and has none set up already)."""
    return (
        callable(getattr(model, "setup_caches", None))
        and callable(getattr(model, "caches_are_setup", None))
        and not model.caches_are_setup()
        and isinstance(getattr(model, "tok_embeddings", None), nn.Embedding)
    )


@torch.no_grad()
def greedy_batch(
    model: nn.Module,
    prompts: List[List[int]],
    *,
    max_new_tokens: int,
    stop_tokens: List[int],
    pad_id: int,
    device: torch.device = torch.device("cpu"),
) -> List[List[int]]:
    """:func:`greedy_tokens` of several prompts in one batch: left-padded, a causal mask that
    hides the padding, positions counted from each prompt's first token, and a KV cache where
    the model takes torchtune's (without one, each step runs the whole batch again).

    Returns:
        List[List[int]]: each prompt's new tokens, up to its first stop token (not returned).
    """
    b, s = len(prompts), max(len(p) for p in prompts)
    total = s + max_new_tokens
    tokens = torch.full((b, total), pad_id, dtype=torch.long)
    real = torch.zeros((b, total), dtype=torch.bool)
    real[:, s:] = True  # the generated tokens
    for i, p in enumerate(prompts):
        tokens[i, s - len(p) : s] = torch.tensor(p, dtype=torch.long)
        real[i, s - len(p) : s] = True
    tokens, real = tokens.to(device), real.to(device)
    mask = get_causal_mask_from_padding_mask(real, target_seq_len=total)  # (b, total, total)
    pos = get_position_ids_from_padding_mask(real)  # (b, total)
    stop = torch.tensor(sorted(set(stop_tokens)), dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    new: List[List[int]] = [[] for _ in range(b)]
    cache = _cacheable(model)
    ctx = (
        local_kv_cache(model, batch_size=b, device=device, dtype=model.tok_embeddings.weight.dtype,
                       decoder_max_seq_len=total)  # fmt: skip
        if cache
        else contextlib.nullcontext()
    )

    def forward(start: int, end: int) -> torch.Tensor:
        """The last position's logits of ``tokens[:, :end]``, feeding ``start:end`` (cached)."""
        cols = mask[:, start:end] if cache else mask[:, start:end, :end]
        return _logits(model, tokens[:, start:end], input_pos=pos[:, start:end], mask=cols)[:, -1]

    with ctx:
        logits = forward(0, s)
        for step in range(max_new_tokens):
            nxt = logits.argmax(-1)  # (b,)
            done |= torch.isin(nxt, stop)
            if bool(done.all()):
                break
            for i in torch.nonzero(~done).flatten().tolist():
                new[i].append(int(nxt[i]))
            if step == max_new_tokens - 1:
                break
            tokens[:, s + step] = nxt
            logits = forward(s + step if cache else 0, s + step + 1)
    return new


class HeldoutEvaluator:
    """What a recipe calls at the start and the end of training (``heldout`` block).

    Args:
        settings (Dict[str, Any]): :func:`parse_heldout`'s result.
        tokenizer: the run's model tokenizer (``pad_id``, ``decode``, ``stop_tokens`` or
            ``eos_id``).
        device (torch.device): where the model is.
        ignore_index (int): the loss's ignore index.

    Raises:
        ConfigKeyError: ``heldout.prompt_index`` past the held-out samples; a sample the model
            answers that has no prompt (``train_on_input: True``) or no answer token; a sample
            as long as ``tokenizer.max_seq_len`` (it may have been cut).
    """

    def __init__(
        self, settings: Dict[str, Any], tokenizer: Any, device: torch.device, ignore_index: int
    ) -> None:
        ds = instantiate_dataset(settings["dataset"], tokenizer)
        self.samples = [ds[i] for i in range(len(ds))]
        # a question-answer dataset (squash.datasets) says what the answer is; otherwise the
        # answer is what the labels decode to
        self._answers = [ds.answer(i) if hasattr(ds, "answer") else None for i in range(len(ds))]
        self._questions = [ds.question(i) if hasattr(ds, "question") else None for i in range(len(ds))]
        if settings["prompt_index"] >= len(self.samples):
            raise ConfigKeyError(
                f"heldout.prompt_index is {settings['prompt_index']}, but heldout.dataset has "
                f"{len(self.samples)} samples"
            )
        # a sample cut at max_seq_len lost its answer's end: its loss and exact match would
        # score the wrong thing
        limit = getattr(tokenizer, "max_seq_len", None)
        for i, sample in enumerate(self.samples):
            if limit is not None and len(sample["tokens"]) >= limit:
                raise ConfigKeyError(
                    f"heldout.dataset: sample {i} is {len(sample['tokens'])} tokens, "
                    f"tokenizer.max_seq_len is {limit}: the sample may have been cut; "
                    "raise tokenizer.max_seq_len"
                )
        self._s = settings
        self._prompts: Dict[int, List[int]] = {}
        self._tok = tokenizer
        self._device = device
        self._ignore = ignore_index
        self._stop = list(getattr(tokenizer, "stop_tokens", None) or [tokenizer.eos_id])
        self.before: Optional[Dict[str, Any]] = None
        # each sample the model answers needs a prompt to generate from: a dataset that
        # trains on its input (train_on_input: True) labels every token, leaving none
        n = min(settings["exact_match_samples"], len(self.samples))
        for i in sorted({settings["prompt_index"], *range(n)}):
            try:
                prompt = self.prompt(i)
            except ValueError as e:  # no label token
                raise ConfigKeyError(f"heldout.dataset: sample {i}: {e}") from e
            if not prompt:
                raise ConfigKeyError(
                    f"heldout.dataset: sample {i} has no prompt to generate the held-out answer "
                    "from (every token is a label); set heldout.dataset.train_on_input: False"
                )

    def prompt(self, index: int) -> List[int]:
        """The prompt tokens of held-out sample ``index`` (see :func:`prompt_tokens`), found
        once: finding the end of a chat header decodes the sample's tail at each position."""
        if index not in self._prompts:
            self._prompts[index] = prompt_tokens(
                self.samples[index], self._answers[index], self._tok.decode, self._ignore
            )
        return self._prompts[index]

    def expected(self, index: int) -> str:
        """The expected answer of held-out sample ``index``."""
        if self._answers[index] is not None:
            return self._answers[index]
        s = self.samples[index]
        ids = [t for t, lab in zip(s["tokens"], s["labels"]) if lab != self._ignore]
        return self._tok.decode([t for t in ids if t not in self._stop]).strip()

    def answers(self, model: nn.Module, indices: List[int]) -> List[str]:
        """The model's greedy answers to the prompts of held-out samples ``indices``, stripped,
        ``heldout.batch_size`` prompts at a time (a progress bar for more than one answer)."""
        out: List[str] = []
        size = self._s["batch_size"]
        with tqdm(total=len(indices), desc="held-out answers", unit="answer", leave=False,
                  disable=len(indices) < 2) as bar:  # fmt: skip
            for start in range(0, len(indices), size):
                chunk = indices[start : start + size]
                ids = greedy_batch(
                    model,
                    [self.prompt(i) for i in chunk],
                    max_new_tokens=self._s["max_new_tokens"],
                    stop_tokens=self._stop,
                    pad_id=self._tok.pad_id,
                    device=self._device,
                )
                out += [self._tok.decode(t).strip() for t in ids]
                bar.update(len(chunk))
            bar.refresh()  # the full bar shown once, however fast the answers came
        return out

    def evaluate(self, model: nn.Module) -> Dict[str, Any]:
        """Held-out loss, the greedy answer to ``prompt_index``'s prompt and, if asked, the
        exact-match count; the model is put in eval mode and back."""
        was_training = model.training
        # only logits: a distillation student also returns hidden states when asked for them
        hidden = getattr(model, "output_hidden_states", None)
        if hidden:
            model.output_hidden_states = []
        model.eval()
        try:
            res: Dict[str, Any] = heldout_loss(
                model, self.samples, pad_id=self._tok.pad_id, batch_size=self._s["batch_size"],
                device=self._device, ignore_index=self._ignore,
            )  # fmt: skip
            n = min(self._s["exact_match_samples"], len(self.samples))
            index = self._s["prompt_index"]
            indices = list(range(n)) + ([index] if index >= n else [])
            answers = self.answers(model, indices)
            res["answer"] = answers[indices.index(index)]
            if n:
                res["exact_match"] = sum(a == self.expected(i) for i, a in zip(range(n), answers))
                res["exact_match_of"] = n
        finally:
            model.train(was_training)
            if hidden:
                model.output_hidden_states = hidden
        return res

    def report(self, model: nn.Module) -> Dict[str, Any]:
        """Evaluate and print: the first call as the run's start, later calls against it."""
        res = self.evaluate(model)
        index = self._s["prompt_index"]
        n = len(self.samples)
        if self.before is None:
            self.before = res
            prompt = self._questions[index] or self._tok.decode(self.prompt(index))
            lines = [
                f"Held-out loss before training: {res['loss']:.4f} "
                f"({n} samples, {int(res['tokens'])} answer tokens)",
                f"Held-out prompt: {_one_line(prompt)}",
                f"  expected answer:        {self.expected(index)}",
                f"  answer before training: {_one_line(res['answer'])}",
            ]
        else:
            b = self.before
            change = 100.0 * (res["loss"] - b["loss"]) / b["loss"]
            lines = [
                f"Held-out loss before training: {b['loss']:.4f}, after: {res['loss']:.4f} "
                f"({change:+.1f}%)",
                f"  expected answer:        {self.expected(index)}",
                f"  answer before training: {_one_line(b['answer'])}",
                f"  answer after training:  {_one_line(res['answer'])}",
            ]
        if "exact_match" in res:
            lines.append(
                f"  exact match: {res['exact_match']}/{res['exact_match_of']} held-out samples"
                + (f" (before: {self.before['exact_match']})" if res is not self.before else "")
            )
        print("\n".join(lines), flush=True)
        return res


def _one_line(text: str) -> str:
    """An answer as one printed line: its line breaks and runs of spaces as one space."""
    return " ".join(text.split())


def setup_heldout(
    block: Optional[Any], tokenizer: Any, *, device: torch.device, ignore_index: int
) -> Optional[HeldoutEvaluator]:
    """The evaluator for a config's ``heldout`` block, or None when there is none."""
    settings = parse_heldout(block)
    if settings is None:
        return None
    return HeldoutEvaluator(settings, tokenizer, device, ignore_index)
