"""squash_distill: train a squash (or LoRA/QLoRA) student against a frozen teacher on one device.

Run it as ``tune run squash_distill --config configs/opt_tiny_distill.yaml`` (installed with
squash), or copy it (``squash cp squash_distill my_recipe.py``) and run the copy as
``tune run my_recipe --config ...`` from its directory.

The loss of each batch is

    task_weight * CE(student) + kd_weight * KL(teacher || student) + squarehead_weight * SquareHead

with SquareHead (Kurtic et al., 2023) summed over ``squarehead_layers``.
"""

import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from omegaconf import DictConfig, ListConfig
from torchtune import config, training, utils
from torchtune.recipe_interfaces import FTRecipeInterface
from tqdm import tqdm

from squash.assembly.model_setup import assemble_adapter_model, load_base, setup_frozen_model
from squash.config.keys import (
    FINETUNE_CONFIG_KEYS,
    ConfigKeyError,
    check_component,
    get_int,
)
from squash.config.overrides import overrides_in_one_line
from squash.config.validate import check_config
from squash.losses import LogitKLLoss, SquareHeadLoss
from squash.runs import checkpoint as ckpt
from squash.runs import resume, run_lock
from squash.runs.entry import close_metric_logger, config_errors_in_one_line
from squash.single_device import SingleDeviceRecipe
from squash.training import placement, steps
from squash.training.masks import MaskUpdateSchedule, mask_update_due

log = utils.get_logger("INFO")

# squash_finetune's keys, plus the teacher and the loss weights.
CONFIG_KEYS = FINETUNE_CONFIG_KEYS | {
    "teacher", "teacher_checkpointer", "teacher_dtype", "task_weight", "kd_weight",
    "squarehead_weight", "squarehead_layers", "kd_loss", "squarehead_loss", "heldout",
}  # fmt: skip
# The keys the recipe cannot run without (``squash validate`` checks them too).
REQUIRED_KEYS = ("output_dir", "model", "tokenizer", "checkpointer", "teacher",
                 "teacher_checkpointer", "dataset", "optimizer", "loss", "epochs", "batch_size")


class SquashDistillRecipeSingleDevice(SingleDeviceRecipe, FTRecipeInterface):
    """Distillation into a QLoRA student whose adapter factors are Fixed Fan-In sparse, on one
    CUDA, ROCm or CPU device. Everything of ``squash_finetune`` works the same way (the same
    :mod:`squash.training` functions build the student and the data, move the masks and
    write and resume checkpoints); a teacher is added.

    Features:
        - ``teacher`` (any model builder) loaded by ``teacher_checkpointer``: frozen, no
          gradient, in eval mode, in ``teacher_dtype`` (default: ``dtype``; ``bf16`` halves its
          memory).
        - Loss ``task_weight * CE + kd_weight * KL + squarehead_weight * SquareHead``: CE is
          ``loss`` (as in ``squash_finetune``), KL is ``kd_loss`` (default
          :class:`~squash.losses.LogitKLLoss`, over the tokens whose label counts), SquareHead
          is ``squarehead_loss`` (default :class:`~squash.losses.SquareHeadLoss`, over the
          non-padding positions) of the hidden states at ``squarehead_layers``. Terms with
          weight 0 are not computed. Each term is logged (``task_loss``, ``kd_loss``,
          ``squarehead_loss``) along with their weighted sum (``loss``).
        - Hidden states come from torchtune's ``TransformerDecoder.output_hidden_states``: layer
          ``l`` means the input of decoder layer ``l`` (the output of layer ``l - 1``); the last
          layer's output reaches the loss through the logits. ``squarehead_layers: null`` takes
          layers ``1 .. num_layers - 1``.
        - Every key of ``squash_finetune``: any LoRA/QLoRA/squash student builder,
          ``mask_update``, gradient accumulation, ``clip_grad_norm``, activation checkpointing,
          ``compile`` (student and teacher), chunked losses, lr schedules, metric loggers,
          atomic ``epoch_N``/``step_N`` checkpoints (squash adapter, PEFT adapter, merged
          weights) and exact resume (model, optimizer, masks, lr scheduler, data position, RNG),
          ``output_dir/training.png`` (``loss`` is the weighted sum).
        - A NaN or inf loss stops the run before the optimizer step, naming the step.

    Args:
        cfg (DictConfig): the parsed config.

    Raises:
        ConfigKeyError: as ``squash_finetune``, and: a negative loss weight or all of them 0,
            ``squarehead_layers`` that is not a list of layer indices of both models.
        ValueError: fp16 (unsupported, as in torchtune), activation offloading off CUDA, teacher
            weights that do not fit ``teacher``; at the first step, student and teacher hidden
            states of different shapes (raised by :class:`~squash.losses.SquareHeadLoss`).
        FileNotFoundError: ``resume_from_checkpoint`` with no checkpoint in ``output_dir``.
        RuntimeError: a NaN or inf loss.
    """

    def __init__(self, cfg: DictConfig) -> None:
        check_config(cfg, CONFIG_KEYS, REQUIRED_KEYS)
        picked = placement.resolve_config(cfg)  # auto: this host's choice, recorded
        teacher_dtype, why = picked.dtype, "not set; = dtype"
        if cfg.get("teacher_dtype", None) is not None:
            teacher_dtype, why = placement.resolve_dtype(cfg.teacher_dtype, picked.device)
            cfg.teacher_dtype = teacher_dtype
        log.info(f"{picked.line()}; teacher_dtype: {teacher_dtype} ({why})")
        self._device = utils.get_device(device=picked.device)
        self._dtype = training.get_dtype(picked.dtype, device=self._device)
        self._teacher_dtype = training.get_dtype(teacher_dtype, device=self._device)
        if torch.float16 in (self._dtype, self._teacher_dtype):
            raise ValueError("dtype: fp16 is not supported (no loss scaling); use fp32 or bf16")
        self._weights = {}
        for key, default in (("task_weight", 1.0), ("kd_weight", 0.0), ("squarehead_weight", 0.0)):
            value = cfg.get(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigKeyError(f"{key} must be a number >= 0, got {value!r}")
            self._weights[key] = float(value)
        if not any(self._weights.values()):
            raise ConfigKeyError("task_weight, kd_weight and squarehead_weight are all 0")
        layers = cfg.get("squarehead_layers", None)
        if layers is not None and (
            not isinstance(layers, (list, ListConfig))
            or not layers
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
        ):
            raise ConfigKeyError(
                f"squarehead_layers must be a non-empty list of layer indices or null, got {layers!r}"
            )
        self._squarehead_layers = None if layers is None else sorted(set(int(i) for i in layers))
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
                                ("teacher", 0), ("teacher_checkpointer", 0), ("dataset", 1),
                                ("optimizer", 1), ("lr_scheduler", 1), ("loss", 0),
                                ("kd_loss", 0), ("squarehead_loss", 0),
                                ("metric_logger", 0)):  # fmt: skip
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

        _, teacher_state_dict = load_base(cfg.teacher_checkpointer, "teacher_checkpointer")
        self._teacher = setup_frozen_model(
            cfg.teacher,
            teacher_state_dict,
            device=self._device,
            dtype=self._teacher_dtype,
            where="teacher (teacher_checkpointer)",
            tokenizer=self._tokenizer,
        )
        if cfg.get("compile", False):
            training.compile_model(self._teacher)
        self._setup_hidden_states()
        log.info(f"Teacher {cfg.teacher._component_}: {self._teacher_dtype}, frozen, eval mode")

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
        self._kd_loss_fn = (
            config.instantiate(cfg.kd_loss)
            if cfg.get("kd_loss") is not None
            else LogitKLLoss(ignore_index=self._loss_fn.ignore_index)
        )
        self._squarehead_fn = (
            config.instantiate(cfg.squarehead_loss)
            if cfg.get("squarehead_loss") is not None
            else SquareHeadLoss()
        )
        if cfg.get("compile", False):
            self._loss_fn = training.compile_loss(self._loss_fn)
        if self._loss_fn.__class__.__name__ == "CEWithChunkedOutputLoss":
            self._model.set_num_output_chunks(self._loss_fn.num_output_chunks)
            self._teacher.set_num_output_chunks(self._loss_fn.num_output_chunks)

        self._setup_data_and_schedule(cfg, recipe_state)

    def _setup_hidden_states(self) -> None:
        """Ask student and teacher for the hidden states SquareHead needs (none if its weight is
        0), after checking that both models have those layers."""
        n_student, n_teacher = len(self._model.layers), len(self._teacher.layers)
        if self._squarehead_layers is None:
            self._squarehead_layers = list(range(1, min(n_student, n_teacher)))
        bad = [i for i in self._squarehead_layers if not 0 <= i < min(n_student, n_teacher)]
        if bad:
            raise ConfigKeyError(
                f"squarehead_layers: {bad} outside the layers of the student ({n_student}) or "
                f"the teacher ({n_teacher})"
            )
        if self._weights["squarehead_weight"] == 0:
            self._squarehead_layers = []
        if self._weights["squarehead_weight"] > 0 and not self._squarehead_layers:
            raise ConfigKeyError("squarehead_weight > 0 but there is no layer to match")
        # torchtune's TransformerDecoder returns the inputs of these layers before the logits.
        self._model.output_hidden_states = list(self._squarehead_layers)
        self._teacher.output_hidden_states = list(self._squarehead_layers)

    # ---- training -------------------------------------------------------------------------------
    def _split(self, output: Any) -> Tuple[List[torch.Tensor], Any]:
        """``([hidden states], logits)`` of a model's output (logits: a tensor or chunks)."""
        n = len(self._squarehead_layers)
        if n == 0:
            return [], output
        return list(output[:n]), output[n]

    def _loss_step(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Each loss term of one micro-batch (a per-token mean), and their weighted sum."""
        labels = batch.pop("labels")  # (b, s)
        w = self._weights
        need_teacher = w["kd_weight"] > 0 or w["squarehead_weight"] > 0
        if need_teacher:
            with torch.no_grad():
                t_hidden, t_logits = self._split(self._teacher(**batch))
        with self._act_ctx:
            s_hidden, s_logits = self._split(self._model(**batch))
        # predict token t+1 at position t: shift the labels, not the logits
        labels = torch.hstack((labels[..., 1:], self._ignore_labels[: labels.shape[0]]))
        terms: Dict[str, torch.Tensor] = {}
        total = 0.0
        if w["task_weight"] > 0:
            if isinstance(s_logits, list):
                terms["task_loss"] = self._loss_fn(s_logits, labels)
            else:
                terms["task_loss"] = self._loss_fn(
                    s_logits.reshape(-1, s_logits.size(-1)), labels.reshape(-1)
                )
            total = total + w["task_weight"] * terms["task_loss"]
        if w["kd_weight"] > 0:
            terms["kd_loss"] = self._kd_loss_fn(s_logits, t_logits, labels)
            total = total + w["kd_weight"] * terms["kd_loss"]
        if w["squarehead_weight"] > 0:
            mask = batch["tokens"] != self._tokenizer.pad_id  # (b, s): not padding
            terms["squarehead_loss"] = self._squarehead_fn(s_hidden, t_hidden, mask)
            total = total + w["squarehead_weight"] * terms["squarehead_loss"]
        terms["loss"] = total
        return terms

    def train(self) -> None:
        """The training loop; step and epoch checkpoints as configured; with a ``heldout``
        block, the student's held-out loss and answer before the first step and after the last."""
        if self._heldout is not None:
            self._plot.evaluated(self._heldout.report(self._model), self.global_step)
        t0 = time.perf_counter()
        running: Dict[str, Any] = {}
        num_tokens, micro = 0, 0
        with self._profiler as prof:
            for curr_epoch in range(self.epochs_run, self.total_epochs):
                self._dataloader.sampler.set_epoch(curr_epoch)
                pbar = tqdm(total=self._steps_per_epoch, initial=self._steps_in_epoch)
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
                    terms = self._loss_step(batch)
                    loss = terms["loss"] * tokens
                    if not torch.isfinite(loss):
                        last = self._last_checkpoint or "none written yet"
                        raise RuntimeError(
                            f"The loss became {loss.item() / max(int(tokens), 1)} at step {step} "
                            f"(epoch {curr_epoch + 1}); stopping before the optimizer step. "
                            f"Last good checkpoint: {last}"
                        )
                    for key, value in terms.items():
                        running[key] = running.get(key, 0.0) + value.detach() * tokens
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
                        # adapters that no loss term reaches (layers after the last one that
                        # SquareHead matches, when it is the only term) keep their masks
                        logs.update(
                            steps.apply_mask_update(
                                self._model,
                                self._optimizer,
                                self._mask_update,
                                step,
                                skip_untrained=True,
                            )
                        )

                    values = {k: float(v) / max(num_tokens, 1) for k, v in running.items()}
                    elapsed = time.perf_counter() - t0
                    pbar.update(1)
                    pbar.set_description(
                        f"{curr_epoch + 1}|{step}|loss {values['loss']:.4f} lr {lr:.2e} "
                        f"tok/s {num_tokens / elapsed:.0f}"
                    )
                    if step % self._log_every_n_steps == 0:
                        logs.update(values)
                        logs.update(lr=lr, tokens_per_second_per_gpu=num_tokens / elapsed)
                        if grad_norm is not None:
                            logs["grad_norm"] = grad_norm
                        if self._log_peak_memory_stats:
                            logs.update(steps.memory_stats(self._device))
                        self._metric_logger.log_dict(logs, step=step)
                    running, num_tokens, micro = {}, 0, 0
                    if self._save_every_n_steps and step % self._save_every_n_steps == 0:
                        self.save_checkpoint(curr_epoch, name=f"step_{step}")
                        ckpt.prune_step_checkpoints(self._output_dir, self._keep_last_n)
                    t0 = time.perf_counter()
                pbar.close()
                self.epochs_run += 1
                self._steps_in_epoch = 0
                running, num_tokens, micro = {}, 0, 0
                self.save_checkpoint(curr_epoch)
                self._plot.draw()
        if self._heldout is not None:
            self._plot.evaluated(self._heldout.report(self._model), self.global_step)

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
    """Entry point: ``tune run squash_distill --config CONFIG [key=value ...]``."""
    with config_errors_in_one_line("squash_distill"):
        config.log_config(recipe_name="SquashDistillRecipeSingleDevice", cfg=cfg)
        recipe = SquashDistillRecipeSingleDevice(cfg=cfg)
        try:
            recipe.setup(cfg=cfg)
            recipe.train()
        finally:
            recipe.cleanup()


if __name__ == "__main__":
    with overrides_in_one_line("squash_distill"):  # a bad override: one line
        sys.exit(recipe_main())
