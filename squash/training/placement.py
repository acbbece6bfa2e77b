"""Where and in what precision a run trains: ``device: auto`` and ``dtype: auto`` resolved on the
host that runs, each choice with the reason for it, which every recipe logs first.

``device: auto`` (or no ``device`` key, as torchtune infers it) is the GPU when torch sees one
(``torch.cuda.is_available()``, which a ROCm build answers too), else the CPU. ``dtype: auto`` is
bf16 where that device computes it natively: a GPU with bf16 (``torch.cuda.is_bf16_supported()``),
a CPU with AVX512_BF16 or AMX-BF16, read at run time from ``/proc/cpuinfo``'s flags on Linux
(``torch.cpu``'s own CPUID queries elsewhere); fp32 otherwise, since bf16 emulated in fp32
arithmetic is slower than fp32 and less precise. No ``dtype`` key stays fp32, the recipes'
default. An explicit value wins and is reported as ``(set in config)``.

The detection functions (:func:`gpu_name`, :func:`gpu_has_bf16`, :func:`cpu_bf16_features`) are
module attributes so a test can replace them; :func:`resolve` calls them only for ``auto``.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, MutableMapping, Optional, Tuple

import torch

AUTO = "auto"
DEFAULT_DTYPE = "fp32"
# /proc/cpuinfo flag -> the name the log gives it; either one means native bf16 dot products
CPU_BF16_FLAGS = (("avx512_bf16", "AVX512_BF16"), ("amx_bf16", "AMX-BF16"))
CPUINFO = Path("/proc/cpuinfo")


def gpu_name() -> Optional[str]:
    """The first GPU torch sees, as ``"CUDA GPU NAME"`` or ``"ROCm GPU NAME"``; None without one."""
    if not torch.cuda.is_available():
        return None
    kind = "ROCm" if getattr(torch.version, "hip", None) else "CUDA"
    return f"{kind} GPU {torch.cuda.get_device_name(0)}"


def gpu_has_bf16() -> bool:
    """Whether the GPU torch uses computes bf16 natively (Ampere and later, every ROCm GPU)."""
    return torch.cuda.is_bf16_supported()


def cpu_flags(cpuinfo: Path = CPUINFO) -> Optional[List[str]]:
    """The CPU's feature flags from the first ``flags`` line of ``cpuinfo`` (Linux); None where
    the file is missing or has no such line."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return value.split()
    return None


def cpu_bf16_features(cpuinfo: Path = CPUINFO) -> List[str]:
    """The CPU's native bf16 features (``["AVX512_BF16", "AMX-BF16"]``, either, or none): from
    ``cpuinfo`` on Linux, from torch's CPUID queries where there is no such file."""
    flags = cpu_flags(cpuinfo)
    if flags is not None:
        return [name for flag, name in CPU_BF16_FLAGS if flag in flags]
    found = []  # macOS, Windows: torch's own cpuinfo (private API, absent in some builds)
    if getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        found.append("AVX512_BF16")
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        found.append("AMX-BF16")
    return found


@dataclass(frozen=True)
class Placement:
    """The device and dtype a run uses, as config strings (``"cuda"``, ``"bf16"``), with why."""

    device: str
    dtype: str
    device_reason: str
    dtype_reason: str

    def line(self) -> str:
        """``device: cpu (no GPU visible); dtype: bf16 (CPU has AVX512_BF16)``."""
        return (
            f"device: {self.device} ({self.device_reason}); "
            f"dtype: {self.dtype} ({self.dtype_reason})"
        )


def resolve_device(device: Optional[str]) -> Tuple[str, str]:
    """``(device, reason)`` for a config's ``device`` value: ``auto`` or None picks the GPU
    when torch sees one, else the CPU; anything else is kept as set."""
    if device is not None and device != AUTO:
        return str(device), "set in config"
    name = gpu_name()
    return ("cuda", f"{name} visible") if name else ("cpu", "no GPU visible")


def resolve_dtype(dtype: Optional[str], device: str) -> Tuple[str, str]:
    """``(dtype, reason)`` for a config's ``dtype`` value on ``device`` (already resolved):
    ``auto`` picks bf16 where the device computes it natively, else fp32; None is the default,
    fp32; anything else is kept as set."""
    if dtype is None:
        return DEFAULT_DTYPE, "not set; the default"
    if dtype != AUTO:
        return str(dtype), "set in config"
    if torch.device(device).type == "cuda":
        return ("bf16", "GPU has bf16") if gpu_has_bf16() else ("fp32", "GPU has no bf16")
    if torch.device(device).type != "cpu":
        return "fp32", f"no bf16 detection for {device}"
    features = cpu_bf16_features()
    if features:
        return "bf16", f"CPU has {', '.join(features)}"
    names = " or ".join(name for _, name in CPU_BF16_FLAGS)
    return "fp32", f"CPU has no {names}"


def resolve(device: Optional[str], dtype: Optional[str]) -> Placement:
    """A config's ``device`` and ``dtype`` (each ``auto``, a value, or None) resolved on this
    host; the recipes log :meth:`Placement.line` and build with ``.device`` and ``.dtype``."""
    device, device_reason = resolve_device(device)
    dtype, dtype_reason = resolve_dtype(dtype, device)
    return Placement(device, dtype, device_reason, dtype_reason)


def resolve_config(cfg: MutableMapping[str, Any]) -> Placement:
    """:func:`resolve` for a recipe config's ``device`` and ``dtype``, each ``auto`` written back
    into ``cfg`` as what it resolved to, so the config the run records (its lock, each
    ``checkpoint.json``, what a resume compares, the dtype a merge rebuilds in) names what it
    used; explicit values and absent keys stay as they are."""
    picked = resolve(cfg.get("device", None), cfg.get("dtype", None))
    for key, value in (("device", picked.device), ("dtype", picked.dtype)):
        if cfg.get(key, None) == AUTO:
            cfg[key] = value
    return picked
