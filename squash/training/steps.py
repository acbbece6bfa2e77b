"""What happens around a training recipe's optimizer step: the step itself (token-normalised
gradients, clipping, lr schedule), the mask update after it, and what is logged."""

import resource
from typing import Any, Dict, Optional, Tuple

import torch
from omegaconf import DictConfig
from torch import nn
from torchtune import config, training

from squash.modules import FFILinear, get_adapter_modules
from squash.training.masks import (
    MaskUpdateSchedule,
    dense_grad,
    grow_candidates,
    record_dense_grad,
    record_dense_grads,
    record_grow_candidates,
    record_module_grow_candidates,
    update_masks,
)


def optimizer_params(model: nn.Module, lora_plus_lr_ratio: Optional[float], lr: Any) -> Any:
    """What the recipe hands its optimizer: ``model.parameters()``, or with
    ``lora_plus_lr_ratio`` (LoRA+, Hayou et al. 2024; PEFT's ``loraplus_lr_ratio``) two groups,
    the ``lora_b`` factors (dense or FFI) at ``lr * lora_plus_lr_ratio`` and every other
    trainable tensor at ``lr``.

    Args:
        model (nn.Module): the adapted model.
        lora_plus_lr_ratio (Optional[float]): B's lr over A's (None: one group).
        lr (Any): the optimizer's ``lr``.

    Raises:
        ConfigKeyError: a ratio that is not a positive number, a missing ``optimizer.lr``, or a
            model with no ``lora_b`` parameter.
    """
    from squash.config.keys import ConfigKeyError

    if lora_plus_lr_ratio is None:
        return model.parameters()
    if isinstance(lora_plus_lr_ratio, bool) or not isinstance(lora_plus_lr_ratio, (int, float)) \
            or not 0 < lora_plus_lr_ratio < float("inf"):  # fmt: skip
        raise ConfigKeyError(
            f"lora_plus_lr_ratio must be a positive number, got {lora_plus_lr_ratio!r}"
        )
    if isinstance(lr, bool) or not isinstance(lr, (int, float)):
        raise ConfigKeyError(f"lora_plus_lr_ratio needs a number in optimizer.lr, got {lr!r}")
    b, rest = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (b if ".lora_b." in f".{name}" else rest).append(p)
    if not b:
        raise ConfigKeyError("lora_plus_lr_ratio is set but the model has no lora_b parameter")
    return [{"params": rest}, {"params": b, "lr": float(lr) * float(lora_plus_lr_ratio)}]


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    *,
    num_tokens: int,
    clip_grad_norm: Optional[float],
    world_size: int = 1,
) -> Tuple[float, Optional[float]]:
    """Divide the accumulated gradients (of token-summed losses) by ``num_tokens``, clip, step the
    optimizer and the lr scheduler, zero the gradients.

    Args:
        model (nn.Module): the model (sharded with FSDP2 or not).
        optimizer (torch.optim.Optimizer): its optimizer.
        lr_scheduler (Any): stepped after the optimizer (None: none).
        num_tokens (int): the tokens of the whole step (all ranks, all micro-batches).
        clip_grad_norm (Optional[float]): the max gradient norm (None: no clipping).
        world_size (int): ranks FSDP averaged the gradients over; they are scaled back to the
            sum first. Default 1.

    Returns:
        Tuple[float, Optional[float]]: the lr this step used, and the gradient norm before
        clipping (None without ``clip_grad_norm``).
    """
    training.scale_grads(model, torch.tensor(world_size / max(num_tokens, 1)))
    grad_norm = None
    if clip_grad_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=float(clip_grad_norm))
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if lr_scheduler is not None:
        lr_scheduler.step()
    return lr, grad_norm


def setup_profiler(cfg_profiler: Optional[DictConfig]):
    """torchtune's profiler from the ``profiler`` block, or a no-op one."""
    if cfg_profiler is None or not cfg_profiler.get("enabled", False):
        return training.DummyProfiler()
    if cfg_profiler.get("_component_") is None:
        cfg_profiler["_component_"] = "torchtune.training.setup_torch_profiler"
    profiler, _ = config.instantiate(cfg_profiler)
    return profiler


def memory_stats(device: torch.device) -> Dict[str, float]:
    """Peak accelerator memory (torchtune's stats), or the process's max RSS on the CPU."""
    if device.type == "cuda":
        return training.get_memory_stats(device=device)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"peak_memory_rss_gib": peak_kib / 1024**2}


def setup_lr_scheduler(
    cfg_lr_scheduler: Optional[DictConfig],
    optimizer: torch.optim.Optimizer,
    *,
    num_training_steps: int,
    global_step: int,
    state: Optional[Dict[str, Any]] = None,
) -> Optional[torch.optim.lr_scheduler.LRScheduler]:
    """The ``lr_scheduler`` block's scheduler (None without one), set for the step after
    ``global_step`` as torchtune does, and restored from a recipe ``state`` when resuming."""
    if cfg_lr_scheduler is None:
        return None
    scheduler = config.instantiate(
        cfg_lr_scheduler,
        optimizer,
        num_training_steps=num_training_steps,
        last_epoch=global_step - 1,
    )
    if state is not None:
        scheduler.load_state_dict(state["lr_scheduler"])
    return scheduler


def start_mask_recording(
    model: nn.Module, schedule: MaskUpdateSchedule, step: int, grad_accum: int
) -> None:
    """Before the first micro-batch of ``step`` (whose update is due): record what the update
    needs, so it grows where this step's dense gradient is largest. With one micro-batch, the
    gradient is reduced to growth candidates during the backward and never held whole; with
    several, it is accumulated as a dense ``(out, in)`` matrix per sparse factor."""
    if grad_accum == 1:
        record_grow_candidates(model, schedule.drop(step))
    else:
        record_dense_grads(model, True)


def apply_mask_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: MaskUpdateSchedule,
    step: int,
    *,
    skip_untrained: bool = False,
) -> Dict[str, float]:
    """Prune and regrow every sparse factor after step ``step`` (cosine-decayed drop fraction);
    returns the metrics to log (mean slots replaced per row, adapters skipped).

    Args:
        model (nn.Module): the adapted model, what :func:`start_mask_recording` asked for
            recorded during the last step.
        optimizer (torch.optim.Optimizer): its moments of regrown slots are reset.
        schedule (MaskUpdateSchedule): the ``mask_update`` schedule.
        step (int): the global step just taken.
        skip_untrained (bool): leave alone the masks of adapters that got no gradient (a loss
            that does not reach them, e.g. SquareHead on early layers only) instead of raising.
            Default False.

    Raises:
        ValueError: a sparse factor without a recorded dense gradient, unless ``skip_untrained``.
    """
    drop = schedule.drop(step)
    skipped = 0
    if not skip_untrained:
        replaced = update_masks(model, optimizer, drop)
    else:
        replaced = {}
        for name, adapter in get_adapter_modules(model).items():
            sparse = [m for m in adapter.modules() if isinstance(m, FFILinear)]
            if not sparse:
                continue
            if any(dense_grad(m) is None and grow_candidates(m) is None for m in sparse):
                for m in sparse:
                    record_dense_grad(m, False)
                    record_module_grow_candidates(m, 0)
                skipped += 1
                continue
            for sub, n in update_masks(adapter, optimizer, drop).items():
                replaced[f"{name}.{sub}"] = n
    logs = {"mask_update/replaced_per_row": sum(replaced.values()) / max(len(replaced), 1)}
    if skip_untrained:
        logs["mask_update/adapters_skipped"] = float(skipped)
    return logs
