"""squash_eval: held-out loss and perplexity of a model plus adapter, with tokens/s.

Run it as ``tune run squash_eval --config configs/opt_tiny_eval.yaml`` (installed with squash).
Two ways to name what is evaluated:

- a squash adapter: ``model`` is the squash (or LoRA/QLoRA) builder it was trained with,
  ``checkpointer`` loads the base weights, ``adapter_dir`` is a checkpoint directory of
  ``squash_finetune``/``squash_distill`` (``output_dir/epoch_N`` or ``step_N``);
- merged weights: ``model`` is the plain builder (``squash.models.opt.opt_350m``),
  ``checkpointer`` loads the merged HF weights of such a checkpoint directory, ``adapter_dir``
  is null. A model with adapters and no ``adapter_dir`` is its base alone (the adapters start
  at zero), e.g. the NF4 model before training.
"""

import json
import math
import sys
import time
from pathlib import Path
from typing import Dict

import torch
from omegaconf import DictConfig
from torchtune import config, training, utils
from torchtune.recipe_interfaces import EvalRecipeInterface

from squash.assembly.model_setup import assemble_trained_model, load_base, setup_frozen_model
from squash.config.keys import check_component, get_int
from squash.config.overrides import overrides_in_one_line
from squash.config.validate import check_config
from squash.merge import trained_model_block
from squash.runs import checkpoint as ckpt
from squash.runs import run_lock
from squash.runs.entry import close_metric_logger, config_errors_in_one_line
from squash.training import data, placement
from squash.training.heldout import next_token_loss

log = utils.get_logger("INFO")

CONFIG_KEYS = {
    "output_dir", "model", "tokenizer", "checkpointer", "adapter_dir", "dataset", "batch_size",
    "collate_fn", "max_batches", "device", "dtype", "seed", "compile", "metric_logger",
    "ignore_index",
}  # fmt: skip
RESULTS_FILE = "eval_results.json"
# The keys the recipe cannot run without (``squash validate`` checks them too).
REQUIRED_KEYS = ("output_dir", "model", "tokenizer", "checkpointer", "dataset", "batch_size")


class SquashEvalRecipe(EvalRecipeInterface):
    """Next-token cross-entropy of a model over a dataset, as ``squash_finetune`` computes its
    training loss: the label of position ``t`` is the token at ``t + 1``, labels equal to
    ``ignore_index`` (padding, and the prompt unless the dataset has ``train_on_input``) do not
    count, and the loss is the mean over all counted tokens of the dataset (not a mean of batch
    means). Perplexity is ``exp(loss)``.

    Writes ``output_dir/eval_results.json`` (``loss``, ``perplexity``, ``tokens`` counted,
    ``input_tokens`` (not padding), ``seconds``, ``tokens_per_second`` (input tokens through the
    model per second of forward passes), ``batches``) and logs the same through ``metric_logger``
    when one is set.

    Args:
        cfg (DictConfig): the parsed config.

    Raises:
        ConfigKeyError: an unknown or misspelled key, a missing one, a bad value, a component that
            does not accept a key, a ``model`` key whose value differs from the one the run of
            ``adapter_dir`` trained with (the adapter is evaluated in the model it trained in:
            that run's ``model`` block, through the training assembly).
        FileNotFoundError: an ``adapter_dir`` without a squash adapter.
        ValueError: weights or an adapter that do not fit ``model``; a dataset with no token
            that counts.
    """

    def __init__(self, cfg: DictConfig) -> None:
        check_config(cfg, CONFIG_KEYS, REQUIRED_KEYS)
        picked = placement.resolve_config(cfg)  # auto: this host's choice, recorded
        log.info(picked.line())
        self._device = utils.get_device(device=picked.device)
        self._dtype = training.get_dtype(picked.dtype, device=self._device)
        self._output_dir = Path(cfg.output_dir)
        self._batch_size = get_int(cfg, "batch_size", None, minimum=1)
        self._max_batches = get_int(cfg, "max_batches", None, minimum=1)
        self._ignore_index = cfg.get("ignore_index", -100)
        self.seed = training.set_seed(seed=cfg.get("seed", None))

    def setup(self, cfg: DictConfig) -> None:
        """Build the model (and load the adapter), the tokenizer and the data."""
        for key, positional in (("model", 0), ("tokenizer", 0), ("checkpointer", 0),
                                ("dataset", 1), ("metric_logger", 0)):  # fmt: skip
            if cfg.get(key) is not None:
                check_component(cfg[key], key, positional=positional)
        # verifies adapter_dir; before anything is written
        self._run_lock = run_lock.claim(cfg, trains=False)
        self._metric_logger = None
        if cfg.get("metric_logger") is not None:
            self._metric_logger = config.instantiate(cfg.metric_logger)
            self._metric_logger.log_config(cfg)
        # before the model: a corrected base (model.base_outliers) calibrates on its tokens
        self._tokenizer = config.instantiate(cfg.tokenizer)
        _, base_state_dict = load_base(cfg.checkpointer)
        adapter_dir = cfg.get("adapter_dir", None)
        if adapter_dir is None:
            self._model = setup_frozen_model(
                cfg.model,
                base_state_dict,
                device=self._device,
                dtype=self._dtype,
                where="model (checkpointer)",
                tokenizer=self._tokenizer,
            )
        else:  # the model the adapter trained in: its run's model block, the training assembly
            adapter_dir = Path(adapter_dir)
            self._model = assemble_trained_model(
                trained_model_block(cfg.model, adapter_dir),
                base_state_dict,
                ckpt.load_squash_adapter(adapter_dir),
                adapter_source=adapter_dir,
                device=self._device,
                dtype=self._dtype,
                tokenizer=self._tokenizer,
            )
            log.info(f"Loaded the adapter of {adapter_dir}")
        if cfg.get("compile", False):
            training.compile_model(self._model)
        self._dataloader = data.setup_dataloader(
            cfg.dataset,
            self._tokenizer,
            batch_size=self._batch_size,
            shuffle=False,
            seed=self.seed,
            collate_fn=cfg.get("collate_fn", None),
            ignore_index=self._ignore_index,
            recorded=None if self._run_lock is None else self._run_lock.inputs,
            drop_last=False,
        )

    @torch.inference_mode()
    def evaluate(self) -> Dict[str, float]:
        """Run the model over the data; returns (and writes) the results."""
        loss_sum = torch.zeros((), dtype=torch.float64)
        counted, input_tokens, batches, seconds = 0, 0, 0, 0.0
        for batch in self._dataloader:
            if self._max_batches is not None and batches >= self._max_batches:
                break
            utils.batch_to_device(batch, self._device)
            labels = batch.pop("labels")  # (b, s)
            if self._device.type == "cuda":
                torch.cuda.synchronize(self._device)
            t0 = time.perf_counter()
            logits = self._model(**batch)  # (b, s, v)
            if self._device.type == "cuda":
                torch.cuda.synchronize(self._device)
            seconds += time.perf_counter() - t0
            loss, n = next_token_loss(logits, labels, self._ignore_index)
            loss_sum, counted = loss_sum + loss, counted + n
            input_tokens += int((batch["tokens"] != self._tokenizer.pad_id).sum())
            batches += 1
        if counted == 0:
            raise ValueError("dataset: no token counts (every label is ignore_index)")
        loss = float(loss_sum / counted)
        results = {
            "loss": loss,
            "perplexity": math.exp(loss),
            "tokens": counted,
            "input_tokens": input_tokens,
            "batches": batches,
            "seconds": seconds,
            "tokens_per_second": input_tokens / seconds if seconds > 0 else float("nan"),
        }
        log.info(
            f"Held-out loss {loss:.6f}, perplexity {results['perplexity']:.4f} over {counted} "
            f"tokens ({batches} batches); {results['tokens_per_second']:.0f} tokens/s"
        )
        self._output_dir.mkdir(parents=True, exist_ok=True)
        (self._output_dir / RESULTS_FILE).write_text(json.dumps(results, indent=2))
        if self._metric_logger is not None:
            self._metric_logger.log_dict(
                {f"eval/{k}": float(v) for k, v in results.items()}, step=0
            )
        return results

    def cleanup(self) -> None:
        """Close the metric logger (its file is removed if the run logged nothing) and release
        ``output_dir``'s lock."""
        close_metric_logger(getattr(self, "_metric_logger", None))
        if getattr(self, "_run_lock", None) is not None:
            self._run_lock.release()


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: ``tune run squash_eval --config CONFIG [key=value ...]``."""
    with config_errors_in_one_line("squash_eval"):
        config.log_config(recipe_name="SquashEvalRecipe", cfg=cfg)
        recipe = SquashEvalRecipe(cfg=cfg)
        try:
            recipe.setup(cfg=cfg)
            recipe.evaluate()
        finally:
            recipe.cleanup()


if __name__ == "__main__":
    with overrides_in_one_line("squash_eval"):  # a bad override: one line
        sys.exit(recipe_main())
