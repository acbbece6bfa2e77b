"""What the FSDP2 recipe needs beyond torchtune's distributed helpers.

torchtune's ``shard_model``, ``load_from_full_model_state_dict`` and ``gather_cpu_state_dict``
know ``LoRALinear`` adapters over NF4 bases; squash adds three things:

- **FFI indices are replicated buffers.** FSDP2 shards parameters only, so every rank holds the
  whole ``(out, k)`` index buffer of each :class:`~squash.modules.FFILinear` while its ``values``
  are sharded by rows like any parameter. :func:`load_full_state_dict` broadcasts every buffer
  (and every parameter FSDP does not manage) from rank 0, so the indices are identical on every
  rank from the start; :func:`update_masks_sharded` keeps them so (it computes each update from
  the all-reduced dense gradient and the gathered values, the same on every rank), and
  :func:`check_replicated` verifies it.
- **NF4 weights that cannot be split evenly stay replicated.** torchao splits an NF4 tensor for
  FSDP2 only into equal pieces of its quantization blocks (``numel`` a multiple of
  ``block_size * scaler_block_size * world_size``, 64 * 256 * N by default); real models meet
  this, tiny test models do not. :func:`shard_model` leaves such a (small) frozen weight out of
  FSDP (``ignored_params``) and every rank keeps it whole.
- **Dense gradients for mask updates are summed over ranks** (:func:`update_masks_sharded`): each
  rank records the dense gradient of its own micro-batches; the sum is the gradient of the global
  batch, as the single-device recipe records it.
"""

from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torchtune import training

from squash.modules import FFILinear, get_adapter_buffers
from squash.modules.adapter import state_dict_key
from squash.nf4 import NF4Tensor, to_nf4
from squash.training.masks import (
    check_drop_keeps_adapters,
    dense_grad,
    entries_replaced,
    prune_and_regrow,
    record_dense_grad,
)

_NF4_SHARDED_PARTS = ("quantized_scalers", "quantization_factor", "quantized_data")


def nf4_shardable(weight: torch.Tensor, world_size: int) -> bool:
    """Whether torchao can split the NF4 ``weight`` into ``world_size`` equal row shards."""
    if weight.shape[0] % world_size:
        return False
    return all(getattr(weight, part).numel() % world_size == 0 for part in _NF4_SHARDED_PARTS)


def unshardable_nf4_params(model: nn.Module, world_size: int) -> Dict[str, nn.Parameter]:
    """The NF4 parameters of ``model`` that torchao cannot split into ``world_size`` shards."""
    return {
        name: p
        for name, p in model.named_parameters()
        if isinstance(p, NF4Tensor) and not nf4_shardable(p, world_size)
    }


def shard_model(
    model: nn.Module,
    *,
    cpu_offload: bool,
    reshard_after_forward: bool = True,
    custom_sharded_layers: Optional[List[str]] = None,
) -> List[str]:
    """``fully_shard`` every decoder layer (``layers.N``, plus ``custom_sharded_layers``), then
    the whole model, as torchtune's ``shard_model`` does, leaving out the NF4 weights that cannot
    be split evenly (see the module docstring).

    Args:
        model (nn.Module): the model, usually still on the meta device.
        cpu_offload (bool): keep sharded parameters, gradients and optimizer state on the CPU.
        reshard_after_forward (bool): free the gathered parameters after the forward.
            Default: True
        custom_sharded_layers (Optional[List[str]]): more module names to shard on their own.

    Returns:
        List[str]: names of the NF4 weights kept whole on every rank.

    Raises:
        ValueError: if no module matched (a model without ``layers.N``).
    """
    ignored = unshardable_nf4_params(model, dist.get_world_size())
    ignored_set: Set[nn.Parameter] = set(ignored.values())
    kwargs = {"reshard_after_forward": reshard_after_forward}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    sharded = 0
    for name, module in reversed(list(model.named_modules())):
        if training.get_shard_conditions(name, module, custom_sharded_layers):
            own = {p for p in module.parameters() if p in ignored_set}
            fully_shard(module, ignored_params=own or None, **kwargs)
            sharded += 1
    if sharded == 0:
        raise ValueError("No decoder layer (layers.N) to shard; is this a torchtune decoder?")
    fully_shard(model, ignored_params=ignored_set or None, **kwargs)
    return sorted(ignored)


def broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """``tensor`` from rank ``src`` on every rank, any dtype (sent as bytes, which gloo and NCCL
    both carry); ``tensor`` itself outside torch.distributed (one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return tensor
    tensor = tensor.contiguous()
    dist.broadcast(tensor.reshape(-1).view(torch.uint8), src=src)
    return tensor


def _quantize_like(nf4: NF4Tensor, value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``value`` as an NF4 tensor with ``nf4``'s dtype and block sizes, quantized exactly as
    ``load_state_dict`` does it on one device (NF4's ``copy_`` quantizes the source in its own
    dtype, which differs from quantizing it after a cast), so a sharded run holds the base
    weights a one-device run holds."""
    out = to_nf4(
        torch.zeros(tuple(value.shape), dtype=nf4.dtype, device=device),
        block_size=nf4.block_size,
        scaler_block_size=nf4.scaler_block_size,
    )
    out.copy_(value.to(device))
    return out


def _shard_nf4(meta: DTensor, full: torch.Tensor) -> DTensor:
    """This rank's row shard of the NF4 tensor ``full`` as a DTensor shaped like ``meta`` (as
    torchtune's ``load_from_full_model_state_dict`` builds it: NF4 has no ``distribute_tensor``)."""
    mesh = meta.device_mesh
    if mesh.ndim > 1:
        raise NotImplementedError(f"only 1-D FSDP meshes are supported, got {mesh.ndim}-D")
    world = mesh.size(0)
    chunk = list(torch.chunk(full, world, dim=0))[mesh.get_local_rank()]
    local = full.new_zeros(chunk.size())
    local[: chunk.size(0)].copy_(chunk)
    return DTensor(
        local_tensor=local,
        spec=DTensorSpec(
            mesh=mesh,
            placements=meta.placements,
            tensor_meta=TensorMeta(shape=meta.size(), dtype=meta.dtype, stride=meta.stride()),
        ),
        requires_grad=meta.requires_grad,
    )


def shard_nf4_like(like: DTensor, full: torch.Tensor) -> DTensor:
    """This process's row shard of the full NF4 tensor ``full``, sharded and placed as the
    sharded parameter ``like`` (its mesh and placements; on the CPU where ``like`` is
    offloaded there)."""
    local = _shard_nf4(like, full)
    return local.cpu() if like.device.type == "cpu" and full.device.type != "cpu" else local


def load_full_state_dict(
    model: nn.Module,
    full_sd: Dict[str, torch.Tensor],
    device: torch.device,
    *,
    cpu_offload: bool = False,
) -> Tuple[List[str], List[str]]:
    """Load a full (unsharded) state dict into a model sharded by :func:`shard_model`, or into a
    model on the meta device or on ``device`` in one process (nothing is broadcast then).

    Each rank keeps its shard of every sharded parameter (torchtune's
    ``load_from_full_model_state_dict`` does the same; NF4 weights are quantized exactly as on one
    device first). Everything FSDP does not shard (buffers such as the FFI indices, NF4 weights
    kept whole) is taken from rank 0 by a broadcast, so every rank holds the same tensor, on
    ``device``. FFI indices are checked against the FFI rules.

    Args:
        model (nn.Module): the sharded model.
        full_sd (Dict[str, torch.Tensor]): full tensors keyed as in ``model.state_dict()``.
        device (torch.device): the compute device.
        cpu_offload (bool): whether the model's sharded parameters live on the CPU.

    Returns:
        Tuple[List[str], List[str]]: the model's keys missing from ``full_sd``, and the keys of
        ``full_sd`` the model does not have.

    Raises:
        ValueError: FFI indices that break the FFI rules, or a shape that does not fit.
    """
    from squash.sparsity.ffi import validate_ffi

    own = _state_tensors(model)  # not model.state_dict(): its NF4 hooks cannot read meta tensors
    unexpected = sorted(k for k in full_sd if k not in own)
    missing = sorted(k for k in own if k not in full_sd)
    sharded = {}
    for key in sorted(k for k in full_sd if k in own):
        module, attr, target = own[key]
        value = full_sd[key]
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(
                f"{key}: shape {tuple(value.shape)} in the state dict, {tuple(target.shape)} in "
                "the model"
            )
        if isinstance(target, DTensor):
            if isinstance(target._local_tensor, NF4Tensor):
                local = _shard_nf4(target, _quantize_like(target._local_tensor, value, device))
            else:
                local = distribute_tensor(
                    value.to(device=device, dtype=target.dtype),
                    target.device_mesh,
                    target.placements,
                )
            sharded[key] = nn.Parameter(local.cpu() if cpu_offload else local)
            continue
        if isinstance(target, NF4Tensor):
            value = broadcast(value.to(device=device))
        else:
            value = broadcast(value.to(device=device, dtype=target.dtype))
        if isinstance(module, FFILinear) and attr == "indices":
            validate_ffi(None, value, module.in_features, where=f"load of {key}")
        if attr in module._parameters:
            if isinstance(target, NF4Tensor):
                value = _quantize_like(target, value, device)
            module._parameters[attr] = nn.Parameter(value, requires_grad=target.requires_grad)
        else:
            module._buffers[attr] = value
    # assign=True: the meta DTensors cannot be copied into; FSDP2 takes the new ones at its
    # lazy init (as with torchtune's loader). load_state_dict maps the keys through activation
    # checkpointing's wrappers itself.
    model.load_state_dict(sharded, strict=False, assign=True)
    return missing, unexpected


def _state_tensors(model: nn.Module) -> Dict[str, Tuple[nn.Module, str, torch.Tensor]]:
    """What ``model.state_dict()`` holds (parameters and persistent buffers) by its keys, each
    with its module and attribute name; without the state-dict hooks."""
    out = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        prefix = f"{state_dict_key(prefix)}." if prefix else ""
        for name, p in module._parameters.items():
            if p is not None:
                out[prefix + name] = (module, name, p)
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                out[prefix + name] = (module, name, b)
    return out


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

