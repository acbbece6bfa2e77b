"""Resuming a training run: what its recipe state holds, finding the newest complete checkpoint,
restoring the counters, and the RNG around building the data iterator.

Every recipe writes :func:`recipe_state` into its checkpoints and reads it back with
:func:`find_resume_state`, so a run resumes the same way whichever recipe wrote it.
"""

import logging
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple

import torch
from torchtune import utils

from squash.training import checkpoint as ckpt

log = utils.get_logger("INFO")

# Counters every recipe state holds.
COUNTER_KEYS = ("epochs_run", "global_step", "steps_in_epoch", "seed", "max_steps_per_epoch")


def recipe_state(
    counters: Dict[str, Any],
    *,
    at_epoch_end: bool,
    optimizer: Dict[str, Any],
    lr_scheduler: Any,
    dataloader: Any,
    rng: Any,
) -> Dict[str, Any]:
    """What ``recipe_state.pt`` holds: the counters (``steps_in_epoch`` 0 at an epoch's end),
    the optimizer's state dict, the lr scheduler's (None without one), the data position (None
    at an epoch's end: the next epoch starts afresh) and the RNG state.

    Args:
        counters (Dict[str, Any]): :data:`COUNTER_KEYS` and more (``total_epochs``, a
            distributed run's ``world_size``).
        at_epoch_end (bool): an ``epoch_N`` checkpoint rather than a ``step_N`` one.
        optimizer (Dict[str, Any]): the optimizer's (full) state dict.
        lr_scheduler (Any): the lr scheduler, or None.
        dataloader (Any): the data loader's state (one per rank in a distributed run).
        rng (Any): :func:`squash.training.checkpoint.rng_state` (one per rank likewise).
    """
    return {
        **counters,
        "steps_in_epoch": 0 if at_epoch_end else counters["steps_in_epoch"],
        "optimizer": optimizer,
        "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
        "dataloader": None if at_epoch_end else dataloader,
        "rng": rng,
    }


def find_resume_state(
    output_dir: Path, cfg: Any, required: Tuple[str, ...] = COUNTER_KEYS
) -> Tuple[Path, Dict[str, Any]]:
    """The newest complete checkpoint in ``output_dir`` and its recipe state, verified
    (:func:`squash.training.resume_config.load_resume_state`): every file against
    ``checkpoint.json``, the counters against it, and the run's config ``cfg`` against the one
    it recorded.

    Raises:
        FileNotFoundError: if ``output_dir`` holds no complete checkpoint.
        CheckpointIntegrityError: a file, ``checkpoint.json`` or a counter that does not match.
        ValueError: a config change that breaks exactness (naming the override key), a recipe
            state that lacks one of ``required``.
    """
    from squash.training.resume_config import load_resume_state

    return load_resume_state(output_dir, cfg, required)


def resumed_max_steps(state: Dict[str, Any], max_steps_per_epoch: Optional[int]) -> Optional[int]:
    """``max_steps_per_epoch`` to use when resuming: the checkpoint's (warning if the config
    differs), so that epochs end where they would have."""
    if state["max_steps_per_epoch"] != max_steps_per_epoch:
        utils.log_rank_zero(
            log,
            f"max_steps_per_epoch is {max_steps_per_epoch} in the config but "
            f"{state['max_steps_per_epoch']} in the checkpoint; using the checkpoint's",
            level=logging.WARNING,
        )
    return state["max_steps_per_epoch"]


def epoch_batches(
    dataloader: Any, pending_rng: Optional[Dict[str, Any]], *, mid_epoch: bool, device: torch.device
) -> Iterator:
    """An iterator over ``dataloader``'s epoch, with the RNG of a resumed run restored where the
    run that saved it was: making the iterator draws a seed from torch's RNG, so a checkpoint
    taken at an epoch's end was before that draw, one taken mid-epoch after it.

    Args:
        dataloader (Any): the data loader, its sampler's epoch set.
        pending_rng (Optional[Dict[str, Any]]): the saved RNG state (this rank's), None when not
            resuming or once restored.
        mid_epoch (bool): the checkpoint was a ``step_N`` one inside this epoch.
        device (torch.device): whose RNG is restored along with Python's and the CPU's.
    """
    if pending_rng is not None and not mid_epoch:
        ckpt.set_rng_state(pending_rng, device)
    batches = iter(dataloader)
    if pending_rng is not None and mid_epoch:
        ckpt.set_rng_state(pending_rng, device)
    return batches
