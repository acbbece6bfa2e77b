"""Argument checks shared by squash's public entry points (modules, builders, memory accounting,
mask updates). Each raises ``ValueError`` naming the argument as the caller spells it.

(The FFI format package ``squash.sparsity`` imports nothing else of squash and keeps its own
checks.)
"""

import math
from numbers import Integral, Real
from typing import Any, Iterable, Optional

# The sparse_factor choices, and which of (lora_a, lora_b) is FFI for each.
SPARSE_FACTORS = {"a": (True, False), "b": (False, True), "both": (True, True)}
INITS = ("lora", "svd")


def check_int(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` as an int ``>= minimum`` (bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_real(
    name: str,
    value: Any,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    high_inclusive: bool = True,
) -> float:
    """``value`` as a finite float in ``[low, high]`` (or ``[low, high)``)."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    inside = low <= value <= high if high_inclusive else low <= value < high
    if not inside:
        bracket = "]" if high_inclusive else ")"
        raise ValueError(f"{name} must be in [{low}, {high}{bracket}, got {value!r}")
    return float(value)


def check_sparsity(name: str, value: Any, allow_none: bool = False) -> Optional[float]:
    """A sparsity: a fraction of zeros in ``[0, 1)`` (or None where that means dense)."""
    if value is None and allow_none:
        return None
    return check_real(name, value, low=0.0, high=1.0, high_inclusive=False)


def check_choice(name: str, value: Any, choices: Iterable[str]) -> str:
    """``value`` is one of ``choices`` (compared exactly: ``"A"`` is not ``"a"``)."""
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value
