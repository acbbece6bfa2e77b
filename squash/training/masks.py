"""Dynamic sparsity at constant fan-in: when the masks move (:class:`MaskUpdateSchedule`, the
``mask_update`` block of a recipe config), and how: prune and regrow each row of an FFI matrix.

For each row, the ``n = round(drop_fraction * k)`` entries of smallest ``|value|`` are dropped and
``n`` new columns are grown where the dense gradient ``|grad W|`` is largest among the columns
that were *not* in the row before the update (so every update moves ``n`` entries; ``n`` is
capped at ``in_features - k``). New entries start at zero. Rows stay sorted, so surviving values
move to their new slots, and the optimizer state (every state tensor shaped like the parameter:
AdamW's ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``; SGD's ``momentum_buffer``) moves with
them; grown slots get zero state. Scalar state such as ``step`` is kept.

Ties are broken towards lower columns, both when dropping (equal ``|value|``) and when growing
(equal ``|grad|``), so an update is a deterministic function of its inputs. Without a dense
gradient, growth is uniformly random among the absent columns (SET), drawn from ``generator``.

The dense gradient of an FFI factor is ``grad_out^T @ x`` ``(out, in)``. What a backward records
for an update is installed here on each :class:`~squash.modules.FFILinear` as a forward hook,
with its state beside the module (the module knows nothing of training):
:func:`record_dense_grad` computes the output as a dense product through a zero leaf
``(out, in)`` tensor whose ``.grad`` then accumulates exactly that gradient (across gradient
accumulation and activation checkpointing too), at the cost of a dense weight, its gradient and
the dense matmul while installed; :func:`record_module_grow_candidates` reduces each backward's
gradient to growth candidates instead. Both hooks are removed when recording stops; model-wide:
:func:`record_dense_grads`, :func:`record_grow_candidates`.
"""

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional

import torch
from torch import nn

from squash._checks import check_int, check_real
from squash.config.blocks import parse_mask_update
from squash.modules import FFILinear, SparseLoRALinear
from squash.sparsity.ffi import index_dtype, validate_ffi


def cosine_drop_fraction(step: int, drop_fraction: float, until_step: int) -> float:
    """RigL's cosine-decayed drop fraction for the mask update at ``step``.

    ``drop_fraction / 2 * (1 + cos(pi * step / until_step))`` before ``until_step``, 0 at and
    after it (no more mask updates): the full ``drop_fraction`` at step 0, half of it at
    ``until_step / 2``.

    Args:
        step (int): the optimizer step of the update, ``>= 0``.
        drop_fraction (float): the initial fraction, in ``[0, 1]``.
        until_step (int): the step from which the fraction is 0, ``>= 1``.

    Returns:
        float: the drop fraction for ``step``.

    Raises:
        ValueError: naming an argument out of range.
    """
    step = check_int("step", step, minimum=0)
    drop_fraction = check_real("drop_fraction", drop_fraction, low=0.0, high=1.0)
    until_step = check_int("until_step", until_step, minimum=1)
    if step >= until_step:
        return 0.0
    return drop_fraction / 2 * (1 + math.cos(math.pi * step / until_step))


@dataclass(frozen=True)
class MaskUpdateSchedule:
    """Masks move after every ``every_n_steps``-th global step (1-based) before ``until_step``;
    the fraction of each row replaced decays by a cosine from ``drop_fraction`` to 0 at
    ``until_step`` (:func:`cosine_drop_fraction`)."""

    every_n_steps: int
    drop_fraction: float
    until_step: int

    @classmethod
    def from_config(cls, block: Any) -> Optional["MaskUpdateSchedule"]:
        """The schedule of a ``mask_update`` config block, None without one.

        Raises:
            ConfigKeyError: a bad or missing key of the block (named).
        """
        parsed = parse_mask_update(block)
        return None if parsed is None else cls(**parsed)

    def due(self, step: int) -> bool:
        """Whether the masks move after global step ``step``."""
        return step % self.every_n_steps == 0 and step < self.until_step

    def drop(self, step: int) -> float:
        """The fraction of each row's entries replaced by the update after ``step``."""
        return cosine_drop_fraction(step, self.drop_fraction, self.until_step)


def mask_update_due(schedule: Optional[MaskUpdateSchedule], step: int) -> bool:
    """Whether a recipe with ``schedule`` (None: no ``mask_update``) moves masks after ``step``."""
    return schedule is not None and schedule.due(step)


@torch.no_grad()
def prune_and_regrow(
    values: torch.Tensor,
    indices: torch.Tensor,
    dense_grad: Optional[torch.Tensor],
    drop_fraction: float,
    *,
    in_features: Optional[int] = None,
    grow_candidates: Optional[torch.Tensor] = None,
    optimizer_state: Optional[Mapping[str, Any]] = None,
    generator: Optional[torch.Generator] = None,
) -> int:
    """Prune-and-regrow every row of one FFI matrix, in place.

    Args:
        values (torch.Tensor): ``(out, k)`` values; the ``nn.Parameter`` the optimizer holds.
        indices (torch.Tensor): ``(out, k)`` sorted int16/int32 column ids; updated in place.
        dense_grad (Optional[torch.Tensor]): ``(out, in)`` gradient of the logical dense matrix;
            None grows at ``grow_candidates``, or else at random absent columns.
        drop_fraction (float): fraction of each row's ``k`` entries to replace, in ``[0, 1]``.
        in_features (Optional[int]): width of the dense matrix; taken from ``dense_grad`` if given.
        grow_candidates (Optional[torch.Tensor]): ``(out, m)`` absent columns of each row, best
            first, ``m >`` the entries replaced (as :func:`record_module_grow_candidates`
            records them); the first of them are grown. Only without ``dense_grad``.
        optimizer_state (Optional[Mapping[str, Any]]): the optimizer's state of ``values``
            (``optimizer.state[values]``, e.g. AdamW's ``exp_avg`` and ``exp_avg_sq``): every
            tensor of ``values``' shape in it is moved with its entries, zero where grown.
        generator (Optional[torch.Generator]): CPU generator for random growth.

    Returns:
        int: entries replaced per row.

    Raises:
        ValueError: bad arguments, or indices that break the FFI contract after the update.
    """
    drop_fraction = check_real("drop_fraction", drop_fraction, low=0.0, high=1.0)
    if in_features is not None:
        in_features = check_int("in_features", in_features)
    if dense_grad is not None:
        if in_features is not None and in_features != dense_grad.shape[1]:
            raise ValueError(f"in_features={in_features} but dense_grad is {dense_grad.shape}")
        in_features = dense_grad.shape[1]
        if tuple(dense_grad.shape) != (values.shape[0], in_features):
            raise ValueError(
                f"dense_grad shape {tuple(dense_grad.shape)} != (out, in) = "
                f"{(values.shape[0], in_features)}"
            )
    elif in_features is None:
        raise ValueError("give in_features when dense_grad is None")
    validate_ffi(values, indices, in_features, where="mask update (before)")
    out, k = values.shape
    n = entries_replaced(drop_fraction, k, in_features)
    if n == 0:
        return 0
    device = values.device
    idx = indices.long()  # (out, k)

    # Drop: the n smallest |value| slots per row (stable sort: ties drop the lower column).
    order = torch.sort(values.abs().float(), dim=1, stable=True).indices  # (out, k)
    keep_slots = torch.sort(order[:, n:], dim=1).values  # (out, k - n) old slots kept

    # Grow: the n largest scores among columns absent before the update.
    if dense_grad is None and grow_candidates is not None:
        grown = _checked_candidates(grow_candidates, idx, n, in_features)
    elif dense_grad is None:
        with torch.device("cpu"):
            score = torch.rand(out, in_features, generator=generator).to(device)
    else:
        score = dense_grad.detach().abs().float()
    if dense_grad is not None or grow_candidates is None:
        present = torch.zeros(out, in_features, dtype=torch.bool, device=device)
        present.scatter_(1, idx, True)
        score = score.masked_fill(present, -1.0)  # scores are >= 0: absent columns rank first
        grown = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :n]  # (out, n)

    # New sorted rows; src is the old slot of each new entry, or -1 for grown entries.
    cols = torch.cat([torch.gather(idx, 1, keep_slots), grown], dim=1)  # (out, k)
    src = torch.cat([keep_slots, torch.full_like(grown, -1)], dim=1)
    cols, perm = torch.sort(cols, dim=1)
    src = torch.gather(src, 1, perm)
    is_new = src < 0
    gather_src = src.clamp(min=0)

    def moved(t: torch.Tensor) -> torch.Tensor:
        return torch.gather(t, 1, gather_src).masked_fill(is_new, 0)

    new_values = moved(values)
    for tensor in (optimizer_state or {}).values():
        if isinstance(tensor, torch.Tensor) and tensor.shape == values.shape:
            tensor.copy_(moved(tensor))
    values.copy_(new_values)
    indices.copy_(cols.to(index_dtype(in_features)))
    validate_ffi(values, indices, in_features, where="mask update")
    return n


def _checked_candidates(
    candidates: torch.Tensor, idx: torch.Tensor, n: int, in_features: int
) -> torch.Tensor:
    """The first ``n`` growth candidates of each row, checked: enough of them, in range, not
    already present and not repeated in a row."""
    out = idx.shape[0]
    if candidates.dim() != 2 or candidates.shape[0] != out or candidates.shape[1] < n:
        raise ValueError(
            f"grow_candidates {tuple(candidates.shape)} must be (out={out}, >= {n}) (mask update)"
        )
    grown = candidates[:, :n].to(device=idx.device, dtype=torch.long)
    if grown.numel() and (grown.min() < 0 or grown.max() >= in_features):
        raise ValueError(f"grow_candidates must lie in [0, {in_features}) (mask update)")
    taken = torch.zeros(out, in_features, dtype=torch.int32, device=idx.device)
    taken.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.int32))
    taken.scatter_add_(1, grown, torch.ones_like(grown, dtype=torch.int32))
    if bool((taken > 1).any()):
        raise ValueError("grow_candidates repeat a column or name a present one (mask update)")
    return grown


def entries_replaced(drop_fraction: float, k: int, in_features: int) -> int:
    """Entries of each row that an update replaces: ``round(drop_fraction * k)``, at most the
    number of absent columns."""
    return min(round(drop_fraction * k), in_features - k)


# ---- what a backward records for an update --------------------------------------------------
# State kept beside each FFILinear while recording (plain attributes: never in a state dict).
_PROBE, _WANTED, _CANDIDATES = "_mask_dense_probe", "_mask_grow_n", "_mask_grow_candidates"


def record_dense_grad(module: FFILinear, enabled: bool = True) -> None:
    """Start (or stop and free) accumulating ``module``'s dense weight gradient
    (:func:`dense_grad`).

    While enabled, every backward adds ``grad_out^T @ x`` (summed over all leading dims); the
    values receive the same gradient as on the sparse path.
    """
    setattr(module, _PROBE, None)  # made by the next forward while enabled
    _set_hook(module, _dense_product, bool(enabled))


def dense_grad(module: FFILinear) -> Optional[torch.Tensor]:
    """``(out_features, in_features)`` dense gradient recorded by :func:`record_dense_grad`, or
    None if not recorded."""
    probe = getattr(module, _PROBE, None)
    return None if probe is None else probe.grad


def record_module_grow_candidates(module: FFILinear, n: int) -> None:
    """Record, at each following backward, the ``n`` best columns to grow in every row of
    ``module`` (:func:`grow_candidates`).

    The candidates of a row are its ``n`` absent columns of largest ``|grad_out^T @ x|`` (the
    dense weight gradient of that backward, summed over tokens; ties to the lower column), best
    first. The dense gradient is computed in blocks of rows of at most 4 MiB and reduced to the
    candidates at once, so recording costs ``(out_features, n)`` indices, not a dense
    ``(out, in)`` matrix (compare :func:`record_dense_grad`). Each backward replaces the
    previous candidates: with gradient accumulation, record during the last micro-batch.
    ``n = 0`` stops and frees.

    Raises:
        ValueError: if ``n`` is negative or more than the absent columns of a row.
    """
    room = module.in_features - module.fan_in
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= room:
        raise ValueError(f"n must be an integer in [0, in_features - fan_in = {room}], got {n!r}")
    setattr(module, _WANTED, n)
    setattr(module, _CANDIDATES, None)
    _set_hook(module, _watch_gradient, n > 0)


def grow_candidates(module: FFILinear) -> Optional[torch.Tensor]:
    """``(out_features, n)`` growth candidates recorded by :func:`record_module_grow_candidates`
    at the last backward, best first, or None."""
    return getattr(module, _CANDIDATES, None)


def _set_hook(module: nn.Module, hook: Callable, installed: bool) -> None:
    """Install the forward hook ``hook`` on ``module`` once, or remove it. Found by identity
    rather than through a stored handle, so that a deep copy of the module (whose hooks are
    copied with it) switches its own hooks."""
    for key in [k for k, h in module._forward_hooks.items() if h is hook]:
        del module._forward_hooks[key]
    if installed:
        module.register_forward_hook(hook)


def _dense_product(module: FFILinear, args: tuple, y: torch.Tensor) -> torch.Tensor:
    """(:func:`record_dense_grad`'s forward hook) the output as the dense product through the
    zero leaf probe, so that ``probe.grad`` accumulates ``grad_out^T @ x`` and the values get
    their gradient through the same product."""
    x = args[0].to(module.values.dtype)
    probe = getattr(module, _PROBE, None)
    if probe is None:
        # made at the first forward, where the values are: under FSDP2 with CPU offload the
        # module's sharded values live on the CPU, the gathered ones on the accelerator
        probe = torch.zeros(module.out_features, module.in_features, dtype=module.values.dtype,
                            device=x.device, requires_grad=True)  # fmt: skip
        setattr(module, _PROBE, probe)
    weight = module.to_dense() + probe  # (out, in); probe.grad = grad_out^T x
    return nn.functional.linear(x, weight)


def _watch_gradient(module: FFILinear, args: tuple, y: torch.Tensor) -> None:
    """(:func:`record_module_grow_candidates`' forward hook) reduce the output's gradient to
    growth candidates during the backward (not while the dense gradient is recorded whole)."""
    if y.requires_grad and _dense_product not in module._forward_hooks.values():
        x_seen = args[0].to(module.values.dtype).detach()  # autograd keeps x anyway
        y.register_hook(lambda grad: _record_candidates(module, x_seen, grad))


@torch.no_grad()
def _record_candidates(module: FFILinear, x: torch.Tensor, grad: torch.Tensor) -> None:
    n = getattr(module, _WANTED)
    x2 = x.reshape(-1, module.in_features).float()  # (T, in)
    g2 = grad.reshape(-1, module.out_features).float()  # (T, out)
    idx = module.indices.long()
    rows = max(1, (1 << 20) // module.in_features)  # fp32 scores of at most 4 MiB at once
    best = torch.empty(module.out_features, n, dtype=torch.long, device=x.device)
    for r0 in range(0, module.out_features, rows):
        r1 = min(r0 + rows, module.out_features)
        score = (g2[:, r0:r1].T @ x2).abs_()  # (rows, in): |dense gradient| of these rows
        score.scatter_(1, idx[r0:r1], -1.0)  # present columns rank last
        order = torch.sort(score, dim=1, descending=True, stable=True).indices
        best[r0:r1] = order[:, :n]
    setattr(module, _CANDIDATES, best)


def record_dense_grads(model: nn.Module, enabled: bool = True) -> None:
    """Turn dense-gradient recording on (or off, freeing it) for every FFILinear in ``model``.

    Enable it before the forward/backward of the step that precedes a mask update; its cost is,
    per FFI factor, one dense ``(out, in)`` weight and its gradient plus a dense matmul.

    Raises:
        ValueError: if ``enabled`` is not a bool.
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled must be a bool, got {enabled!r}")
    for module in model.modules():
        if isinstance(module, FFILinear):
            record_dense_grad(module, enabled)


def record_grow_candidates(model: nn.Module, drop_fraction: float) -> Dict[str, int]:
    """Record, during the next backward, what an update at ``drop_fraction`` will grow, for
    every FFILinear in ``model`` (see :func:`record_module_grow_candidates`): the memory of
    a dense gradient is never held, only ``(out, n)`` candidate columns per factor.

    Returns:
        Dict[str, int]: candidates per row, by module name.

    Raises:
        ValueError: if ``drop_fraction`` is not in ``[0, 1]``.
    """
    drop_fraction = check_real("drop_fraction", drop_fraction, low=0.0, high=1.0)
    wanted = {}
    for name, module in model.named_modules():
        if isinstance(module, FFILinear):
            wanted[name] = entries_replaced(drop_fraction, module.fan_in, module.in_features)
            record_module_grow_candidates(module, wanted[name])
    return wanted


def update_masks(
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    drop_fraction: float,
    dense_grads: Optional[Dict[str, torch.Tensor]] = None,
    *,
    random_growth: bool = False,
    generator: Optional[torch.Generator] = None,
) -> Dict[str, int]:
    """Prune and regrow every FFILinear in ``model`` (see :func:`prune_and_regrow`).

    Growth follows ``dense_grads`` (keyed by module name, e.g. ``layers.0.attn.q_proj.lora_a``),
    or else each module's recorded :func:`dense_grad`, or else its recorded
    :func:`grow_candidates` (:func:`record_grow_candidates`,
    the same choice at a fraction of the memory). Recording is switched off afterwards.

    Regrown entries start at zero. An adapter whose factors are both FFI
    (``sparse_factor="both"``) would lose every value of both factors if each row of each were
    replaced whole (``drop_fraction=1.0``, or anything that rounds to the whole fan-in): its
    output and both its gradients would be zero at every later step, so it could never learn
    again. Such an update is refused with a ``ValueError`` before anything changes; with one
    dense factor, the other factor's gradient regrows the zeroed one, and it is allowed.

    Args:
        model (nn.Module): a model containing FFILinear modules.
        optimizer (Optional[torch.optim.Optimizer]): optimizer over the FFI values.
        drop_fraction (float): fraction of each row's entries to replace.
        dense_grads (Optional[Dict[str, torch.Tensor]]): ``(out, in)`` gradients by module name.
        random_growth (bool): grow at random absent columns instead (no gradient needed).
        generator (Optional[torch.Generator]): CPU generator for random growth.

    Returns:
        Dict[str, int]: entries replaced per row, by module name.

    Raises:
        ValueError: a bad argument, a module without a dense gradient (unless
            ``random_growth``), or an update that would zero both factors of an adapter.
    """
    drop_fraction = check_real("drop_fraction", drop_fraction, low=0.0, high=1.0)
    if not isinstance(random_growth, bool):
        raise ValueError(f"random_growth must be a bool, got {random_growth!r}")
    check_drop_keeps_adapters(model, drop_fraction)
    replaced = {}
    for name, module in model.named_modules():
        if not isinstance(module, FFILinear):
            continue
        grad = candidates = None
        if entries_replaced(drop_fraction, module.fan_in, module.in_features) == 0:
            replaced[name] = 0  # nothing moves in this factor: it needs no gradient
        elif not random_growth:
            grad = (dense_grads or {}).get(name, dense_grad(module))
            candidates = grow_candidates(module) if grad is None else None
            if grad is None and candidates is None:
                raise ValueError(
                    f"no dense gradient for {name!r}: call record_grow_candidates(model, ...) "
                    "or record_dense_grads(model) before the forward/backward that precedes the "
                    "mask update, or pass dense_grads"
                )
        if name not in replaced:
            replaced[name] = prune_and_regrow(
                module.values,
                module.indices,
                grad,
                drop_fraction,
                in_features=module.in_features,
                grow_candidates=candidates,
                optimizer_state=optimizer.state.get(module.values) if optimizer else None,
                generator=generator,
            )
        record_dense_grad(module, False)
        record_module_grow_candidates(module, 0)
    return replaced


def check_drop_keeps_adapters(model: nn.Module, drop_fraction: float) -> None:
    """Refuse a ``drop_fraction`` that would replace every entry of both FFI factors of an
    adapter (see :func:`update_masks`).

    Raises:
        ValueError: naming the adapter.
    """
    for name, module in model.named_modules():
        factors = (getattr(module, "lora_a", None), getattr(module, "lora_b", None))
        if isinstance(module, SparseLoRALinear) and all(isinstance(f, FFILinear) for f in factors):
            if all(
                entries_replaced(drop_fraction, f.fan_in, f.in_features) == f.fan_in
                for f in factors
            ):
                raise ValueError(
                    f"drop_fraction={drop_fraction} would replace every entry of both FFI factors "
                    f"of {name or '<root>'!r} with zeros, and an adapter whose factors are both "
                    "zero never trains again (both gradients stay 0); use a smaller drop_fraction"
                )
