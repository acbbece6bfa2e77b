"""What the model assembly needs of FSDP2 beyond torchtune's distributed helpers.

torchtune's ``shard_model`` and ``load_from_full_model_state_dict`` know ``LoRALinear`` adapters
over NF4 bases; squash adds two things:

- **FFI indices are replicated buffers.** FSDP2 shards parameters only, so every rank holds the
  whole ``(out, k)`` index buffer of each :class:`~squash.modules.FFILinear` while its ``values``
  are sharded by rows like any parameter. :func:`load_full_state_dict` broadcasts every buffer
  (and every parameter FSDP does not manage) from rank 0, so the indices are identical on every
  rank from the start (the training step keeps them so:
  :func:`squash.training.distributed.update_masks_sharded`).
- **NF4 weights that cannot be split evenly stay replicated**
  (:func:`squash.nf4.sharding.nf4_shardable`): :func:`shard_model` leaves such a (small) frozen
  weight out of FSDP (``ignored_params``) and every rank keeps it whole.
"""

from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtune import training

from squash.modules import FFILinear
from squash.modules.adapter import state_dict_key
from squash.nf4 import NF4Tensor
from squash.nf4.sharding import quantize_like, shard_nf4, unshardable_nf4_params


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
                local = shard_nf4(target, quantize_like(target._local_tensor, value, device))
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
                value = quantize_like(target, value, device)
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
