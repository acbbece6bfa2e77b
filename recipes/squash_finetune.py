"""squash_finetune: fine-tune a (Q)LoRA model with FFI-sparse adapters on one device.

Run it as ``tune run squash_finetune --config configs/opt_tiny.yaml`` (installed with squash), or
copy it (``squash cp squash_finetune my_recipe.py``) and run the copy as
``tune run my_recipe --config ...`` from its directory.
"""

import resource
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from omegaconf import DictConfig, ListConfig
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchtune import config, modules, training, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_packed
from torchtune.datasets import ConcatDataset
from torchtune.modules.peft import get_adapter_params, set_trainable_params
from torchtune.recipe_interfaces import FTRecipeInterface
from tqdm import tqdm

from squash.modules import FFILinear, svd_initialize
from squash.training import checkpoint as ckpt
from squash.training.adapter_init import initial_adapter_state_dict
from squash.training.mask_update import (
    cosine_drop_fraction,
    record_dense_grads,
    record_grow_candidates,
    update_masks,
)
from squash.training.config_checks import (
    FINETUNE_CONFIG_KEYS,
    ConfigKeyError,
    check_component,
    check_keys,
    get_int,
    parse_mask_update,
    to_plain,
)

log = utils.get_logger("INFO")

CONFIG_KEYS = FINETUNE_CONFIG_KEYS  # torchtune's LoRA recipe keys plus squash's own


class SquashFinetuneRecipeSingleDevice(FTRecipeInterface):
    """QLoRA fine-tuning where adapter factors are Fixed Fan-In sparse, on one CUDA, ROCm or CPU
    device. Follows torchtune's ``lora_finetune_single_device`` and adds squash's keys.

    Features:
        - Any torchtune LoRA/QLoRA builder or squash builder in ``model`` (sparsity and
          ``sparse_factor`` are the builder's arguments); ``model.init: svd`` initialises the
          adapters from the singular vectors of the loaded base weights.
        - ``mask_update`` (``every_n_steps``, ``drop_fraction``, ``until_step``): prune and regrow
          each sparse row at constant fan-in, the drop fraction decayed by a cosine to 0 at
          ``until_step``; growth follows the dense gradient of the step before an update
          (with one micro-batch reduced to growth candidates during its backward, never held
          whole; with gradient accumulation accumulated as a dense matrix per sparse factor).
        - Gradient accumulation, ``clip_grad_norm``, activation checkpointing (and offloading on
          CUDA), ``compile`` (per decoder layer), fp32/bf16, chunked cross-entropy, lr schedules,
          torchtune's metric loggers, ``log_every_n_steps``, peak memory (max RSS on the CPU), a
          progress bar with loss, lr and tokens/s.
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
        check_keys(cfg, CONFIG_KEYS)
        for key in ("output_dir", "model", "tokenizer", "checkpointer", "dataset", "optimizer",
                    "loss", "epochs", "batch_size"):  # fmt: skip
            if cfg.get(key) is None:
                raise ConfigKeyError(f"Missing config key: {key}")
        self._device = utils.get_device(device=cfg.get("device", None))
        self._dtype = training.get_dtype(cfg.get("dtype", "fp32"), device=self._device)
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
        self._act_ckpt = bool(cfg.get("enable_activation_checkpointing", False))
        self._act_offload = bool(cfg.get("enable_activation_offloading", False))
        if self._act_offload and (self._device.type != "cuda" or not self._act_ckpt):
            raise ValueError(
                "enable_activation_offloading needs a CUDA/ROCm device and "
                "enable_activation_checkpointing: True"
            )
        self._mask_update = parse_mask_update(cfg.get("mask_update", None))
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
        self._metric_logger = config.instantiate(cfg.metric_logger)
        self._metric_logger.log_config(cfg)

        ckpt.clean_stale_temporaries(self._output_dir)
        recipe_state, resume_dir = None, None
        if self._resume:
            resume_dir = ckpt.latest_checkpoint(self._output_dir)
            if resume_dir is None:
                raise FileNotFoundError(
                    f"resume_from_checkpoint is True but {self._output_dir} holds no complete "
                    "epoch_N or step_N checkpoint"
                )
            recipe_state = ckpt.load_recipe_state(resume_dir)
            self._restore_counters(recipe_state)
            log.info(f"Resuming from {resume_dir} (global step {self.global_step})")

        self._checkpointer = config.instantiate(cfg.checkpointer)
        base_state_dict = self._checkpointer.load_checkpoint()[training.MODEL_KEY]
        self._model_cfg = cfg.model
        self._model = self._setup_model(cfg.model, base_state_dict, cfg.get("compile", False))
        if resume_dir is not None:
            ckpt.load_adapter_into(self._model, ckpt.load_squash_adapter(resume_dir), resume_dir)
        del base_state_dict

        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = config.instantiate(cfg.optimizer, self._model.parameters())
        if recipe_state is not None:
            self._optimizer.load_state_dict(recipe_state["optimizer"])
        self._loss_fn = config.instantiate(cfg.loss)
        if cfg.get("compile", False):
            self._loss_fn = training.compile_loss(self._loss_fn)
        if self._loss_fn.__class__.__name__ == "CEWithChunkedOutputLoss":
            self._model.set_num_output_chunks(self._loss_fn.num_output_chunks)

        self._dataloader = self._setup_data(
            cfg.dataset, cfg.get("shuffle", True), cfg.get("collate_fn", None)
        )
        if recipe_state is not None and recipe_state.get("dataloader") is not None:
            self._dataloader.load_state_dict(recipe_state["dataloader"])
        self._steps_per_epoch = len(self._dataloader) // self._grad_accum
        if self._steps_per_epoch == 0:
            raise ConfigKeyError(
                f"dataset: {len(self._dataloader)} batches of batch_size={self._batch_size} "
                f"make no optimizer step with gradient_accumulation_steps={self._grad_accum}"
            )
        if self.max_steps_per_epoch is not None:
            self._steps_per_epoch = min(self._steps_per_epoch, self.max_steps_per_epoch)

        self._lr_scheduler = None
        if cfg.get("lr_scheduler") is not None:
            self._lr_scheduler = config.instantiate(
                cfg.lr_scheduler,
                self._optimizer,
                num_training_steps=self.total_epochs * self._steps_per_epoch,
                last_epoch=self.global_step - 1,  # sets the lr of the next step, as torchtune does
            )
            if recipe_state is not None:
                self._lr_scheduler.load_state_dict(recipe_state["lr_scheduler"])
        self._profiler = self._setup_profiler(cfg.get("profiler", None))
        self._ignore_labels = torch.full(
            (self._batch_size, 1), self._loss_fn.ignore_index, device=self._device
        )
        # Restored in train(), where the run that wrote the checkpoint was when it saved it.
        self._pending_rng = recipe_state["rng"] if recipe_state is not None else None

    def _restore_counters(self, state: Dict[str, Any]) -> None:
        for key in ("epochs_run", "global_step", "steps_in_epoch", "seed", "max_steps_per_epoch"):
            if key not in state:
                raise ValueError(f"The recipe state to resume from lacks {key!r}")
        if state["max_steps_per_epoch"] != self.max_steps_per_epoch:
            log.warning(
                f"max_steps_per_epoch is {self.max_steps_per_epoch} in the config but "
                f"{state['max_steps_per_epoch']} in the checkpoint; using the checkpoint's"
            )
            self.max_steps_per_epoch = state["max_steps_per_epoch"]
        self.epochs_run = state["epochs_run"]
        self.global_step = state["global_step"]
        self._steps_in_epoch = state["steps_in_epoch"]
        self.seed = state["seed"]

    def _setup_model(self, cfg_model: DictConfig, base_state_dict, compile_model: bool) -> nn.Module:
        svd = cfg_model.get("init", "lora") == "svd"
        self._svd_init: Optional[Dict[str, torch.Tensor]] = None
        overrides = {"init": "lora"} if "init" in cfg_model else {}
        with training.set_default_dtype(self._dtype), self._device:
            model = config.instantiate(cfg_model, **overrides)
        adapters = ckpt.adapter_modules(model)
        if not adapters:
            raise ConfigKeyError(
                f"model: {cfg_model._component_} has no LoRA adapters; use a lora_*, qlora_* or "
                "squash_* builder"
            )
        self._has_sparse = any(isinstance(m, FFILinear) for m in model.modules())
        if self._mask_update is not None and not self._has_sparse:
            raise ConfigKeyError(
                f"mask_update is set but model {cfg_model._component_} has no sparse (FFI) "
                "factor; use a squash_* builder or remove mask_update"
            )
        set_trainable_params(model, get_adapter_params(model))

        missing, unexpected = model.load_state_dict(base_state_dict, strict=False)
        not_adapter = [k for k in missing if ".lora_" not in k]
        if not_adapter or unexpected:
            raise ValueError(
                f"The base checkpoint does not fit model {cfg_model._component_}: missing "
                f"{not_adapter[:5]}, unexpected {list(unexpected)[:5]}"
            )
        # Every adapter drawn from a generator of its own (seed, module name): the same adapter
        # as the distributed recipe's, whatever the device or world size.
        ckpt.load_adapter_into(
            model, initial_adapter_state_dict(model, self.seed), "the initial adapter"
        )
        if svd:
            done = svd_initialize(model, base_state_dict)
            if not done:
                raise ConfigKeyError("model.init: svd needs squash (SparseLoRALinear) adapters")
            # the PEFT export is relative to the original weights: keep where the adapter began
            self._svd_init = ckpt.dense_adapter_state_dict(model)
            log.info(f"SVD-initialised {len(done)} adapters from the loaded base weights")
        training.validate_expected_param_dtype(get_adapter_params(model).items(), self._dtype)
        if self._act_ckpt:
            training.set_activation_checkpointing(
                model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
            )
        if compile_model:
            training.compile_model(model)
        self._act_ctx = training.get_act_offloading_ctx_manager(model, self._act_offload)
        first = next(iter(adapters.values()))
        self._lora_rank, self._lora_alpha = first.rank, first.alpha
        n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
        log.info(
            f"Model {cfg_model._component_}: {len(adapters)} adapters, {n_train:,} trainable "
            f"parameters, {self._dtype}, on {self._device}"
        )
        return model

    def _setup_data(self, cfg_dataset, shuffle: bool, collate_name: Optional[str]):
        try:
            if isinstance(cfg_dataset, ListConfig):
                ds = ConcatDataset([config.instantiate(c, self._tokenizer) for c in cfg_dataset])
                packed = getattr(ds, "packed", False)
            else:
                ds = config.instantiate(cfg_dataset, self._tokenizer)
                packed = cfg_dataset.get("packed", False)
            ds[0]  # a missing column shows here, not deep inside the first step
        except KeyError as e:
            columns = _dataset_columns(cfg_dataset)
            raise ConfigKeyError(
                f"dataset: the data has no column {e}; its columns are {columns}. "
                "Map yours with dataset.column_map (e.g. column_map: {input: my_input})"
            ) from e
        collate = _get_component_from_path(collate_name or "torchtune.data.padded_collate_sft")
        if not packed:
            collate = partial(
                collate, padding_idx=self._tokenizer.pad_id, ignore_idx=self._loss_fn.ignore_index
            )
        sampler = StatefulDistributedSampler(
            ds, num_replicas=1, rank=0, shuffle=shuffle, seed=self.seed
        )
        return StatefulDataLoader(
            dataset=ds,
            batch_size=self._batch_size,
            sampler=sampler,
            collate_fn=collate if not packed else padded_collate_packed,
            drop_last=True,
        )

    def _setup_profiler(self, cfg_profiler: Optional[DictConfig]):
        if cfg_profiler is None or not cfg_profiler.get("enabled", False):
            return training.DummyProfiler()
        if cfg_profiler.get("_component_") is None:
            cfg_profiler["_component_"] = "torchtune.training.setup_torch_profiler"
        profiler, _ = config.instantiate(cfg_profiler)
        return profiler

    # ---- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, epoch: int, name: Optional[str] = None) -> Path:
        """Write ``epoch_{epoch}`` (or ``name``, e.g. ``step_12``) atomically; returns its path."""
        name = name or f"epoch_{epoch}"
        at_epoch_end = name.startswith("epoch_")
        model = self._model
        state: Dict[str, Any] = {
            training.ADAPTER_KEY: ckpt.dense_adapter_state_dict(model),
            training.ADAPTER_CONFIG: self._peft_config(),
        }
        if self._svd_init is not None:  # rank 2r: B A - B0 A0 on the original weights
            state[training.ADAPTER_KEY] = ckpt.peft_delta_adapter(
                state[training.ADAPTER_KEY], self._svd_init
            )
            peft = state[training.ADAPTER_CONFIG]
            peft.update(r=2 * peft["r"], lora_alpha=2 * peft["lora_alpha"])
        if not self._adapter_only:
            state[training.MODEL_KEY] = ckpt.merged_state_dict(model, self._dtype)
        recipe_state = {
            "epochs_run": self.epochs_run,
            "global_step": self.global_step,
            "steps_in_epoch": 0 if at_epoch_end else self._steps_in_epoch,
            "seed": self.seed,
            "total_epochs": self.total_epochs,
            "max_steps_per_epoch": self.max_steps_per_epoch,
            "optimizer": self._optimizer.state_dict(),
            "lr_scheduler": self._lr_scheduler.state_dict() if self._lr_scheduler else None,
            "dataloader": None if at_epoch_end else self._dataloader.state_dict(),
            "rng": ckpt.rng_state(self._device),
        }
        path = ckpt.write_checkpoint(
            self._output_dir,
            name,
            checkpointer=self._checkpointer,
            squash_adapter=ckpt.squash_adapter_state_dict(model),
            squash_adapter_config={"model": to_plain(self._model_cfg), **self._peft_config()},
            checkpointer_state=state,
            recipe_state=recipe_state,
            meta={"epoch": epoch, "global_step": self.global_step},
            adapter_only=self._adapter_only,
        )
        self._last_checkpoint = path
        log.info(f"Saved checkpoint {path}")
        return path

    def _peft_config(self) -> Dict[str, Any]:
        return ckpt.peft_config(self._model_cfg, self._lora_rank, self._lora_alpha)

    # ---- training -------------------------------------------------------------------------------
    def _mask_update_due(self, step: int) -> bool:
        mu = self._mask_update
        return mu is not None and step % mu["every_n_steps"] == 0 and step < mu["until_step"]

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
        """The training loop; step and epoch checkpoints as configured."""
        t0 = time.perf_counter()
        running_loss, num_tokens, micro = 0.0, 0, 0
        with self._profiler as prof:
            for curr_epoch in range(self.epochs_run, self.total_epochs):
                self._dataloader.sampler.set_epoch(curr_epoch)
                pbar = tqdm(total=self._steps_per_epoch, initial=self._steps_in_epoch)
                # Making the iterator draws a seed from torch's RNG: a checkpoint taken at the
                # end of an epoch was before that draw, one taken mid-epoch after it.
                mid_epoch = self._steps_in_epoch > 0
                if self._pending_rng is not None and not mid_epoch:
                    ckpt.set_rng_state(self._pending_rng, self._device)
                batches = iter(self._dataloader)
                if self._pending_rng is not None and mid_epoch:
                    ckpt.set_rng_state(self._pending_rng, self._device)
                self._pending_rng = None
                for batch in batches:
                    if self._steps_in_epoch >= self._steps_per_epoch:
                        break
                    step = self.global_step + 1
                    if micro == 0 and self._mask_update_due(step):
                        # The update grows where this step's dense gradient is largest. One
                        # micro-batch: reduce it to growth candidates during the backward, never
                        # holding it; several: accumulate it (out x in per sparse factor).
                        if self._grad_accum == 1:
                            mu = self._mask_update
                            drop = cosine_drop_fraction(step, mu["drop_fraction"], mu["until_step"])
                            record_grow_candidates(self._model, drop)
                        else:
                            record_dense_grads(self._model, True)
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

                    training.scale_grads(self._model, torch.tensor(1.0 / max(num_tokens, 1)))
                    grad_norm = None
                    if self._clip_grad_norm is not None:
                        grad_norm = torch.nn.utils.clip_grad_norm_(
                            self._model.parameters(), max_norm=float(self._clip_grad_norm)
                        )
                    lr = self._optimizer.param_groups[0]["lr"]  # the lr this step used
                    self._optimizer.step()
                    self._optimizer.zero_grad(set_to_none=True)
                    if self._lr_scheduler is not None:
                        self._lr_scheduler.step()
                    self.global_step = step
                    self._steps_in_epoch += 1
                    logs = {}
                    if self._mask_update_due(step):
                        mu = self._mask_update
                        drop = cosine_drop_fraction(step, mu["drop_fraction"], mu["until_step"])
                        replaced = update_masks(self._model, self._optimizer, drop)
                        logs["mask_update/replaced_per_row"] = sum(replaced.values()) / max(
                            len(replaced), 1
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
                            logs["grad_norm"] = float(grad_norm)
                        if self._log_peak_memory_stats:
                            logs.update(self._memory_stats())
                        self._metric_logger.log_dict(logs, step=step)
                    running_loss, num_tokens, micro = 0.0, 0, 0
                    if self._save_every_n_steps and step % self._save_every_n_steps == 0:
                        self.save_checkpoint(curr_epoch, name=f"step_{step}")
                        ckpt.prune_step_checkpoints(self._output_dir, self._keep_last_n)
                    t0 = time.perf_counter()
                pbar.close()
                self.epochs_run += 1
                self._steps_in_epoch = 0
                micro, running_loss, num_tokens = 0, 0.0, 0
                self.save_checkpoint(curr_epoch)

    def _memory_stats(self) -> Dict[str, float]:
        if self._device.type == "cuda":
            return training.get_memory_stats(device=self._device)
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        return {"peak_memory_rss_gib": peak_kib / 1024**2}

    def cleanup(self) -> None:
        """Close the metric logger."""
        if getattr(self, "_metric_logger", None) is not None:
            self._metric_logger.close()


def _dataset_columns(cfg_dataset) -> Any:
    """Column names of a dataset config's data, for an error message (best effort)."""
    try:
        from datasets import load_dataset

        node = cfg_dataset[0] if isinstance(cfg_dataset, ListConfig) else cfg_dataset
        kwargs = {k: v for k, v in node.items() if k in ("data_files", "name", "split")}
        return load_dataset(node.source, **kwargs).column_names
    except Exception:  # the message is still useful without them
        return "unknown"


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: ``tune run squash_finetune --config CONFIG [key=value ...]``."""
    config.log_config(recipe_name="SquashFinetuneRecipeSingleDevice", cfg=cfg)
    recipe = SquashFinetuneRecipeSingleDevice(cfg=cfg)
    try:
        recipe.setup(cfg=cfg)
        recipe.train()
    finally:
        recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
