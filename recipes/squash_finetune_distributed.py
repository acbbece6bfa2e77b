"""squash_finetune_distributed: fine-tune a (Q)LoRA model with FFI-sparse adapters on several
devices with PyTorch FSDP2.

Run it as ``tune run --nproc_per_node 2 squash_finetune_distributed --config
configs/opt_tiny_distributed.yaml`` (installed with squash; torchrun underneath), or copy it
(``squash cp squash_finetune_distributed my_recipe.py``) and run the copy by its name.
"""

import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from safetensors.torch import save_file
from torch import nn
from torchtune import config, training, utils
from torchtune.recipe_interfaces import FTRecipeInterface
from tqdm import tqdm

from squash.assembly import fsdp
from squash.assembly.model_setup import assemble_adapter_model, load_base
from squash.config.keys import FINETUNE_CONFIG_KEYS, check_component, get_int
from squash.config.overrides import overrides_in_one_line
from squash.config.validate import check_config
from squash.export import adapters
from squash.modules import get_adapter_buffers
from squash.modules.surgery import state_dict_key
from squash.runs import checkpoint as ckpt
from squash.runs import resume, run_lock
from squash.runs.entry import close_metric_logger, config_errors_in_one_line, open_metric_logger
from squash.training import distributed as sq_dist
from squash.training import data, placement, steps
from squash.training.masks import MaskUpdateSchedule, mask_update_due, record_dense_grads
from squash.training.plot import TrainingPlot

log = utils.get_logger("INFO")

# The single-device recipe's keys, plus FSDP's (as in torchtune's lora_finetune_distributed) and
# ``debug``.
CONFIG_KEYS = FINETUNE_CONFIG_KEYS | {
    "fsdp_cpu_offload", "fsdp_reshard_after_forward", "custom_sharded_layers", "debug",
}  # fmt: skip
# The keys the recipe cannot run without (``squash validate`` checks them too).
REQUIRED_KEYS = ("output_dir", "model", "tokenizer", "checkpointer", "dataset", "optimizer",
                 "loss", "epochs", "batch_size")


class SquashFinetuneRecipeDistributed(FTRecipeInterface):
    """QLoRA fine-tuning with Fixed Fan-In sparse adapter factors, sharded with FSDP2
    (``fully_shard`` per decoder layer) over the processes ``tune run --nproc_per_node N`` (or
    ``torchrun``) starts: NCCL/RCCL on GPUs, gloo on the CPU. Follows torchtune's
    ``lora_finetune_distributed``; the config keys are ``squash_finetune``'s plus FSDP's.

    Features:
        - The model is built on the meta device and sharded before any weight exists: NF4 base
          weights, FFI values and dense factors are sharded by rows; the FFI indices are
          buffers, replicated whole and identical on every rank (taken from rank 0). NF4 weights
          torchao cannot split evenly over the ranks (tiny models) stay whole on every rank.
        - Every rank reads the base checkpoint and keeps its own shard, as torchtune does; the
          adapters are then initialised from generators seeded by ``seed`` and the module name
          (:mod:`squash.assembly.adapter_init`), so a run starts from the same adapter on any
          number of devices, ``squash_finetune`` included. ``model.init: svd`` is supported.
        - ``mask_update``: each rank records the dense gradient of its micro-batches; before an
          update they are summed over ranks; every rank computes the same new masks from the
          gathered values and keeps its rows of values and optimizer moments. ``debug: True``
          checks after each update (and at the start) that the indices are identical on every
          rank (an all-gather) and writes each rank's indices to ``output_dir/debug/``.
        - Gradient accumulation, ``clip_grad_norm``, activation checkpointing (and offloading on
          CUDA), ``fsdp_cpu_offload`` (parameters, gradients and optimizer state on the CPU),
          ``fsdp_reshard_after_forward``, ``custom_sharded_layers``, ``compile`` (per layer),
          fp32/bf16, lr schedules, torchtune's metric loggers (rank 0), peak memory,
          ``output_dir/training.png`` (rank 0).
        - Checkpoints as ``squash_finetune`` writes them (``epoch_N``, ``step_N``, atomic; squash
          adapter, PEFT adapter, merged HF weights, recipe state), gathered on rank 0; the
          recipe state holds every rank's RNG and data position, so ``resume_from_checkpoint``
          continues exactly (with the same number of processes).
        - A NaN or inf loss on any rank stops every rank before the optimizer step.

    Args:
        cfg (DictConfig): the parsed config.

    Raises:
        ConfigKeyError: as ``squash_finetune`` (unknown or misspelled keys, bad values, ...).
        ValueError: fp16, activation offloading off CUDA, a resume with another number of
            processes than the run that saved the checkpoint.
        FileNotFoundError: ``resume_from_checkpoint`` with no checkpoint in ``output_dir``.
        RuntimeError: not started by a distributed launcher; a NaN or inf loss; (``debug``)
            FFI indices that differ between ranks.
    """

    def __init__(self, cfg: DictConfig) -> None:
        check_config(cfg, CONFIG_KEYS, REQUIRED_KEYS)
        self.world_size, self.rank = utils.get_world_size_and_rank()
        self._is_rank_zero = self.rank == 0
        picked = placement.resolve_config(cfg)  # auto: this host's choice, recorded
        if self._is_rank_zero:
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
        )  # each rank's RNG is seeded with seed + rank (dropout differs per rank)
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
        self._cpu_offload = bool(cfg.get("fsdp_cpu_offload", False))
        self._reshard = bool(cfg.get("fsdp_reshard_after_forward", True))
        self._debug = bool(cfg.get("debug", False))
        self._mask_update = MaskUpdateSchedule.from_config(cfg.get("mask_update", None))
        self.epochs_run = 0
        self.global_step = 0
        self._steps_in_epoch = 0
        self._last_checkpoint: Optional[Path] = None
        self._metric_logger = None

    # ---- setup ----------------------------------------------------------------------------------
    def setup(self, cfg: DictConfig) -> None:
        """Build everything from ``cfg`` on every rank; when resuming, restore the newest
        checkpoint."""
        for key, positional in (("model", 0), ("tokenizer", 0), ("checkpointer", 0),
                                ("dataset", 1), ("optimizer", 1), ("lr_scheduler", 1),
                                ("loss", 0), ("metric_logger", 0)):  # fmt: skip
            if cfg.get(key) is not None:
                check_component(cfg[key], key, positional=positional)
        self._run_lock = run_lock.claim(cfg, lock=self._is_rank_zero)  # before anything is written
        if self._is_rank_zero:
            ckpt.clean_stale_temporaries(self._output_dir)  # what a killed run left; ours now
        dist.barrier()

        recipe_state, resume_dir = None, None
        if self._resume:
            resume_dir, recipe_state = resume.find_resume_state(
                self._output_dir, cfg, required=(*resume.COUNTER_KEYS, "world_size")
            )
            self._restore_counters(recipe_state)
            self._last_checkpoint = resume_dir  # what a NaN stop names before the next save
            utils.log_rank_zero(log, f"Resuming from {resume_dir} (step {self.global_step})")

        # before the model: a corrected base (model.base_outliers) calibrates on its tokens
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._checkpointer, base_state_dict = load_base(cfg.checkpointer)
        self._model_cfg = cfg.model
        self._model = self._setup_model(cfg, base_state_dict, resume_dir)
        del base_state_dict

        self._optimizer = config.instantiate(
            cfg.optimizer,
            steps.optimizer_params(
                self._model, cfg.get("lora_plus_lr_ratio", None), cfg.optimizer.get("lr", None)
            ),
        )
        if recipe_state is not None:
            training.load_from_full_optimizer_state_dict(
                self._model, self._optimizer, recipe_state["optimizer"], self._device
            )
        self._loss_fn = config.instantiate(cfg.loss)
        if cfg.get("compile", False):
            self._loss_fn = training.compile_loss(self._loss_fn, verbose=self._is_rank_zero)
        if self._loss_fn.__class__.__name__ == "CEWithChunkedOutputLoss":
            self._model.set_num_output_chunks(self._loss_fn.num_output_chunks)

        self._dataloader = data.setup_dataloader(
            cfg.dataset,
            self._tokenizer,
            batch_size=self._batch_size,
            shuffle=cfg.get("shuffle", True),
            seed=self.seed,
            collate_fn=cfg.get("collate_fn", None),
            ignore_index=self._loss_fn.ignore_index,
            recorded=None if self._run_lock is None else self._run_lock.inputs,
            num_replicas=self.world_size,
            rank=self.rank,
        )
        if recipe_state is not None and recipe_state.get("dataloader") is not None:
            self._dataloader.load_state_dict(recipe_state["dataloader"][self.rank])
        self._steps_per_epoch = data.steps_per_epoch(
            len(self._dataloader),
            batch_size=self._batch_size,
            grad_accum=self._grad_accum,
            max_steps_per_epoch=self.max_steps_per_epoch,
            per_rank=True,
        )
        self._lr_scheduler = steps.setup_lr_scheduler(
            cfg.get("lr_scheduler", None),
            self._optimizer,
            num_training_steps=self.total_epochs * self._steps_per_epoch,
            global_step=self.global_step,
            state=recipe_state,
        )
        self._profiler = steps.setup_profiler(cfg.get("profiler", None))
        self._ignore_labels = torch.full(
            (self._batch_size, 1), self._loss_fn.ignore_index, device=self._device
        )
        self._pending_rng = recipe_state["rng"][self.rank] if recipe_state is not None else None
        # Last, as in squash_finetune: a run that stops in set-up leaves no log and no config copy
        if self._is_rank_zero:
            self._metric_logger = open_metric_logger(cfg)
        self._plot = TrainingPlot(self._output_dir, self._metric_logger)  # rank 0 draws

    def _restore_counters(self, state: Dict[str, Any]) -> None:
        if state["world_size"] != self.world_size:
            raise ValueError(
                f"The checkpoint was written by {state['world_size']} processes, this run has "
                f"{self.world_size}; resume with --nproc_per_node {state['world_size']} (each "
                "rank's data position and RNG are in the checkpoint)"
            )
        self.max_steps_per_epoch = resume.resumed_max_steps(state, self.max_steps_per_epoch)
        self.epochs_run = state["epochs_run"]
        self.global_step = state["global_step"]
        self._steps_in_epoch = state["steps_in_epoch"]
        self.seed = state["seed"]

    def _setup_model(
        self, cfg: DictConfig, base_state_dict: Dict[str, torch.Tensor], resume_dir: Optional[Path]
    ) -> nn.Module:
        t0 = time.perf_counter()

        def shard(model: nn.Module) -> None:
            whole = fsdp.shard_model(
                model,
                cpu_offload=self._cpu_offload,
                reshard_after_forward=self._reshard,
                custom_sharded_layers=cfg.get("custom_sharded_layers", None),
            )
            if whole:
                utils.log_rank_zero(
                    log,
                    f"{len(whole)} NF4 weights cannot be split evenly over {self.world_size} "
                    f"ranks and stay whole on every rank (e.g. {whole[0]})",
                )

        # the single-device recipe's assembly, sharded before the one load
        model, self._svd_init = assemble_adapter_model(
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
            shard=shard,
            cpu_offload=self._cpu_offload,
            tokenizer=self._tokenizer,
        )
        self._layout = adapters.adapter_layout(model)
        if self._debug:
            sq_dist.check_replicated(model)
        self._act_ctx = training.get_act_offloading_ctx_manager(model, self._act_offload)
        utils.log_rank_zero(
            log,
            f"Model {cfg.model._component_} sharded over {self.world_size} ranks on "
            f"{self._device.type} in {time.perf_counter() - t0:.1f}s",
        )
        dist.barrier()
        return model

    # ---- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, epoch: int, name: Optional[str] = None) -> Optional[Path]:
        """Gather the model on rank 0 and write ``epoch_{epoch}`` (or ``name``) atomically, as
        ``squash_finetune`` does. Every rank must call it; returns the path on rank 0."""
        name = name or f"epoch_{epoch}"
        at_epoch_end = name.startswith("epoch_")
        state = adapters.state_to_export(
            self._model,
            adapter_only=self._adapter_only,
            is_rank_zero=self._is_rank_zero,
            device=self._device,
        )
        optimizer = training.get_full_optimizer_state_dict(
            self._model, self._optimizer, self._is_rank_zero, device=self._device
        )
        rngs = sq_dist.all_gather_objects(ckpt.rng_state(self._device))
        loaders = sq_dist.all_gather_objects(
            None if at_epoch_end else self._dataloader.state_dict()
        )
        path = None
        if self._is_rank_zero:
            model_exports = adapters.checkpoint_exports(
                state,
                self._layout,
                self._model_cfg,
                dtype=self._dtype,
                adapter_only=self._adapter_only,
                svd_init=self._svd_init,
            )
            recipe_state = resume.recipe_state(
                {
                    "epochs_run": self.epochs_run,
                    "global_step": self.global_step,
                    "steps_in_epoch": self._steps_in_epoch,
                    "seed": self.seed,
                    "total_epochs": self.total_epochs,
                    "max_steps_per_epoch": self.max_steps_per_epoch,
                    "world_size": self.world_size,
                },
                at_epoch_end=at_epoch_end,
                optimizer=optimizer,
                lr_scheduler=self._lr_scheduler,
                dataloader=loaders,
                rng=rngs,
            )
            path = ckpt.write_checkpoint(
                self._output_dir,
                name,
                checkpointer=self._checkpointer,
                exports=model_exports,
                recipe_state=recipe_state,
                epoch=epoch,
                global_step=self.global_step,
                adapter_only=self._adapter_only,
            )
            log.info(f"Saved checkpoint {path}")
        self._last_checkpoint = self._output_dir / name
        dist.barrier()
        return path

    # ---- training -------------------------------------------------------------------------------
    def _loss_step(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch.pop("labels")  # (b, s)
        with self._act_ctx:
            logits = self._model(**batch)
        labels = torch.hstack((labels[..., 1:], self._ignore_labels[: labels.shape[0]]))
        if not isinstance(logits, list):
            labels = labels.reshape(-1)
            logits = logits.reshape(-1, logits.size(-1))
        return self._loss_fn(logits, labels)

    def _dump_masks(self, step: int) -> None:
        """(``debug``) this rank's FFI indices after the update of ``step``, for inspection."""
        out = self._output_dir / "debug"
        out.mkdir(parents=True, exist_ok=True)
        indices = {state_dict_key(k): v.cpu() for k, v in get_adapter_buffers(self._model).items()}
        save_file(indices, out / f"masks_step{step}_rank{self.rank}.safetensors")

    def train(self) -> None:
        """The training loop; step and epoch checkpoints as configured."""
        if self._device.type == "cuda":  # torchtune's cleanup_before_training fails on the CPU
            training.cleanup_before_training()
        t0 = time.perf_counter()
        running_loss = torch.zeros((), device=self._device)
        num_tokens = torch.zeros((), dtype=torch.long, device=self._device)
        micro = 0
        with self._profiler as prof:
            for curr_epoch in range(self.epochs_run, self.total_epochs):
                self._dataloader.sampler.set_epoch(curr_epoch)
                pbar = tqdm(
                    total=self._steps_per_epoch, initial=self._steps_in_epoch,
                    disable=not self._is_rank_zero,
                )  # fmt: skip
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
                        record_dense_grads(self._model, True)
                    utils.batch_to_device(batch, self._device)
                    tokens = (batch["labels"] != self._loss_fn.ignore_index).sum()
                    loss = self._loss_step(batch) * tokens
                    running_loss += loss.detach()
                    num_tokens += tokens
                    loss.backward()
                    micro += 1
                    prof.step()
                    if micro < self._grad_accum:
                        continue

                    dist.all_reduce(running_loss)
                    dist.all_reduce(num_tokens)
                    total_tokens = max(int(num_tokens), 1)
                    if not torch.isfinite(running_loss):
                        last = self._last_checkpoint or "none written yet"
                        raise RuntimeError(
                            f"The loss became {float(running_loss) / total_tokens} at step {step} "
                            f"(epoch {curr_epoch + 1}); stopping before the optimizer step. "
                            f"Last good checkpoint: {last}"
                        )
                    lr, grad_norm = steps.optimizer_step(
                        self._model,
                        self._optimizer,
                        self._lr_scheduler,
                        num_tokens=total_tokens,
                        clip_grad_norm=self._clip_grad_norm,
                        world_size=self.world_size,  # FSDP averaged the gradients over ranks
                    )
                    self.global_step = step
                    self._steps_in_epoch += 1
                    logs = {}
                    if mask_update_due(self._mask_update, step):
                        replaced = sq_dist.update_masks_sharded(
                            self._model,
                            self._optimizer,
                            self._mask_update.drop(step),
                            self._device,
                        )
                        logs["mask_update/replaced_per_row"] = sum(replaced.values()) / max(
                            len(replaced), 1
                        )
                        if self._debug:
                            sq_dist.check_replicated(self._model)
                            self._dump_masks(step)

                    loss_value = float(running_loss) / total_tokens
                    elapsed = time.perf_counter() - t0
                    pbar.update(1)
                    pbar.set_description(
                        f"{curr_epoch + 1}|{step}|loss {loss_value:.4f} lr {lr:.2e} "
                        f"tok/s {total_tokens / elapsed:.0f}"
                    )
                    if step % self._log_every_n_steps == 0 and self._is_rank_zero:
                        logs.update(
                            loss=loss_value,
                            lr=lr,
                            tokens_per_second_per_gpu=total_tokens / (elapsed * self.world_size),
                        )
                        if grad_norm is not None:
                            logs["grad_norm"] = grad_norm
                        if self._log_peak_memory_stats:
                            logs.update(steps.memory_stats(self._device))
                        self._metric_logger.log_dict(logs, step=step)
                    running_loss.zero_()
                    num_tokens.zero_()
                    micro = 0
                    if self._save_every_n_steps and step % self._save_every_n_steps == 0:
                        self.save_checkpoint(curr_epoch, name=f"step_{step}")
                        if self._is_rank_zero:
                            ckpt.prune_step_checkpoints(self._output_dir, self._keep_last_n)
                        dist.barrier()
                    t0 = time.perf_counter()
                pbar.close()
                self.epochs_run += 1
                self._steps_in_epoch = 0
                micro = 0
                running_loss.zero_()
                num_tokens.zero_()
                self.save_checkpoint(curr_epoch)
                self._plot.draw()

    def cleanup(self) -> None:
        """Close the metric logger (its file is removed if the run logged nothing) and release
        ``output_dir``'s lock (rank 0); the picture is redrawn first (a stopped run too)."""
        if getattr(self, "_plot", None) is not None:
            self._plot.draw()
        close_metric_logger(getattr(self, "_metric_logger", None))
        if getattr(self, "_run_lock", None) is not None:
            self._run_lock.release()


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: ``tune run --nproc_per_node N squash_finetune_distributed --config CONFIG``."""
    if not training.is_distributed():
        raise RuntimeError(
            "squash_finetune_distributed runs under a distributed launcher: "
            "tune run --nproc_per_node N squash_finetune_distributed --config ... "
            "(use squash_finetune on one device)"
        )
    # NCCL (RCCL on ROCm) for GPU tensors, gloo for CPU ones (and for a CPU-only run)
    dist.init_process_group("cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo")
    if cfg.get("fsdp_cpu_offload", False):
        training.set_torch_num_threads()
    if int(os.environ.get("RANK", "0")) == 0:
        config.log_config(recipe_name="SquashFinetuneRecipeDistributed", cfg=cfg)
    try:
        with config_errors_in_one_line("squash_finetune_distributed"):
            recipe = SquashFinetuneRecipeDistributed(cfg=cfg)
            try:
                recipe.setup(cfg=cfg)
                recipe.train()
            finally:
                recipe.cleanup()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    with overrides_in_one_line("squash_finetune_distributed"):  # a bad override: one line
        sys.exit(recipe_main())
