"""What squash's single-device recipes share: building the adapted model and the data, the
``mask_update`` block, the optimizer step, resume counters and logging helpers.

``squash_finetune`` and ``squash_distill`` call these functions so that every key they share
(model, dataset, mask_update, checkpoints, resume) behaves the same in both; each recipe keeps
its own training loop, as torchtune's recipes do.
"""

import resource
from functools import partial
from typing import Any, Dict, Optional, Tuple

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

from squash.modules import FFILinear, svd_initialize
from squash.training import checkpoint as ckpt
from squash.training.adapter_init import initial_adapter_state_dict
from squash.training.config_checks import (  # noqa: F401  (parse_mask_update: recipes use it)
    FINETUNE_CONFIG_KEYS,
    ConfigKeyError,
    NamedRecordErrors,
    dataset_where,
    parse_mask_update,
    to_plain,
)
from squash.training.mask_update import (
    cosine_drop_fraction,
    record_dense_grads,
    record_grow_candidates,
    update_masks,
)

log = utils.get_logger("INFO")

# Every top-level key of squash_finetune: torchtune's LoRA recipe keys plus squash's own.
TRAINING_KEYS = FINETUNE_CONFIG_KEYS
# Counters a recipe state must hold for resume.
COUNTER_KEYS = ("epochs_run", "global_step", "steps_in_epoch", "seed", "max_steps_per_epoch")


# ---- mask_update ----------------------------------------------------------------------------------
def mask_update_due(mask_update: Optional[Dict[str, Any]], step: int) -> bool:
    """Whether the masks move after global step ``step`` (1-based)."""
    return (
        mask_update is not None
        and step % mask_update["every_n_steps"] == 0
        and step < mask_update["until_step"]
    )


def start_mask_recording(
    model: nn.Module, mask_update: Dict[str, Any], step: int, grad_accum: int
) -> None:
    """Before the first micro-batch of ``step`` (whose update is due): record what the update
    needs, so it grows where this step's dense gradient is largest. With one micro-batch, the
    gradient is reduced to growth candidates during the backward and never held whole; with
    several, it is accumulated as a dense ``(out, in)`` matrix per sparse factor."""
    if grad_accum == 1:
        drop = cosine_drop_fraction(step, mask_update["drop_fraction"], mask_update["until_step"])
        record_grow_candidates(model, drop)
    else:
        record_dense_grads(model, True)


def apply_mask_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    mask_update: Dict[str, Any],
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
        mask_update (Dict[str, Any]): the parsed ``mask_update`` block.
        step (int): the global step just taken.
        skip_untrained (bool): leave alone the masks of adapters that got no gradient (a loss
            that does not reach them, e.g. SquareHead on early layers only) instead of raising.
            Default False.

    Raises:
        ValueError: a sparse factor without a recorded dense gradient, unless ``skip_untrained``.
    """
    drop = cosine_drop_fraction(step, mask_update["drop_fraction"], mask_update["until_step"])
    skipped = 0
    if not skip_untrained:
        replaced = update_masks(model, optimizer, drop)
    else:
        replaced = {}
        for name, adapter in ckpt.adapter_modules(model).items():
            sparse = [m for m in adapter.modules() if isinstance(m, FFILinear)]
            if not sparse:
                continue
            if any(m.dense_grad is None and m.grow_candidates is None for m in sparse):
                for m in sparse:
                    m.record_dense_grad(False)
                    m.record_grow_candidates(0)
                skipped += 1
                continue
            for sub, n in update_masks(adapter, optimizer, drop).items():
                replaced[f"{name}.{sub}"] = n
    logs = {"mask_update/replaced_per_row": sum(replaced.values()) / max(len(replaced), 1)}
    if skip_untrained:
        logs["mask_update/adapters_skipped"] = float(skipped)
    return logs


# ---- model ----------------------------------------------------------------------------------------
def load_all_but_adapters(model: nn.Module, state_dict: Dict[str, torch.Tensor], what: str) -> None:
    """Load ``state_dict`` into ``model``: every key must fit except adapter keys (``.lora_``),
    which keep their values.

    Raises:
        ValueError: ``what``, then the first missing and unexpected keys.
    """
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = [k for k in missing if ".lora_" not in k]
    if missing or unexpected:
        raise ValueError(f"{what}: missing {missing[:5]}, unexpected {list(unexpected)[:5]}")


def build_adapter_model(
    cfg_model: DictConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    mask_update: Optional[Dict[str, Any]] = None,
) -> nn.Module:
    """Build the model of ``cfg_model`` on ``device`` (``"meta"`` too) with the LoRA init (an
    ``init: svd`` is applied once the base weights are loaded) and only its adapters trainable.

    Raises:
        ConfigKeyError: a model without adapters, or ``mask_update`` without a sparse factor.
    """
    overrides = {"init": "lora"} if "init" in cfg_model else {}
    with training.set_default_dtype(dtype), torch.device(device):
        model = config.instantiate(cfg_model, **overrides)
    if not ckpt.adapter_modules(model):
        raise ConfigKeyError(
            f"model: {cfg_model._component_} has no LoRA adapters; use a lora_*, qlora_* or "
            "squash_* builder"
        )
    has_sparse = any(isinstance(m, FFILinear) for m in model.modules())
    if mask_update is not None and not has_sparse:
        raise ConfigKeyError(
            f"mask_update is set but model {cfg_model._component_} has no sparse (FFI) "
            "factor; use a squash_* builder or remove mask_update"
        )
    set_trainable_params(model, get_adapter_params(model))
    return model


def setup_adapter_model(
    cfg_model: DictConfig,
    base_state_dict: Dict[str, torch.Tensor],
    *,
    device: torch.device,
    dtype: torch.dtype,
    mask_update: Optional[Dict[str, Any]] = None,
    activation_checkpointing: bool = False,
    compile_model: bool = False,
    seed: int = 0,
) -> nn.Module:
    """Build the model of ``cfg_model`` (a LoRA, QLoRA or squash builder), load the base weights,
    make only the adapters trainable and apply ``init: svd``, activation checkpointing and
    compile.

    Args:
        cfg_model (DictConfig): the ``model`` block; ``init: svd`` initialises the adapters from
            the singular vectors of the loaded base weights.
        base_state_dict (Dict[str, torch.Tensor]): the base model's weights (torchtune keys).
        device (torch.device): where the model is built.
        dtype (torch.dtype): parameter dtype.
        mask_update (Optional[Dict[str, Any]]): the parsed ``mask_update`` block, if any (needs a
            sparse factor).
        activation_checkpointing (bool): wrap each self-attention layer. Default False.
        compile_model (bool): compile each layer. Default False.
        seed (int): seeds each adapter's initialisation with its module name. Default 0.

    Returns:
        nn.Module: the model, adapter parameters trainable and everything else frozen.

    Raises:
        ConfigKeyError: a model without adapters, ``mask_update`` without a sparse factor,
            ``init: svd`` without squash adapters.
        ValueError: base weights that do not fit the model.
    """
    svd = cfg_model.get("init", "lora") == "svd"
    model = build_adapter_model(cfg_model, device=device, dtype=dtype, mask_update=mask_update)
    adapters = ckpt.adapter_modules(model)

    load_all_but_adapters(
        model, base_state_dict, f"The base checkpoint does not fit model {cfg_model._component_}"
    )
    # Every adapter drawn from a generator of its own (seed, module name): the same adapter as
    # the distributed recipe's, whatever the device or world size.
    ckpt.load_adapter_into(model, initial_adapter_state_dict(model, seed), "the initial adapter")
    if svd:
        done = svd_initialize(model, base_state_dict)
        if not done:
            raise ConfigKeyError("model.init: svd needs squash (SparseLoRALinear) adapters")
        log.info(f"SVD-initialised {len(done)} adapters from the loaded base weights")
    training.validate_expected_param_dtype(get_adapter_params(model).items(), dtype)
    if activation_checkpointing:
        training.set_activation_checkpointing(
            model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
        )
    if compile_model:
        training.compile_model(model)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info(
        f"Model {cfg_model._component_}: {len(adapters)} adapters, {n_train:,} trainable "
        f"parameters, {dtype}, on {device}"
    )
    return model


def setup_frozen_model(
    cfg_model: DictConfig,
    state_dict: Dict[str, torch.Tensor],
    *,
    device: torch.device,
    dtype: torch.dtype,
    where: str = "model",
) -> nn.Module:
    """Build ``cfg_model``, load ``state_dict``, freeze the model and put it in eval mode (a
    distillation teacher, or a model to evaluate).

    Every key must load, except adapter keys (``.lora_``) of a model with adapters, which keep
    their initialisation (``lora_b`` is zero, so the adapters add nothing until an adapter is
    loaded into them).

    Raises:
        ValueError: naming ``where`` if the weights do not fit the model.
    """
    with training.set_default_dtype(dtype), device:
        model = config.instantiate(cfg_model)
    load_all_but_adapters(
        model, state_dict, f"The checkpoint of {where} does not fit {cfg_model._component_}"
    )
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def peft_config(cfg_model: DictConfig, model: nn.Module) -> Dict[str, Any]:
    """The PEFT ``adapter_config`` fields of the model's adapters (rank and alpha of the first)."""
    first = next(iter(ckpt.adapter_modules(model).values()))
    return ckpt.peft_config(cfg_model, first.rank, first.alpha)


def svd_init_factors(cfg_model: DictConfig, model: nn.Module) -> Optional[Dict[str, torch.Tensor]]:
    """With ``init: svd``, the dense factors the adapters start from (call it right after
    :func:`setup_adapter_model`): the PEFT export is relative to the original weights."""
    if cfg_model.get("init", "lora") != "svd":
        return None
    return ckpt.dense_adapter_state_dict(model)


# ---- data -----------------------------------------------------------------------------------------
def setup_dataloader(
    cfg_dataset: Any,
    tokenizer: Any,
    *,
    batch_size: int,
    shuffle: bool,
    seed: int,
    collate_fn: Optional[str] = None,
    ignore_index: int = -100,
    drop_last: bool = True,
    num_replicas: int = 1,
    rank: int = 0,
) -> StatefulDataLoader:
    """A stateful (resumable) data loader over ``cfg_dataset`` (one dataset block or a list).

    With ``num_replicas`` N, rank r takes samples r, r + N, r + 2N, ... of the seeded
    permutation: N ranks with ``batch_size`` b see, step by step, the samples one device sees
    with batch size N * b.

    Raises:
        ConfigKeyError: if the data lacks a column the dataset needs, naming the columns it has.
    """
    try:
        if isinstance(cfg_dataset, ListConfig):
            ds = ConcatDataset([config.instantiate(c, tokenizer) for c in cfg_dataset])
            packed = getattr(ds, "packed", False)
        else:
            ds = config.instantiate(cfg_dataset, tokenizer)
            packed = cfg_dataset.get("packed", False)
        ds = NamedRecordErrors(ds, dataset_where(cfg_dataset))
        ds[0]  # a missing column shows here, not deep inside the first step
    except KeyError as e:
        columns = dataset_columns(cfg_dataset)
        raise ConfigKeyError(
            f"dataset: the data has no column {e}; its columns are {columns}. "
            "Map yours with dataset.column_map (e.g. column_map: {input: my_input})"
        ) from e
    collate = _get_component_from_path(collate_fn or "torchtune.data.padded_collate_sft")
    if not packed:
        collate = partial(collate, padding_idx=tokenizer.pad_id, ignore_idx=ignore_index)
    sampler = StatefulDistributedSampler(
        ds, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed
    )
    return StatefulDataLoader(
        dataset=ds,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collate if not packed else padded_collate_packed,
        drop_last=drop_last,
    )


def dataset_columns(cfg_dataset: Any) -> Any:
    """Column names of a dataset config's data, for an error message (best effort)."""
    try:
        from datasets import load_dataset

        node = cfg_dataset[0] if isinstance(cfg_dataset, ListConfig) else cfg_dataset
        kwargs = {k: v for k, v in node.items() if k in ("data_files", "name", "split")}
        return load_dataset(node.source, **kwargs).column_names
    except Exception:  # the message is still useful without them
        return "unknown"


# ---- resume ---------------------------------------------------------------------------------------
def steps_per_epoch(
    num_batches: int,
    *,
    batch_size: int,
    grad_accum: int,
    max_steps_per_epoch: Optional[int],
    per_rank: bool = False,
) -> int:
    """Optimizer steps an epoch of ``num_batches`` batches makes, at most ``max_steps_per_epoch``.

    Raises:
        ConfigKeyError: if the batches make no optimizer step.
    """
    steps = num_batches // grad_accum
    if steps == 0:
        raise ConfigKeyError(
            f"dataset: {num_batches} batches of batch_size={batch_size}"
            f"{' per rank' if per_rank else ''} make no optimizer step with "
            f"gradient_accumulation_steps={grad_accum}"
        )
    return steps if max_steps_per_epoch is None else min(steps, max_steps_per_epoch)


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


def find_resume_state(output_dir) -> Tuple[Any, Dict[str, Any]]:
    """The newest complete checkpoint in ``output_dir`` and its recipe state.

    Raises:
        FileNotFoundError: if ``output_dir`` holds no complete checkpoint.
        ValueError: if its recipe state lacks a counter.
    """
    resume_dir = ckpt.latest_checkpoint(output_dir)
    if resume_dir is None:
        raise FileNotFoundError(
            f"resume_from_checkpoint is True but {output_dir} holds no complete "
            "epoch_N or step_N checkpoint"
        )
    state = ckpt.load_recipe_state(resume_dir)
    for key in COUNTER_KEYS:
        if key not in state:
            raise ValueError(f"The recipe state to resume from lacks {key!r}")
    return resume_dir, state


def resumed_max_steps(state: Dict[str, Any], max_steps_per_epoch: Optional[int]) -> Optional[int]:
    """``max_steps_per_epoch`` to use when resuming: the checkpoint's (warning if the config
    differs), so that epochs end where they would have."""
    if state["max_steps_per_epoch"] != max_steps_per_epoch:
        log.warning(
            f"max_steps_per_epoch is {max_steps_per_epoch} in the config but "
            f"{state['max_steps_per_epoch']} in the checkpoint; using the checkpoint's"
        )
    return state["max_steps_per_epoch"]


# ---- steps and logs -------------------------------------------------------------------------------
def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    *,
    num_tokens: int,
    clip_grad_norm: Optional[float],
) -> Tuple[float, Optional[float]]:
    """Divide the accumulated gradients (of token-summed losses) by ``num_tokens``, clip, step the
    optimizer and the lr scheduler, zero the gradients.

    Returns:
        Tuple[float, Optional[float]]: the lr this step used, and the gradient norm before
        clipping (None without ``clip_grad_norm``).
    """
    training.scale_grads(model, torch.tensor(1.0 / max(num_tokens, 1)))
    grad_norm = None
    if clip_grad_norm is not None:
        grad_norm = float(
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=float(clip_grad_norm))
        )
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


# ---- checkpoints ----------------------------------------------------------------------------------
def save_training_checkpoint(
    output_dir,
    name: str,
    *,
    model: nn.Module,
    cfg_model: DictConfig,
    checkpointer: Any,
    dtype: torch.dtype,
    adapter_only: bool,
    counters: Dict[str, Any],
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    dataloader: StatefulDataLoader,
    device: torch.device,
    epoch: int,
    svd_init: Optional[Dict[str, torch.Tensor]] = None,
):
    """Write the checkpoint ``output_dir/name`` (``epoch_N`` or ``step_N``) of a training run,
    atomically (:func:`squash.training.checkpoint.write_checkpoint`): squash adapter, PEFT
    adapter, merged weights unless ``adapter_only``, and the recipe state for resume.

    Args:
        output_dir: the run's output directory.
        name (str): ``epoch_N`` (written at the end of an epoch: resume starts the next epoch)
            or ``step_N`` (mid-epoch: resume continues in the data where it was).
        model (nn.Module): the adapted model.
        cfg_model (DictConfig): its config block (recorded, to rebuild the model).
        checkpointer (Any): the model's checkpointer (writes the merged and PEFT files).
        dtype (torch.dtype): dtype of the merged weights.
        adapter_only (bool): leave out the merged weights.
        counters (Dict[str, Any]): ``epochs_run``, ``global_step``, ``steps_in_epoch``, ``seed``,
            ``total_epochs``, ``max_steps_per_epoch``.
        optimizer (torch.optim.Optimizer): its state is saved.
        lr_scheduler (Any): its state is saved (None: none).
        dataloader (StatefulDataLoader): its position is saved for a step checkpoint.
        device (torch.device): whose RNG is saved along with Python's and the CPU's.
        epoch (int): the epoch recorded in ``checkpoint.json``.
        svd_init (Optional[Dict[str, torch.Tensor]]): :func:`svd_init_factors`; the PEFT adapter
            is then of rank 2r, ``B A - B0 A0``, for the original weights.

    Returns:
        Path: the checkpoint directory.
    """
    at_epoch_end = name.startswith("epoch_")
    peft = peft_config(cfg_model, model)
    state: Dict[str, Any] = {
        training.ADAPTER_KEY: ckpt.dense_adapter_state_dict(model),
        training.ADAPTER_CONFIG: peft,
    }
    if svd_init is not None:  # rank 2r: B A - B0 A0 on the original weights
        state[training.ADAPTER_KEY] = ckpt.peft_delta_adapter(state[training.ADAPTER_KEY], svd_init)
        state[training.ADAPTER_CONFIG] = dict(peft, r=2 * peft["r"], lora_alpha=2 * peft["lora_alpha"])
    if not adapter_only:
        state[training.MODEL_KEY] = ckpt.merged_state_dict(model, dtype)
    recipe_state = {
        **counters,
        "steps_in_epoch": 0 if at_epoch_end else counters["steps_in_epoch"],
        "optimizer": optimizer.state_dict(),
        "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
        "dataloader": None if at_epoch_end else dataloader.state_dict(),
        "rng": ckpt.rng_state(device),
    }
    return ckpt.write_checkpoint(
        output_dir,
        name,
        checkpointer=checkpointer,
        squash_adapter=ckpt.squash_adapter_state_dict(model),
        squash_adapter_config={"model": to_plain(cfg_model), **peft},
        checkpointer_state=state,
        recipe_state=recipe_state,
        meta={"epoch": epoch, "global_step": counters["global_step"]},
        adapter_only=adapter_only,
    )
