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
the prompt (the tokens before the first label token) until a stop token or ``max_new_tokens``.
"""

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, padded_collate_sft
from tqdm import tqdm

from squash.config.blocks import (  # noqa: F401  (parse_heldout: heldout.* as before)
    HELDOUT_KEYS,
    parse_heldout,
)
from squash.config.keys import ConfigKeyError
from squash.training.data import instantiate_dataset

def _logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
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
            answers that has no prompt (``train_on_input: True``) or no answer token.
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
        self._s = settings
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
        """The prompt tokens of held-out sample ``index`` (see :func:`prompt_tokens`)."""
        return prompt_tokens(
            self.samples[index], self._answers[index], self._tok.decode, self._ignore
        )

    def expected(self, index: int) -> str:
        """The expected answer of held-out sample ``index``."""
        if self._answers[index] is not None:
            return self._answers[index]
        s = self.samples[index]
        ids = [t for t, lab in zip(s["tokens"], s["labels"]) if lab != self._ignore]
        return self._tok.decode([t for t in ids if t not in self._stop]).strip()

    def answer(self, model: nn.Module, index: int) -> str:
        """The model's greedy answer to held-out sample ``index``'s prompt, stripped."""
        ids = greedy_tokens(
            model,
            self.prompt(index),
            max_new_tokens=self._s["max_new_tokens"],
            stop_tokens=self._stop,
            device=self._device,
        )
        return self._tok.decode(ids).strip()

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
            res["answer"] = self.answer(model, self._s["prompt_index"])
            n = min(self._s["exact_match_samples"], len(self.samples))
            if n:
                # greedy answers take seconds each on a CPU: a progress bar for them
                hits = 0
                with tqdm(total=n, desc="held-out answers", unit="answer", leave=False,
                          disable=n < 2) as bar:  # fmt: skip
                    for i in range(n):
                        hits += self.answer(model, i) == self.expected(i)
                        bar.update()
                    bar.refresh()  # the full bar shown once, however fast the answers came
                res["exact_match"], res["exact_match_of"] = hits, n
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
                f"Held-out prompt: {' '.join(prompt.split())}",
                f"  expected answer:        {self.expected(index)}",
                f"  answer before training: {res['answer']}",
            ]
        else:
            b = self.before
            change = 100.0 * (res["loss"] - b["loss"]) / b["loss"]
            lines = [
                f"Held-out loss before training: {b['loss']:.4f}, after: {res['loss']:.4f} "
                f"({change:+.1f}%)",
                f"  expected answer:        {self.expected(index)}",
                f"  answer before training: {b['answer']}",
                f"  answer after training:  {res['answer']}",
            ]
        if "exact_match" in res:
            lines.append(
                f"  exact match: {res['exact_match']}/{res['exact_match_of']} held-out samples"
                + (f" (before: {self.before['exact_match']})" if res is not self.before else "")
            )
        print("\n".join(lines), flush=True)
        return res


def setup_heldout(
    block: Optional[Any], tokenizer: Any, *, device: torch.device, ignore_index: int
) -> Optional[HeldoutEvaluator]:
    """The evaluator for a config's ``heldout`` block, or None when there is none."""
    settings = parse_heldout(block)
    if settings is None:
        return None
    return HeldoutEvaluator(settings, tokenizer, device, ignore_index)
