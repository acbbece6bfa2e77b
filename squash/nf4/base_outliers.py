"""The corrected 4-bit base of a built model: the ``base_outliers`` builder argument (the config
key ``model.base_outliers``) and what a module does with it.

A projection built with ``base_outliers={"fraction": f, "criterion": c}`` computes its frozen
base as ``nf4_linear(x, W_nf4) + ffi_linear(x, S)`` (:func:`~squash.nf4.outlier_linear`), where
``W ~= dequant(NF4(W - S)) + S`` and ``S`` holds ``round(f * in_features)`` outliers per row
(:func:`~squash.nf4.split_outliers`, 16-bit values, two select-remove-quantize rounds). A module
holds the setting in ``base_outliers`` and ``S`` in the non-persistent buffers
``outlier_values`` and ``outlier_indices``: nothing of ``S`` is written to a checkpoint. ``S`` is
a deterministic function of the dense base weight (and, for ``"sensitivity"``, of the
calibration second moments), so it is rebuilt from the base whenever the model is loaded
(:func:`set_corrected_base_`, called by :mod:`squash.assembly.calibration`). Until then ``S`` is
empty and the module computes plain NF4.

A model's state dict holds each corrected base as ``dequant(NF4) + S``
(:func:`outliers_state_dict_post_hook`, registered by the builders after torchtune's NF4
dequantizing hook), so the merged weights a checkpoint exports carry the outliers.
"""

from typing import Any, Callable, Dict, Mapping, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from squash.nf4.outliers import CRITERIA, Outliers, split_outliers
from squash.sparsity.ffi import ffi_to_dense

__all__ = [
    "add_outliers_",
    "BASE_OUTLIER_KEYS",
    "check_base_outliers",
    "DEFAULT_CALIBRATION",
    "init_base_outliers_",
    "module_outliers",
    "outlier_modules",
    "outliers_state_dict_post_hook",
    "parse_base_outliers",
    "set_corrected_base_",
]

BASE_OUTLIER_KEYS = ("fraction", "criterion", "calibration")
# The calibration of the measured runs (docs/benchmarks/nf4.md): 32 windows of 256 tokens of
# the train split of squash's Python Language Reference text.
DEFAULT_CALIBRATION = {"samples": 32, "max_seq_len": 256}
MAX_FRACTION = 0.5
_WRAPPED = "_checkpoint_wrapped_module."


def parse_base_outliers(value: Any, where: str = "base_outliers") -> Optional[Dict[str, Any]]:
    """``value`` (a mapping or None) as a plain dict ``{"fraction", "criterion",
    "calibration": {"samples", "max_seq_len"}}`` with the defaults filled in (``criterion``
    ``"sensitivity"``, ``calibration`` :data:`DEFAULT_CALIBRATION`); None stays None.

    Raises:
        ValueError: one line naming the key at fault (``base_outliers.fraction``): a value that
            is not a mapping, an unknown key, ``fraction`` outside ``(0, 0.5]``, an unknown
            ``criterion``, a calibration count that is not an integer >= 1.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a mapping (fraction, criterion, calibration) or "
                         f"null, got {value!r}")  # fmt: skip
    for key in value:
        if key not in BASE_OUTLIER_KEYS:
            raise ValueError(f"{where}.{key} is not a key of base_outliers (one of "
                             f"{', '.join(BASE_OUTLIER_KEYS)})")  # fmt: skip
    if "fraction" not in value:
        raise ValueError(f"{where}.fraction is missing: give the share of each row kept as "
                         f"outliers, in (0, {MAX_FRACTION}]")  # fmt: skip
    fraction = value["fraction"]
    if (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
            or not 0 < fraction <= MAX_FRACTION):  # fmt: skip
        raise ValueError(f"{where}.fraction must be a number in (0, {MAX_FRACTION}], got "
                         f"{fraction!r}")  # fmt: skip
    criterion = value.get("criterion", "sensitivity")
    if criterion not in CRITERIA:
        raise ValueError(f"{where}.criterion must be one of {', '.join(CRITERIA)}, got "
                         f"{criterion!r}")  # fmt: skip
    calibration = value.get("calibration", None)
    calibration = {} if calibration is None else calibration
    if not isinstance(calibration, Mapping):
        raise ValueError(f"{where}.calibration must be a mapping (samples, max_seq_len), got "
                         f"{calibration!r}")  # fmt: skip
    cal = dict(DEFAULT_CALIBRATION)
    for key in calibration:
        if key not in DEFAULT_CALIBRATION:
            raise ValueError(f"{where}.calibration.{key} is not a key of calibration (one of "
                             f"{', '.join(DEFAULT_CALIBRATION)})")  # fmt: skip
        n = calibration[key]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{where}.calibration.{key} must be an integer >= 1, got {n!r}")
        cal[key] = int(n)
    return {"fraction": float(fraction), "criterion": criterion, "calibration": cal}


def check_base_outliers(base_outliers: Any, quantize_base: bool) -> None:
    """A builder's check: ``base_outliers`` as :func:`parse_base_outliers` takes it, and only
    with ``quantize_base``.

    Raises:
        ValueError: one line naming the key (``base_outliers.fraction``, ...).
    """
    if parse_base_outliers(base_outliers) is not None and not quantize_base:
        raise ValueError("base_outliers needs quantize_base: true (an NF4 base to correct)")


def init_base_outliers_(module: nn.Module, base_outliers: Any) -> None:
    """Give ``module`` (an NF4 linear) the setting ``base_outliers`` (see
    :func:`parse_base_outliers`) and empty outlier buffers, filled by
    :func:`set_corrected_base_`."""
    parsed = parse_base_outliers(base_outliers)
    module.base_outliers = None if parsed is None else {
        "fraction": parsed["fraction"], "criterion": parsed["criterion"]}  # fmt: skip
    module.register_buffer("outlier_values", None, persistent=False)
    module.register_buffer("outlier_indices", None, persistent=False)


def module_outliers(module: nn.Module) -> Optional[Outliers]:
    """The outliers ``S`` a module holds, or None (plain NF4: no setting, or not yet loaded)."""
    values = getattr(module, "outlier_values", None)
    if values is None:
        return None
    return Outliers(values, module.outlier_indices)


def outlier_modules(model: nn.Module) -> Dict[str, nn.Module]:
    """``{name: module}`` of every module of ``model`` built with a ``base_outliers`` setting."""
    return {n: m for n, m in model.named_modules() if getattr(m, "base_outliers", None)}


@torch.no_grad()
def set_corrected_base_(
    module: nn.Module,
    weight: torch.Tensor,
    second_moment: Optional[torch.Tensor] = None,
    name: str = "weight",
    *,
    device: Optional[torch.device] = None,
    place: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> Outliers:
    """Replace ``module``'s NF4 base by the corrected base of the dense ``weight``: the NF4 of
    ``weight`` with its outliers removed, and the outliers in ``outlier_values`` /
    ``outlier_indices``. ``weight`` is taken in the NF4 weight's dtype, on its device, as a
    state-dict load takes it; the same ``weight`` (and ``second_moment``) give the same result.

    Args:
        module (nn.Module): a module with a ``base_outliers`` setting and an NF4 ``weight``.
        weight (torch.Tensor): the dense base weight ``(out, in)``.
        second_moment (Optional[torch.Tensor]): ``(in,)`` for the ``"sensitivity"`` criterion.
        name (str): the weight's name, for errors.
        device (Optional[torch.device]): where the split is computed and ``S`` is kept
            (default: the weight's device).
        place (Optional[Callable]): turns the full NF4 base into what the parameter holds (a
            sharded model's row shard); default: the base itself.

    Returns:
        Outliers: the outliers set.

    Raises:
        ValueError: a module without the setting, or as :func:`~squash.nf4.split_outliers`.
    """
    cfg = getattr(module, "base_outliers", None)
    if not cfg:
        raise ValueError(f"{name}: the module has no base_outliers setting")
    target = module.weight
    device = target.device if device is None else device
    w = weight.detach().to(device=device, dtype=target.dtype)
    base, out = split_outliers(w, cfg["fraction"], cfg["criterion"], second_moment, name=name)
    module.weight = nn.Parameter(base if place is None else place(base), requires_grad=False)
    module.register_buffer("outlier_values", out.values, persistent=False)
    module.register_buffer("outlier_indices", out.indices, persistent=False)
    return out


def outliers_state_dict_post_hook(
    model: nn.Module, state_dict: Dict[str, torch.Tensor], prefix: str, *args, **kwargs
) -> None:
    """A model state-dict hook: each corrected base's ``weight`` (already dequantized by
    torchtune's hook, registered before this one) becomes ``dequant(NF4) + S``
    (:func:`add_outliers_`). A weight FSDP2 shards is left as it is: its gathered copy gets
    ``S`` from ``add_outliers_(..., sharded=True)``."""
    add_outliers_(model, state_dict, prefix)


def add_outliers_(
    model: nn.Module, state_dict: Dict[str, torch.Tensor], prefix: str = "", sharded: bool = False
) -> int:
    """Add each corrected base's ``S`` to its dense weight in ``state_dict``, summed in float32
    and stored in the weight's dtype: the weights each process holds whole (``sharded=False``,
    the state-dict hook), or the gathered full copies of those FSDP2 shards (``sharded=True``).
    Returns how many weights got their ``S``."""
    count = 0
    for name, module in outlier_modules(model).items():
        out = module_outliers(module)
        key = f"{prefix}{name.replace(_WRAPPED, '')}.weight"
        if out is None or key not in state_dict or isinstance(module.weight, DTensor) != sharded:
            continue
        w = state_dict[key]
        s = ffi_to_dense(out.values.float(), out.indices, w.shape[1]).to(w.device)
        state_dict[key] = (w.float() + s).to(w.dtype)
        count += 1
    return count
