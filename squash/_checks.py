"""Argument checks shared by squash's public entry points (modules, builders, memory accounting,
mask updates). Each raises ``ValueError`` naming the argument as the caller spells it.

(The FFI format package ``squash.sparsity`` imports nothing else of squash and keeps its own
checks.)
"""

import json
import math
import struct
from numbers import Integral, Real
from pathlib import Path
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


# safetensors dtype names of the float dtypes a config.json's ``dtype``/``torch_dtype`` names.
_SAFETENSORS_FLOAT = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}


def check_safetensors_dtypes(checkpoint_dir: Path, files: Iterable[str]) -> None:
    """Refuse a ``.safetensors`` file of ``checkpoint_dir`` whose header declares a float dtype
    other than its ``config.json``'s (``dtype`` or ``torch_dtype``); ``F32`` tensors are accepted
    in any checkpoint (some keep norms in full precision). F16 data declared BF16 has the same
    size and would load as garbage; only the header and ``config.json`` are read.

    Raises:
        ValueError: naming the file, a tensor and both dtypes, or a header that is not one.
    """
    checkpoint_dir = Path(checkpoint_dir)
    try:
        config = json.loads((checkpoint_dir / "config.json").read_text())
    except (OSError, ValueError):
        return  # the checkpointer names a missing or bad config.json itself
    name = config.get("dtype", config.get("torch_dtype")) if isinstance(config, dict) else None
    want = _SAFETENSORS_FLOAT.get(str(name).replace("torch.", ""))
    if want is None:
        return
    for f in files:
        path = checkpoint_dir / f
        if path.suffix != ".safetensors" or not path.is_file():
            continue
        try:
            with open(path, "rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                if size > 100 << 20:
                    raise ValueError(f"a header of {size} bytes")
                header = json.loads(fh.read(size))
        except (OSError, ValueError, struct.error) as e:
            raise ValueError(f"{path} has no readable safetensors header ({e})") from e
        for key, info in header.items():
            dtype = info.get("dtype") if isinstance(info, dict) and key != "__metadata__" else None
            if dtype in ("F16", "BF16", "F32", "F64") and dtype not in (want, "F32"):
                raise ValueError(
                    f"{path} declares {key} as {dtype}, but {checkpoint_dir / 'config.json'} "
                    f"says {name}: the weights would be read as the wrong type; fix the file or "
                    "its config.json"
                )
