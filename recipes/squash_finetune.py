"""squash_finetune: fine-tune a (Q)LoRA model with FFI-sparse adapters on one device.

Run it as ``tune run squash_finetune --config configs/opt_tiny.yaml`` (installed with squash), or
copy it (``squash cp squash_finetune my_recipe.py``) and run the copy as
``tune run my_recipe --config ...`` from its directory.
"""

import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from omegaconf import DictConfig
from torchtune import config, training, utils
from torchtune.recipe_interfaces import FTRecipeInterface

from squash.assembly.model_setup import assemble_adapter_model, load_base
from squash.config.keys import FINETUNE_CONFIG_KEYS, check_component, get_int
from squash.config.overrides import overrides_in_one_line
from squash.config.validate import check_config
from squash.export import parse_export_config
from squash.merge import export_checkpoint, missing_exports
from squash.runs import checkpoint as ckpt
from squash.runs import resume, run_lock
from squash.runs.entry import close_metric_logger, config_errors_in_one_line
from squash.single_device import SingleDeviceRecipe
from squash.training import placement, progress, steps
from squash.training.masks import MaskUpdateSchedule, mask_update_due

log = utils.get_logger("INFO")

# Every top-level key this recipe reads: torchtune's LoRA recipe keys plus squash's own.
CONFIG_KEYS = FINETUNE_CONFIG_KEYS | {"export", "heldout"}  # export: {gguf: [f16, q8_0]}
# The keys the recipe cannot run without (``squash validate`` checks them too).
REQUIRED_KEYS = ("output_dir", "model", "tokenizer", "checkpointer", "dataset", "optimizer",
                 "loss", "epochs", "batch_size")


class SquashFinetuneRecipeSingleDevice(SingleDeviceRecipe, FTRecipeInterface):
    """QLoRA fine-tuning where adapter factors are Fixed Fan-In sparse, on one CUDA, ROCm or CPU
    device. Follows torchtune's ``lora_finetune_single_device`` and adds squash's keys.

    Features:
        - Any torchtune LoRA/QLoRA builder or squash builder in ``model`` (sparsity and
          ``sparse_factor`` are the builder's arguments); ``model.init: svd`` initialises the
          adapters from the singular vectors of the loaded base weights.
        - ``mask_update`` (``every_n_steps``, ``drop_fraction``, ``until_step``): prune and regrow
          each sparse row at constant fan-in, the drop fraction decayed by a cosine to 0 at
          ``until_step``; dense gradients are recorded only during the step before an update.
        - Gradient accumulation, ``clip_grad_norm``, activation checkpointing (and offloading on
          CUDA), ``compile`` (per decoder layer), fp32/bf16, chunked cross-entropy, lr schedules,
          torchtune's metric loggers, ``log_every_n_steps``, peak memory (max RSS on the CPU), one
          progress bar for the run (loss, lr, tokens/s, time left); ``output_dir/training.png``
          (loss, held-out loss and exact match, lr) redrawn at each evaluation and epoch end,
          with matplotlib; at the end, where the checkpoint, picture and logs are and the
          commands that use them.
        - Checkpoints ``output_dir/epoch_N`` and, every ``save_every_n_steps``,
          ``output_dir/step_N`` (the newest ``keep_last_n`` kept), each written atomically: squash
          adapter, PEFT adapter, merged HF weights (unless ``save_adapter_weights_only``) and the
          recipe state. ``resume_from_checkpoint: True`` continues from the newest one exactly:
          model, optimizer, masks, lr scheduler, data position and RNG.
        - A loss that is NaN or inf stops the run before the optimizer step, naming the step; the
          checkpoints already written stay as they are.

    Args:
        cfg (DictConfig): the parsed config.

    Raises:
        ConfigKeyError: an unknown or misspelled key (named with the nearest valid key), a bad
            value, a component that does not accept a key, ``mask_update`` on a model without a
            sparse factor, ``model.init: svd`` without squash adapters, a missing dataset column.
        ValueError: fp16 (unsupported, as in torchtune), activation offloading off CUDA.
        FileNotFoundError: ``resume_from_checkpoint`` with no checkpoint in ``output_dir``.
        RuntimeError: a NaN or inf loss.
    """

    def __init__(self, cfg: DictConfig) -> None:
        check_config(cfg, CONFIG_KEYS, REQUIRED_KEYS)
        picked = placement.resolve_config(cfg)  # auto: this host's choice, recorded
        log.info(picked.line())
        self._device = utils.get_device(device=picked.device)
        self._dtype = training.get_dtype(picked.dtype, device=self._device)
        if self._dtype == torch.float16:
            raise ValueError("dtype: fp16 is not supported (no loss scaling); use fp32 or bf16")
        self._output_dir = Path(cfg.output_dir)
        self._log_every_n_steps = get_int(cfg, "log_every_n_steps", 1, minimum=1)
        self._log_peak_memory_stats = bool(cfg.get("log_peak_memory_stats", True))
        self.seed = training.set_seed(
            seed=cfg.get("seed", None), debug_mode=cfg.get("cudnn_deterministic_mode", None)
        )
        self.total_epochs = get_int(cfg, "epochs", None, minimum=1)
        self.max_steps_per_epoch = get_int(cfg, "max_steps_per_epoch", None, minimum=1)
        self._grad_accum = get_int(cfg, "gradient_accumulation_steps", 1, minimum=1)
        self._batch_size = get_int(cfg, "batch_size", None, minimum=1)
        self._save_every_n_steps = get_int(cfg, "save_every_n_steps", None, minimum=1)
        self._keep_last_n = get_int(cfg, "keep_last_n", None, minimum=1)
        self._clip_grad_norm = cfg.get("clip_grad_norm", None)
        self._resume = bool(cfg.get("resume_from_checkpoint", False))
        self._adapter_only = bool(cfg.get("save_adapter_weights_only", False))
        self._export = parse_export_config(
            cfg.get("export", None), cfg.get("checkpointer", {}).get("checkpoint_dir", None)
        )
        self._act_ckpt = bool(cfg.get("enable_activation_checkpointing", False))
        self._act_offload = bool(cfg.get("enable_activation_offloading", False))
        if self._act_offload and (self._device.type != "cuda" or not self._act_ckpt):
            raise ValueError(
                "enable_activation_offloading needs a CUDA/ROCm device and "
                "enable_activation_checkpointing: True"
            )
        self._mask_update = MaskUpdateSchedule.from_config(cfg.get("mask_update", None))
        self.epochs_run = 0
        self.global_step = 0
        self._steps_in_epoch = 0  # optimizer steps done in the current epoch (for resume)
        self._last_checkpoint: Optional[Path] = None

    # ---- setup ----------------------------------------------------------------------------------
    def setup(self, cfg: DictConfig) -> None:
        """Build everything from ``cfg``; when resuming, restore the newest checkpoint."""
        for key, positional in (("model", 0), ("tokenizer", 0), ("checkpointer", 0),
                                ("dataset", 1), ("optimizer", 1), ("lr_scheduler", 1),
                                ("loss", 0), ("metric_logger", 0)):  # fmt: skip
            if cfg.get(key) is not None:
                check_component(cfg[key], key, positional=positional)
        self._run_lock = run_lock.claim(cfg)  # before anything is written
        ckpt.clean_stale_temporaries(self._output_dir)  # what a killed run left; ours now

        recipe_state, resume_dir = None, None
        if self._resume:
            resume_dir, recipe_state = resume.find_resume_state(self._output_dir, cfg)
            self._restore_counters(recipe_state)
            self._last_checkpoint = resume_dir  # what a NaN stop names before the next save
            log.info(f"Resuming from {resume_dir} (global step {self.global_step})")
            self._redo_interrupted_export(resume_dir)

        # before the model: a corrected base (model.base_outliers) calibrates on its tokens
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._checkpointer, base_state_dict = load_base(cfg.checkpointer)
        self._model_cfg = cfg.model
        self._model, self._svd_init = assemble_adapter_model(
            cfg.model,
            base_state_dict,
            device=self._device,
            dtype=self._dtype,
            mask_update=self._mask_update,
            activation_checkpointing=self._act_ckpt,
            compile_model=cfg.get("compile", False),
            seed=self.seed,
            adapter=None if resume_dir is None else ckpt.load_squash_adapter(resume_dir),
            adapter_source=resume_dir,
            tokenizer=self._tokenizer,
        )
        self._act_ctx = training.get_act_offloading_ctx_manager(self._model, self._act_offload)
        del base_state_dict

        self._optimizer = config.instantiate(
            cfg.optimizer,
            steps.optimizer_params(
                self._model, cfg.get("lora_plus_lr_ratio", None), cfg.optimizer.get("lr", None)
            ),
        )
        if recipe_state is not None:
            self._optimizer.load_state_dict(recipe_state["optimizer"])
            resume.check_optimizer_state(self._model, self._optimizer, resume_dir)
        self._loss_fn = config.instantiate(cfg.loss)
        if cfg.get("compile", False):
            self._loss_fn = training.compile_loss(self._loss_fn)
        if self._loss_fn.__class__.__name__ == "CEWithChunkedOutputLoss":
            self._model.set_num_output_chunks(self._loss_fn.num_output_chunks)

        self._setup_data_and_schedule(cfg, recipe_state)

    # ---- checkpoints ----------------------------------------------------------------------------
    def _saved(self, path: Path, name: str) -> None:
        """GGUF files of each epoch checkpoint, in output_dir/gguf (``export.gguf``)."""
        if name.startswith("epoch_") and self._export:
            for f in export_checkpoint(path, self._export):
                log.info(f"Exported {f}")

    def _redo_interrupted_export(self, resume_dir: Path) -> None:
        """Write the GGUF files of the epoch checkpoint resumed from that a run killed during
        its export never wrote (its half-written temporary is removed by the export)."""
        missing = missing_exports(resume_dir, self._export) if self._export else {}
        if resume_dir.name.startswith("epoch_") and missing:
            log.info(f"Exporting {resume_dir.name} again: the run that saved it did not finish")
            for f in export_checkpoint(resume_dir, missing):
                log.info(f"Exported {f}")

    # ---- training -------------------------------------------------------------------------------
    def _loss_step(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch.pop("labels")  # (b, s)
        with self._act_ctx:
            logits = self._model(**batch)
        # predict token t+1 at position t: shift the labels, not the logits
        labels = torch.hstack((labels[..., 1:], self._ignore_labels[: labels.shape[0]]))
        if not isinstance(logits, list):
            labels = labels.reshape(-1)
            logits = logits.reshape(-1, logits.size(-1))
        return self._loss_fn(logits, labels)

    def train(self) -> None:
        """The training loop; step and epoch checkpoints as configured; with a ``heldout``
        block, the held-out loss and answer before the first step and after the last."""
        if self._heldout is not None:
            self._plot.evaluated(self._heldout.report(self._model), self.global_step)
        t0 = time.perf_counter()
        running_loss, num_tokens, micro = 0.0, 0, 0
        pbar = progress.training_bar(self.total_epochs * self._steps_per_epoch, self.global_step)
        with self._profiler as prof:
            for curr_epoch in range(self.epochs_run, self.total_epochs):
                self._dataloader.sampler.set_epoch(curr_epoch)
                # The RNG of a resumed run restored before or after making the iterator
                batches = resume.epoch_batches(
                    self._dataloader,
                    self._pending_rng,
                    mid_epoch=self._steps_in_epoch > 0,
                    device=self._device,
                )
                self._pending_rng = None
                for batch in batches:
                    if self._steps_in_epoch >= self._steps_per_epoch:
                        break
                    step = self.global_step + 1
                    if micro == 0 and mask_update_due(self._mask_update, step):
                        steps.start_mask_recording(
                            self._model, self._mask_update, step, self._grad_accum
                        )
                    utils.batch_to_device(batch, self._device)
                    tokens = (batch["labels"] != self._loss_fn.ignore_index).sum()
                    loss = self._loss_step(batch) * tokens
                    if not torch.isfinite(loss):
                        last = self._last_checkpoint or "none written yet"
                        raise RuntimeError(
                            f"The loss became {loss.item() / max(int(tokens), 1)} at step {step} "
                            f"(epoch {curr_epoch + 1}); stopping before the optimizer step. "
                            f"Last good checkpoint: {last}"
                        )
                    running_loss += loss.detach()
                    num_tokens += int(tokens)
                    loss.backward()
                    micro += 1
                    prof.step()
                    if micro < self._grad_accum:
                        continue

                    lr, grad_norm = steps.optimizer_step(
                        self._model,
                        self._optimizer,
                        self._lr_scheduler,
                        num_tokens=num_tokens,
                        clip_grad_norm=self._clip_grad_norm,
                    )
                    self.global_step = step
                    self._steps_in_epoch += 1
                    logs = {}
                    if mask_update_due(self._mask_update, step):
                        logs.update(
                            steps.apply_mask_update(self._model, self._optimizer, self._mask_update, step)
                        )

                    loss_value = float(running_loss) / max(num_tokens, 1)
                    elapsed = time.perf_counter() - t0
                    pbar.update(1)
                    pbar.set_description(
                        f"{curr_epoch + 1}|{step}|loss {loss_value:.4f} lr {lr:.2e} "
                        f"tok/s {num_tokens / elapsed:.0f}"
                    )
                    if step % self._log_every_n_steps == 0:
                        logs.update(
                            loss=loss_value, lr=lr, tokens_per_second_per_gpu=num_tokens / elapsed
                        )
                        if grad_norm is not None:
                            logs["grad_norm"] = grad_norm
                        if self._log_peak_memory_stats:
                            logs.update(steps.memory_stats(self._device))
                        self._metric_logger.log_dict(logs, step=step)
                    running_loss, num_tokens, micro = 0.0, 0, 0
                    if self._save_every_n_steps and step % self._save_every_n_steps == 0:
                        self.save_checkpoint(curr_epoch, name=f"step_{step}")
                        ckpt.prune_step_checkpoints(self._output_dir, self._keep_last_n)
                    t0 = time.perf_counter()
                self.epochs_run += 1
                self._steps_in_epoch = 0
                micro, running_loss, num_tokens = 0, 0.0, 0
                self.save_checkpoint(curr_epoch)
                self._plot.draw()
        pbar.close()
        if self._heldout is not None:
            self._plot.evaluated(self._heldout.report(self._model), self.global_step)
        print(progress.closing_lines(self._output_dir, self._last_checkpoint), flush=True)

    def cleanup(self) -> None:
        """Close the metric logger (its file is removed if the run logged nothing) and release
        ``output_dir``'s lock; the picture is redrawn first (a run stopped by an error too)."""
        if getattr(self, "_plot", None) is not None:
            self._plot.draw()
        close_metric_logger(getattr(self, "_metric_logger", None))
        if getattr(self, "_run_lock", None) is not None:
            self._run_lock.release()


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: ``tune run squash_finetune --config CONFIG [key=value ...]``."""
    with config_errors_in_one_line("squash_finetune"):
        config.log_config(recipe_name="SquashFinetuneRecipeSingleDevice", cfg=cfg)
        recipe = SquashFinetuneRecipeSingleDevice(cfg=cfg)
        try:
            recipe.setup(cfg=cfg)
            recipe.train()
        finally:
            recipe.cleanup()


if __name__ == "__main__":
    with overrides_in_one_line("squash_finetune"):  # a bad override: one line
        sys.exit(recipe_main())
