"""Model surgery and model-level adapter helpers.

- :func:`swap_lora_linear` replaces every torchtune ``LoRALinear`` with a
  :class:`~squash.modules.SparseLoRALinear` sharing its base weight.
- :func:`svd_initialize` runs the SVD initialisation from an unquantized checkpoint.
- :func:`get_adapter_buffers` / :func:`adapter_state_dict` complete torchtune's
  ``get_adapter_params`` with the FFI index buffers an adapter checkpoint must hold.
"""

from typing import Any, Dict, List, Mapping, Optional

import torch
from torch import nn
from torchtune.modules.peft import DoRALinear, LoRALinear, get_adapter_params

from squash._checks import INITS, SPARSE_FACTORS, check_choice, check_sparsity
from squash.modules.adapter import SparseAdapterModule, state_dict_key
from squash.nf4.modules import is_plain_lora
from squash.modules.sparse_lora import SparseLoRALinear


def swap_lora_linear(
    model: nn.Module,
    *,
    sparsity: float = 0.9,
    sparse_factor: str = "a",
    init: str = "lora",
    generator: Optional[torch.Generator] = None,
) -> nn.Module:
    """Swap every torchtune ``LoRALinear`` in ``model`` (and every
    :class:`~squash.modules.NF4LoRALinear`) for a ``SparseLoRALinear``, in place.

    Each replacement keeps rank, alpha, dropout probability, bias, the dense or NF4 base (the very
    same ``weight``/``bias`` parameters, loaded weights included) and the ``disabled`` flag and
    train/eval mode; see :meth:`SparseLoRALinear.from_lora_linear`. Adapter factors are
    initialised afresh per ``init``. Modules that are not ``nn.Module`` children, such as
    torchtune's ``TiedLinear`` output of Llama 3.2 and small Qwen 2.5 models, are not adapters
    and stay as they are.

    Args:
        model (nn.Module): a model containing ``LoRALinear`` modules (or one itself).
        sparsity (float): fraction of zeros of each sparse factor. Default: 0.9
        sparse_factor (str): ``"a"``, ``"b"`` or ``"both"``. Default: ``"a"``
        init (str): ``"lora"`` or ``"svd"`` (factors each current base weight; for a QLoRA model
            prefer :func:`svd_initialize` with the unquantized checkpoint). Default: ``"lora"``
        generator (Optional[torch.Generator]): CPU generator for FFI patterns and values.

    Returns:
        nn.Module: ``model`` (or the replacement, when ``model`` is itself a ``LoRALinear``).

    Raises:
        ValueError: on a DoRA or QAT LoRA layer (not supported), or bad sparsity arguments
            (checked before anything is swapped).
    """
    check_sparsity("sparsity", sparsity)
    check_choice("sparse_factor", sparse_factor, SPARSE_FACTORS)
    check_choice("init", init, INITS)
    kwargs = dict(sparsity=sparsity, sparse_factor=sparse_factor, init=init, generator=generator)
    _check_swappable("", model)
    if is_plain_lora(model):
        return SparseLoRALinear.from_lora_linear(model, **kwargs)
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            _check_swappable(f"{parent_name}.{name}" if parent_name else name, child)
            if is_plain_lora(child):
                setattr(parent, name, SparseLoRALinear.from_lora_linear(child, **kwargs))
    return model


def _check_swappable(name: str, module: nn.Module) -> None:
    if isinstance(module, DoRALinear) or (
        isinstance(module, LoRALinear) and not is_plain_lora(module)
    ):
        raise ValueError(
            f"cannot swap {type(module).__name__} at {name or '<root>'!r}: squash replaces plain "
            "LoRALinear only (no DoRA or QAT LoRA)"
        )


def svd_initialize(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> List[str]:
    """SVD-initialise every ``SparseLoRALinear`` whose pretrained weight is in ``state_dict``.

    Call it after the base checkpoint is loaded, with the unquantized checkpoint weights (keys as
    in ``model.state_dict()``, e.g. ``layers.0.attn.q_proj.weight``). Each module's base becomes
    the residual (see :meth:`SparseLoRALinear.initialize_from_pretrained`). The residual base
    differs from the checkpoint; to resume, call this again with the same checkpoint (the SVD is
    deterministic on one machine), then load the trained adapter.

    Returns:
        List[str]: names of the modules initialised.
    """
    done = []
    for name, module in model.named_modules():
        if isinstance(module, SparseLoRALinear) and f"{name}.weight" in state_dict:
            module.initialize_from_pretrained(state_dict[f"{name}.weight"])
            done.append(name)
    return done


def get_adapter_buffers(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The FFI index buffers of all adapters, by full name (``...lora_a.indices``)."""
    buffers = {}
    for prefix, module in model.named_modules():
        if isinstance(module, SparseAdapterModule):
            named = dict(module.named_buffers())
            for name in module.adapter_buffers():
                buffers[f"{prefix}.{name}" if prefix else name] = named[name]
    return buffers


def adapter_state_dict(model: nn.Module, device: Optional[str] = "cpu") -> Dict[str, Any]:
    """Every tensor an adapter checkpoint holds: torchtune's adapter params and the FFI indices.

    Args:
        model (nn.Module): a model with adapters.
        device (Optional[str]): where to copy the tensors. Default: ``"cpu"``

    Returns:
        Dict[str, Any]: detached tensors keyed as in ``model.state_dict()``.
    """
    tensors = {**get_adapter_params(model), **get_adapter_buffers(model)}
    return {state_dict_key(k): v.detach().to(device) for k, v in tensors.items()}
