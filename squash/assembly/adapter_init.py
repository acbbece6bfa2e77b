"""The initial adapter of a run, as full tensors, independent of how the model was built.

A model built on the meta device (the FSDP2 recipe) draws nothing, and one built on a device
draws its adapters from the global RNG in between its base weights, so the same seed would give
different adapters on one device and on N. Here each adapter is drawn from its own CPU generator,
seeded by the run's seed and the module's name, so every recipe, every rank and every world size
starts from the same adapter. The result is a state dict: load it with ``load_state_dict``
(one device) or :func:`squash.assembly.fsdp.load_full_state_dict` (sharded).
"""

import zlib
from typing import Dict, Mapping, Tuple

import torch
from torch import nn

from squash.config.keys import ConfigKeyError
from squash.modules import FFILinear, SparseLoRALinear, get_adapter_modules, is_plain_lora
from squash.modules.ffi_linear import kaiming_uniform_
from squash.modules.sparse_lora import initialize_lora_factors_, svd_factors
from squash.nf4 import NF4Tensor
from squash.nf4.loftq import loftq


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

    Raises:
        ConfigKeyError: an adapter rank above the smaller side of its weight, naming
            ``model.lora_rank``.
    """
    adapter, residual = {}, {}
    for name, module in get_adapter_modules(model).items():
        key = f"{name}.weight"
        if not isinstance(module, SparseLoRALinear) or key not in base_state_dict:
            continue
        bound = min(base_state_dict[key].shape)
        if module.rank > bound:
            raise ConfigKeyError(
                f"model.lora_rank={module.rank} is above what model.init: svd can give {name} "
                f"(a {tuple(base_state_dict[key].shape)} weight has {bound} singular vectors); "
                f"set model.lora_rank <= {bound} or model.init: lora"
            )
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


def loftq_initial_state(
    model: nn.Module, base_state_dict: Mapping[str, torch.Tensor], iterations: int = 1
) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """LoftQ initialisation (``model.init: loftq``) of every adapter on an NF4 base, computed
    on full CPU tensors: :func:`squash.nf4.loftq` alternates the NF4 quantization of
    ``W - s B A`` (at the module's block sizes and dtype) with the factors of ``W - dequant``.

    The factor step is the adapter's own initialisation from a matrix: for torchtune's QLoRA
    ``LoRALinear``, PEFT's (the best rank-``r`` approximation, singular values split evenly,
    divided by ``sqrt(alpha / r)`` so the scaled product is that approximation); for a
    ``SparseLoRALinear``, :func:`~squash.modules.sparse_lora.svd_factors` (the sparse factors
    pruned to FFI, the dense one refitted).

    Args:
        model (nn.Module): the model (meta or sharded: only its structure is read).
        base_state_dict (Mapping[str, torch.Tensor]): the unquantized checkpoint weights.
        iterations (int): LoftQ's alternations (``model.loftq_iterations``), >= 1.

    Returns:
        Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]: the adapter tensors, and what
        each NF4 base loads (``W`` after one iteration, ``W - s B A`` of the one before after
        more; the model quantizes it to the NF4 LoftQ paired with the factors), keyed as in
        ``model.state_dict()``.

    Raises:
        ValueError: an adapter whose base is not NF4, or whose weight ``base_state_dict``
            lacks, naming it.
    """
    adapter, quantized = {}, {}
    for name, module in get_adapter_modules(model).items():
        key = f"{name}.weight"
        weight = module.weight
        if not isinstance(weight, NF4Tensor):
            raise ValueError(f"{name}: init loftq needs an NF4 base (quantize_base: true), got "
                             f"a {type(weight).__name__} weight")  # fmt: skip
        if key not in base_state_dict:
            raise ValueError(f"{name}: the base checkpoint has no {key} to initialise from")
        held = dict(module.named_parameters(), **dict(module.named_buffers()))
        if isinstance(module, SparseLoRALinear):
            step = _sparse_step(module)
        elif is_plain_lora(module):
            step = _dense_step(module.rank, module.alpha / module.rank)
        else:
            raise ValueError(f"{name}: cannot initialise a {type(module).__name__} adapter")
        result = loftq(
            base_state_dict[key].detach().cpu(), iterations, step, dtype=weight.dtype,
            block_size=weight.block_size,
            scaler_block_size=weight.scaler_block_size, name=key,
        )  # fmt: skip
        adapter.update({f"{name}.{k}": v.to(held[k].dtype) for k, v in result.factors.items()})
        quantized[key] = result.quantized.to(weight.dtype)
    return adapter, quantized


def _dense_step(rank: int, scaling: float):
    """PEFT's LoftQ step for a dense ``LoRALinear`` of ``scaling``: ``(factors, s B A)``."""

    def step(error: torch.Tensor):
        u, s, vh = torch.linalg.svd(error, full_matrices=False)
        root = s[:rank].sqrt()
        b, a = u[:, :rank] * root, root[:, None] * vh[:rank]
        product = torch.mm(b, a)
        root_scale = scaling**0.5
        return {"lora_a.weight": a / root_scale, "lora_b.weight": b / root_scale}, product

    return step


def _sparse_step(module: SparseLoRALinear):
    """LoftQ's step for a ``SparseLoRALinear``: its SVD initialisation of the error."""

    def step(error: torch.Tensor):
        state, rest = svd_factors(
            error, rank=module.rank, scaling=module.scaling,
            fan_in_a=getattr(module.lora_a, "fan_in", None),
            fan_in_b=getattr(module.lora_b, "fan_in", None),
        )  # fmt: skip
        return state, (error.double() - rest).float()

    return step
