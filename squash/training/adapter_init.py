"""The initial adapter of a run, as full tensors, independent of how the model was built.

A model built on the meta device (the FSDP2 recipe) draws nothing, and one built on a device
draws its adapters from the global RNG in between its base weights, so the same seed would give
different adapters on one device and on N. Here each adapter is drawn from its own CPU generator,
seeded by the run's seed and the module's name, so every recipe, every rank and every world size
starts from the same adapter. The result is a state dict: load it with ``load_state_dict``
(one device) or :func:`squash.training.distributed.load_full_state_dict` (sharded).
"""

import zlib
from typing import Dict, Mapping, Tuple

import torch
from torch import nn

from squash.modules import FFILinear, SparseLoRALinear, get_adapter_modules, is_plain_lora
from squash.modules.ffi_linear import kaiming_uniform_
from squash.modules.sparse_lora import initialize_lora_factors_, svd_factors


def module_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded by ``seed`` and the module name ``name`` (stable across runs)."""
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def _factor_dtype(module: nn.Module) -> torch.dtype:
    factor = module.lora_a
    return (factor.values if hasattr(factor, "values") else factor.weight).dtype


def _fresh_factors(module: SparseLoRALinear) -> Dict[str, nn.Module]:
    """CPU factors ``lora_a`` and ``lora_b`` of ``module``'s shapes, fan-ins and dtype, not
    yet drawn."""
    factory = dict(dtype=_factor_dtype(module), device="meta")
    out = {}
    for name in ("lora_a", "lora_b"):
        f = getattr(module, name)
        if isinstance(f, FFILinear):
            out[name] = FFILinear(f.in_features, f.out_features, f.fan_in, **factory)
        else:
            out[name] = nn.Linear(f.in_features, f.out_features, bias=False, **factory)
    return {k: f.to_empty(device="cpu") for k, f in out.items()}


def _adapter_tensors(name: str, module: nn.Module) -> Dict[str, torch.Tensor]:
    return {
        f"{name}.{key}": value
        for key, value in module.state_dict().items()
        if key.startswith(("lora_a.", "lora_b."))
    }


def initial_adapter_state_dict(model: nn.Module, seed: int) -> Dict[str, torch.Tensor]:
    """LoRA initialisation of every adapter of ``model`` as full CPU tensors.

    ``SparseLoRALinear``: its ``initialize_parameters`` (random FFI patterns, A Kaiming-uniform
    over its fan-in, B zero); torchtune's ``LoRALinear``: A Kaiming-uniform over ``in_dim``, B
    zero. Each module draws from :func:`module_generator` ``(seed, name)``. ``model`` may be on
    the meta device or sharded: only its structure is read.

    Args:
        model (nn.Module): a model with adapters.
        seed (int): the run's seed.

    Returns:
        Dict[str, torch.Tensor]: adapter tensors keyed as in ``model.state_dict()``.

    Raises:
        ValueError: an adapter that is neither (DoRA, say).
    """
    out = {}
    for name, module in get_adapter_modules(model).items():
        generator = module_generator(seed, name)
        if isinstance(module, SparseLoRALinear):
            # the factors alone, drawn as SparseLoRALinear.initialize_parameters draws them
            factors = nn.ModuleDict(_fresh_factors(module))
            initialize_lora_factors_(factors["lora_a"], factors["lora_b"], generator)
            out.update(_adapter_tensors(name, factors))
        elif is_plain_lora(module):
            dtype = _factor_dtype(module)
            a = torch.empty(module.rank, module.in_dim, dtype=dtype)
            kaiming_uniform_(a, module.in_dim, generator=generator)
            out[f"{name}.lora_a.weight"] = a
            out[f"{name}.lora_b.weight"] = torch.zeros(module.out_dim, module.rank, dtype=dtype)
        else:
            raise ValueError(
                f"{name}: cannot initialise a {type(module).__name__} adapter (LoRALinear and "
                "SparseLoRALinear only)"
            )
    return out


def svd_initial_state(
    model: nn.Module, base_state_dict: Mapping[str, torch.Tensor]
) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """SVD initialisation (``model.init: svd``) computed on full CPU tensors.

    For each ``SparseLoRALinear`` whose weight is in ``base_state_dict``: what
    :meth:`SparseLoRALinear.initialize_from_pretrained` gives, in float32 on the CPU: the adapter
    factors, and the residual that replaces the base weight, in the base's dtype (quantized when
    the model loads it).

    Args:
        model (nn.Module): the model (meta or sharded: only its structure is read).
        base_state_dict (Mapping[str, torch.Tensor]): the unquantized checkpoint weights.

    Returns:
        Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]: the adapter tensors and the
        residual base weights, keyed as in ``model.state_dict()``.
    """
    adapter, residual = {}, {}
    for name, module in get_adapter_modules(model).items():
        key = f"{name}.weight"
        if not isinstance(module, SparseLoRALinear) or key not in base_state_dict:
            continue
        state, rest = svd_factors(
            base_state_dict[key].detach().cpu(), rank=module.rank, scaling=module.scaling,
            fan_in_a=getattr(module.lora_a, "fan_in", None),
            fan_in_b=getattr(module.lora_b, "fan_in", None),
        )  # fmt: skip
        # each tensor rounded once to the dtype the module holds it in, as an in-place
        # initialisation rounds it (the residual in the base's dtype: quantized where loaded)
        held = dict(module.named_parameters(), **dict(module.named_buffers()))
        adapter.update({f"{name}.{k}": v.to(held[k].dtype) for k, v in state.items()})
        residual[key] = rest.float().to(module.weight.dtype)
    return adapter, residual
