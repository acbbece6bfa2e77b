"""Resuming a training run: what its recipe state holds, finding the newest complete checkpoint
and checking it against the run that resumes it, restoring the counters, and the RNG around
building the data iterator.

Every recipe writes :func:`recipe_state` into its checkpoints and reads it back with
:func:`find_resume_state`, so a run resumes the same way whichever recipe wrote it.

Resume only what was written, and only with the run that wrote it: :func:`find_resume_state`
finds the newest checkpoint in ``output_dir`` (:func:`squash.runs.checkpoint.latest_checkpoint`,
refusing a damaged one rather than silently taking an older one), verifies every file against
``checkpoint.json`` (:mod:`squash.runs.manifest`), loads ``recipe_state.pt``, checks its
counters, and compares the run's config with the one the checkpoint recorded
(:func:`config_changes`).

A changed key that breaks exactness (anything not in :data:`FREE_KEYS`: batch size,
accumulation, dataset, seed, model, sparsity, optimizer, schedule, epochs, dtype, ...) is
refused unless the config sets ``resume_allow_config_change: True``; then the changes are
logged and the run continues with them (the checkpoint's optimizer state, lr schedule state,
RNG and seed are still restored from it, so a new ``optimizer.lr`` or ``seed`` does not act).
So is an input file changed in place at the same path (:func:`check_inputs`: each file of the
base model, each data and tokenizer file, compared by sha256 and size). Once the optimizer's
state is loaded, :func:`check_optimizer_state` checks that it fits the model.
"""

import logging
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import utils

from squash.config.keys import ConfigKeyError
from squash.runs import checkpoint as ckpt
from squash.runs import manifest

log = logging.getLogger(__name__)
tune_log = utils.get_logger("INFO")  # torchtune's logger, which the recipes log to

# Counters every recipe state holds.
COUNTER_KEYS = ("epochs_run", "global_step", "steps_in_epoch", "seed", "max_steps_per_epoch")

OVERRIDE_KEY = "resume_allow_config_change"
# Keys that may change between a run and its resume: where things are written and logged, how
# often checkpoints are taken, memory trade-offs that do not change the numbers, and
# max_steps_per_epoch (the checkpoint's value is used, with a warning).
FREE_KEYS = (
    "output_dir", "resume_from_checkpoint", OVERRIDE_KEY, "metric_logger", "log_every_n_steps",
    "log_peak_memory_stats", "profiler", "save_every_n_steps", "keep_last_n",
    "save_adapter_weights_only", "checkpointer.output_dir", "teacher_checkpointer.output_dir",
    "max_steps_per_epoch", "enable_activation_checkpointing", "enable_activation_offloading",
    "fsdp_cpu_offload", "fsdp_reshard_after_forward", "low_cpu_ram", "debug",
)  # fmt: skip


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
        rng (Any): :func:`squash.runs.checkpoint.rng_state` (one per rank likewise).
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
    output_dir: Path, cfg: DictConfig, required: Tuple[str, ...] = COUNTER_KEYS
) -> Tuple[Path, Dict[str, Any]]:
    """The newest complete checkpoint in ``output_dir`` and its recipe state, verified: every
    file against ``checkpoint.json``, the counters against it, the run's config ``cfg`` against
    the one it recorded and the run's input files against the hashes it recorded.

    Args:
        output_dir (Path): the run's output directory.
        cfg (DictConfig): the run's config, compared with the checkpoint's.
        required (Tuple[str, ...]): keys the recipe state must hold. Default
            :data:`COUNTER_KEYS`.

    Returns:
        Tuple[Path, Dict[str, Any]]: the checkpoint directory and its recipe state.

    Raises:
        FileNotFoundError: if ``output_dir`` holds no complete checkpoint.
        CheckpointIntegrityError: a file that does not match ``checkpoint.json``, counters that
            disagree, a damaged ``checkpoint.json`` (of any ``epoch_N``/``step_N`` directory:
            skipping it could resume an older checkpoint without a word); each names the file.
        ValueError: a config change that breaks exactness (naming the override key), a recipe
            state that lacks one of ``required``.
    """
    resume_dir = ckpt.latest_checkpoint(output_dir, refuse_damaged=True)
    if resume_dir is None:
        raise FileNotFoundError(
            f"resume_from_checkpoint is True but {output_dir} holds no complete "
            "epoch_N or step_N checkpoint"
        )
    meta = manifest.verify(resume_dir)
    state = ckpt.load_recipe_state(resume_dir)
    for key in required:
        if key not in state:
            raise ValueError(f"The recipe state to resume from lacks {key!r}")
    manifest.check_counters(resume_dir, meta, state)
    check_config(resume_dir, meta.get("config"), cfg)
    check_inputs(resume_dir, meta, output_dir, cfg)
    return resume_dir, state


def _flatten(node: Any, prefix: str = "") -> Dict[str, Any]:
    if isinstance(node, dict):
        out: Dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: node}


def _free(key: str) -> bool:
    return any(key == f or key.startswith(f + ".") for f in FREE_KEYS)


def config_changes(saved: Dict[str, Any], current: Dict[str, Any]) -> List[Tuple[str, Any, Any]]:
    """``(dotted key, saved value, current value)`` for every key outside :data:`FREE_KEYS`
    whose value differs (a key absent on one side counts as null)."""
    a, b = _flatten(saved), _flatten(current)
    return [
        (k, a.get(k), b.get(k))
        for k in sorted(set(a) | set(b))
        if not _free(k) and a.get(k) != b.get(k)
    ]


def check_config(checkpoint_dir: Path, saved: Optional[Dict[str, Any]], cfg: DictConfig) -> None:
    """Refuse a resume whose config changes a key that breaks exactness (see the module
    docstring), unless ``resume_allow_config_change: True``.

    Raises:
        ConfigKeyError: listing each changed key with both values and naming the override key.
    """
    if saved is None:
        if cfg.get(OVERRIDE_KEY, False) is True:
            log.warning("%s records no run config; resuming unchecked (%s=True)",
                        Path(checkpoint_dir) / manifest.META_FILE, OVERRIDE_KEY)
            return
        raise ConfigKeyError(
            f"{Path(checkpoint_dir) / manifest.META_FILE} records no run config, so the resume "
            f"cannot be checked against it; set {OVERRIDE_KEY}=True to resume anyway"
        )
    changes = config_changes(saved, OmegaConf.to_container(cfg, resolve=True))
    if not changes:
        return
    lines = "; ".join(f"{k}: {old!r} in the checkpoint, {new!r} now" for k, old, new in changes)
    if cfg.get(OVERRIDE_KEY, False) is True:
        log.warning(
            "Resuming from %s with a changed config (%s=True): %s. The run will not reproduce "
            "an uninterrupted one; the optimizer state, lr schedule, RNG and seed are the "
            "checkpoint's", checkpoint_dir, OVERRIDE_KEY, lines,
        )
        return
    raise ConfigKeyError(
        f"resume_from_checkpoint: the config differs from the run that wrote {checkpoint_dir} "
        f"in keys that change the results: {lines}. Resume with the checkpoint's values, or set "
        f"{OVERRIDE_KEY}=True to continue with the new ones"
    )


def changed_inputs(meta: Dict[str, Any], now: Dict[str, Any]) -> List[Tuple[str, str]]:
    """``(file, key)`` of each input file whose sha256 or size differs between what a checkpoint
    recorded (``meta``: its ``base`` and ``inputs``) and what this run recorded when it started
    (``now``: its lock record). A file recorded on one side only is a config change (another
    path), left to :func:`check_config`."""
    changed = []
    base_then, base_now = meta.get("base") or {}, now.get("base") or {}
    files_then, files_now = base_then.get("files") or {}, base_now.get("files") or {}
    if files_then and files_now:
        where = base_now.get("path", "checkpointer.checkpoint_dir")
        for name in sorted(set(files_then) | set(files_now)):
            if files_then.get(name) != files_now.get(name):
                changed.append((str(Path(where) / name), "checkpointer.checkpoint_dir"))
    inputs_then, inputs_now = meta.get("inputs") or {}, now.get("inputs") or {}
    for key in sorted(set(inputs_then) & set(inputs_now)):
        then, current = inputs_then[key], inputs_now[key]
        if then.get("path") != current.get("path"):
            continue  # another file: a config change
        if (then.get("sha256"), then.get("size")) != (current.get("sha256"), current.get("size")):
            changed.append((current["path"], key))
    return changed


def check_inputs(resume_dir: Path, meta: Dict[str, Any], output_dir: Path, cfg: DictConfig) -> None:
    """Refuse a resume whose input files (base model weights, data and tokenizer files) changed
    since the run that wrote ``resume_dir`` read them, unless ``resume_allow_config_change:
    True``. This run's hashes are those its lock recorded when it started
    (:class:`squash.runs.run_lock.RunLock`), so nothing is hashed twice; a process that does
    not hold the lock (a distributed run's other ranks) leaves the check to the one that does.

    Raises:
        ValueError: one line naming the first changed file, its key and the override key.
    """
    import os

    from squash.runs.run_lock import read_lock

    now = read_lock(output_dir)
    if now is None or now.get("pid") != os.getpid():
        return
    changed = changed_inputs(meta, now)
    if not changed:
        return
    path, key = changed[0]
    more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
    if cfg.get(OVERRIDE_KEY, False) is True:
        log.warning("Resuming from %s with changed inputs (%s=True): %s (%s)%s changed since the "
                    "run read it", resume_dir, OVERRIDE_KEY, path, key, more)  # fmt: skip
        return
    raise ConfigKeyError(
        f"resume_from_checkpoint: {path} ({key}) changed since the run that wrote {resume_dir} "
        f"read it{more}; the resume would not continue that run. Restore the file, or set "
        f"{OVERRIDE_KEY}=True to continue with it"
    )


def check_optimizer_state(model: Any, optimizer: Any, resume_dir: Path) -> None:
    """After ``optimizer.load_state_dict``: every per-parameter tensor of the restored state
    (AdamW's moments, ...) has its parameter's shape (torch checks only the number of
    parameters, and a wrong shape would fail at the first step).

    Raises:
        ValueError: naming ``recipe_state.pt``, the parameter and both shapes.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if hasattr(value, "shape") and value.dim() > 0 and value.shape != p.shape:
                    raise ValueError(
                        f"{Path(resume_dir) / manifest.RECIPE_STATE}: the optimizer's {key!r} of "
                        f"{names.get(id(p), 'a parameter')} has shape {tuple(value.shape)}, the "
                        f"parameter {tuple(p.shape)}; the recipe state does not fit this model"
                    )


def resumed_max_steps(state: Dict[str, Any], max_steps_per_epoch: Optional[int]) -> Optional[int]:
    """``max_steps_per_epoch`` to use when resuming: the checkpoint's (warning if the config
    differs), so that epochs end where they would have."""
    if state["max_steps_per_epoch"] != max_steps_per_epoch:
        utils.log_rank_zero(
            tune_log,
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
