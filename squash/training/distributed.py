"""What an FSDP2 training step needs beyond the one-device step.

- **Dense gradients for mask updates are summed over ranks** (:func:`update_masks_sharded`): each
  rank records the dense gradient of its own micro-batches; the sum is the gradient of the global
  batch, as the single-device recipe records it.
- **FFI indices stay replicated.** Every rank holds the whole index buffer of each
  :class:`~squash.modules.FFILinear` (the assembly broadcasts it from rank 0:
  :func:`squash.assembly.fsdp.load_full_state_dict`); :func:`update_masks_sharded` computes each
  update from the all-reduced dense gradient and the gathered values, the same on every rank, and
  :func:`check_replicated` verifies that the indices still agree.
- **Per-rank state** (RNG, data-loader position) is gathered for a checkpoint by
  :func:`all_gather_objects`.
"""

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from squash.modules import FFILinear, get_adapter_buffers
from squash.training.masks import (
    check_drop_keeps_adapters,
    dense_grad,
    entries_replaced,
    prune_and_regrow,
    record_dense_grad,
)


def check_replicated(model: nn.Module) -> None:
    """Check that every FFI index buffer is the same on every rank (an all-gather per buffer).

    Raises:
        RuntimeError: naming the first buffer and rank that differ from rank 0.
    """
    world = dist.get_world_size()
    for name, buf in get_adapter_buffers(model).items():
        mine = buf.to(torch.int32)  # gloo has no int16 collectives
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        for rank, other in enumerate(gathered):
            if not torch.equal(other, gathered[0]):
                rows = (other != gathered[0]).any(dim=1).nonzero().flatten().tolist()
                raise RuntimeError(
                    f"FFI indices {name} differ between rank 0 and rank {rank} (rows {rows[:5]})"
                )


def _full(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device).full_tensor() if isinstance(t, DTensor) else t.to(device)


def _write_back(t: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's rows of ``full`` into ``t`` (a DTensor sharded by rows, or a plain
    tensor holding all of them)."""
    if not isinstance(t, DTensor):
        t.copy_(full)
        return
    local = t.to_local()
    chunks = torch.chunk(full, t.device_mesh.size(), dim=0)
    rank = t.device_mesh.get_local_rank()
    rows = chunks[rank] if rank < len(chunks) else full[:0]
    if tuple(rows.shape) != tuple(local.shape):
        raise RuntimeError(f"shard of shape {tuple(local.shape)} but rows {tuple(rows.shape)}")
    local.copy_(rows)


@torch.no_grad()
def update_masks_sharded(
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    drop_fraction: float,
    device: torch.device,
) -> Dict[str, int]:
    """:func:`~squash.training.update_masks` for a model sharded with FSDP2, on every rank.

    For each FFI factor: the dense gradient each rank recorded is summed over ranks (the gradient
    of the global batch); the values and their optimizer state (AdamW moments) are gathered;
    :func:`~squash.training.prune_and_regrow` runs on the full tensors, the same on every rank;
    each rank keeps its rows of the new values and moments, and the replicated indices buffer
    is updated in place. Recording is switched off afterwards.

    Args:
        model (nn.Module): the sharded model, outside forward and backward.
        optimizer (Optional[torch.optim.Optimizer]): the optimizer over the sharded values.
        drop_fraction (float): fraction of each row's entries to replace.
        device (torch.device): the compute device (where collectives run).

    Returns:
        Dict[str, int]: entries replaced per row, by module name.

    A factor where nothing moves (``round(drop_fraction * k) = 0``) is skipped, as
    :func:`~squash.training.update_masks` skips it: it needs no recorded gradient, and no rank
    takes part in a collective for it (every rank skips the same factors).

    Raises:
        ValueError: a module without a recorded dense gradient, or an update that would zero
            both factors of an adapter.
    """
    check_drop_keeps_adapters(model, drop_fraction)
    replaced = {}
    for name, module in model.named_modules():
        if not isinstance(module, FFILinear):
            continue
        if entries_replaced(drop_fraction, module.fan_in, module.in_features) == 0:
            replaced[name] = 0  # nothing moves in this factor: no gradient needed, none reduced
            record_dense_grad(module, False)
            continue
        grad = dense_grad(module)
        if grad is None:
            raise ValueError(
                f"no dense gradient for {name!r}: record_dense_grads(model) must be on during the "
                "forward/backward before a mask update"
            )
        grad = grad.to(device)
        dist.all_reduce(grad)  # sum over ranks: the dense gradient of the global batch
        param = module.values
        values = _full(param, device)
        state = optimizer.state.get(param, {}) if optimizer is not None else {}
        moments = {
            key: _full(t, device)
            for key, t in state.items()
            if isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(param.shape)
        }
        indices = module.indices
        replaced[name] = prune_and_regrow(
            values,
            indices,
            grad,
            drop_fraction,
            in_features=module.in_features,
            optimizer_state=moments,
        )
        _write_back(param, values)
        for key, full in moments.items():
            _write_back(state[key], full)
        record_dense_grad(module, False)
    return replaced


def all_gather_objects(obj) -> List:
    """``obj`` from every rank, in rank order (for per-rank RNG and data-loader state)."""
    out: List = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
