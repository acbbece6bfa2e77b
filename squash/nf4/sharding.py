"""NF4 weights under FSDP2: which can be split into row shards, and a rank's shard of one.

torchao splits an NF4 tensor for FSDP2 only into equal pieces of its quantization blocks
(``numel`` a multiple of ``block_size * scaler_block_size * world_size``, 64 * 256 * N by
default); real models meet this, tiny test models do not (:func:`nf4_shardable`,
:func:`unshardable_nf4_params`: the assembly's :func:`~squash.assembly.fsdp.shard_model` keeps
such a weight whole on every rank). NF4 has no ``distribute_tensor``: :func:`shard_nf4` builds a
rank's row shard as a DTensor by hand (as torchtune's ``load_from_full_model_state_dict`` does),
from a full weight quantized exactly as one device quantizes it (:func:`quantize_like`, with
squash's :func:`~squash.nf4.quantize.copy_nf4_`).
"""

from typing import Dict

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from squash.nf4._torchao import NF4Tensor
from squash.nf4.quantize import copy_nf4_, to_nf4_exact


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


def quantize_like(nf4: NF4Tensor, value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``value`` as an NF4 tensor with ``nf4``'s dtype and block sizes, quantized exactly as
    ``load_state_dict`` does it on one device (NF4's ``copy_`` quantizes the source in its own
    dtype, which differs from quantizing it after a cast), so a sharded run holds the base
    weights a one-device run holds."""
    out = to_nf4_exact(
        torch.zeros(tuple(value.shape), dtype=nf4.dtype, device=device),
        block_size=nf4.block_size,
        scaler_block_size=nf4.scaler_block_size,
    )
    return copy_nf4_(out, value.to(device))


def shard_nf4(meta: DTensor, full: torch.Tensor) -> DTensor:
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
    local = shard_nf4(like, full)
    return local.cpu() if like.device.type == "cpu" and full.device.type != "cpu" else local
