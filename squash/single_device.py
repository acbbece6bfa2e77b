"""What squash's single-device recipes (``squash_finetune``, ``squash_distill``) share: the set-up
after the model and loss (data, schedule, held-out report, logger and picture), the checkpoint
they write and the counters they restore from one. The FSDP2 recipe shards, gathers and writes on
rank zero: it has its own."""

from pathlib import Path
from typing import Any, Dict, Optional

import torch
from torchtune import utils

from squash.export import adapters
from squash.runs import checkpoint as ckpt
from squash.runs import resume
from squash.runs.entry import open_metric_logger
from squash.training import data, steps
from squash.training.heldout import setup_heldout
from squash.training.plot import TrainingPlot

log = utils.get_logger("INFO")  # the recipes' logger


class SingleDeviceRecipe:
    """Set-up, ``save_checkpoint`` and ``_restore_counters`` for a recipe class that holds
    ``_model``, ``_model_cfg``, ``_dtype``, ``_adapter_only``, ``_svd_init``, ``_optimizer``,
    ``_loss_fn``, ``_tokenizer``, ``_batch_size``, ``_grad_accum``, ``_run_lock``, ``_device``,
    ``_checkpointer``, ``_output_dir`` and the counters ``epochs_run``, ``global_step``,
    ``_steps_in_epoch``, ``seed``, ``total_epochs``, ``max_steps_per_epoch``. A recipe adds to a
    written checkpoint in :meth:`_saved`."""

    def _setup_data_and_schedule(self, cfg: Any, recipe_state: Optional[Dict[str, Any]]) -> None:
        """The dataloader (where a resumed run left it), the steps of an epoch, the learning-rate
        schedule, the profiler, the held-out report, then, last, the metric logger and the
        picture: a run that stops in set-up leaves no log file and no config copy behind (nor
        overwrites the torchtune_config.yaml of the run it refused to resume)."""
        self._dataloader = data.setup_dataloader(
            cfg.dataset,
            self._tokenizer,
            batch_size=self._batch_size,
            shuffle=cfg.get("shuffle", True),
            seed=self.seed,
            collate_fn=cfg.get("collate_fn", None),
            ignore_index=self._loss_fn.ignore_index,
            recorded=None if self._run_lock is None else self._run_lock.inputs,
        )
        if recipe_state is not None and recipe_state.get("dataloader") is not None:
            self._dataloader.load_state_dict(recipe_state["dataloader"])
        self._steps_per_epoch = data.steps_per_epoch(
            len(self._dataloader),
            batch_size=self._batch_size,
            grad_accum=self._grad_accum,
            max_steps_per_epoch=self.max_steps_per_epoch,
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
        # Restored in train(), where the run that wrote the checkpoint was when it saved it.
        self._pending_rng = recipe_state["rng"] if recipe_state is not None else None
        self._heldout = setup_heldout(
            cfg.get("heldout", None), self._tokenizer,
            device=self._device, ignore_index=self._loss_fn.ignore_index,
        )  # fmt: skip
        self._metric_logger = open_metric_logger(cfg)
        self._plot = TrainingPlot(self._output_dir, self._metric_logger)  # output_dir/training.png

    def _restore_counters(self, state: Dict[str, Any]) -> None:
        self.max_steps_per_epoch = resume.resumed_max_steps(state, self.max_steps_per_epoch)
        self.epochs_run = state["epochs_run"]
        self.global_step = state["global_step"]
        self._steps_in_epoch = state["steps_in_epoch"]
        self.seed = state["seed"]

    def save_checkpoint(self, epoch: int, name: Optional[str] = None) -> Path:
        """Write ``epoch_{epoch}`` (or ``name``, e.g. ``step_12``) atomically; returns its path."""
        name = name or f"epoch_{epoch}"
        model_exports = adapters.checkpoint_exports(
            adapters.state_to_export(self._model, adapter_only=self._adapter_only),
            adapters.adapter_layout(self._model),
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
            },
            at_epoch_end=name.startswith("epoch_"),
            optimizer=self._optimizer.state_dict(),
            lr_scheduler=self._lr_scheduler,
            dataloader=self._dataloader.state_dict(),
            rng=ckpt.rng_state(self._device),
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
        self._last_checkpoint = path
        log.info(f"Saved checkpoint {path}")
        self._saved(path, name)
        return path

    def _saved(self, path: Path, name: str) -> None:
        """What the recipe does after writing checkpoint ``name`` at ``path`` (nothing here)."""
