"""Find, JIT-compile and load the FFI kernels in ``kernels/`` on first use.

Each device type (``"cpu"``, ``"cuda"``) has one source file that registers native kernels for the
``squash`` ops under its dispatch key (``TORCH_LIBRARY_IMPL(squash, CPU|CUDA, m)``). Loading is
tried once per process and device type; on failure squash warns once and the pure-PyTorch
reference serves that device. ``SQUASH_KERNELS=reference`` skips loading altogether.
"""

import hashlib
import os
import platform
import shutil
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Optional

_SOURCES = {"cpu": ["ffi_cpu.cpp"], "cuda": ["ffi_cuda.cu"]}
_SOURCE_SUFFIXES = {".cpp", ".h", ".cu", ".cuh"}
_state: dict[str, Optional[str]] = {}  # device type -> None (loaded) or the failure message
_lock = threading.Lock()


def kernels_dir() -> Path:
    """Directory holding the kernel sources (``kernels/`` beside the package, or inside it)."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parents[1] / "kernels", here.parent / "_kernels"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"squash kernel sources not found near {here}")


def mode() -> str:
    """``"native"`` (default) or ``"reference"``, from ``SQUASH_KERNELS``."""
    value = os.environ.get("SQUASH_KERNELS", "native").strip().lower()
    if value not in ("native", "reference"):
        raise ValueError(f"SQUASH_KERNELS must be 'native' or 'reference', got {value!r}")
    return value


def build_flags(device_type: str) -> dict:
    """Compiler flags for ``torch.utils.cpp_extension.load`` for one device type."""
    if device_type == "cpu":
        return {
            # No -std: cpp_extension passes the standard this torch's headers need.
            "extra_cflags": ["-O3", "-march=native", "-fopenmp"],
            "extra_ldflags": ["-fopenmp"],
        }
    # No -std: cpp_extension picks the standard this torch's headers need (C++20 from torch 2.10,
    # C++17 before). No fast math: it would flush fp32 denormals, and the kernels gain nothing
    # from it (FMA contraction is on by default with nvcc and hip-clang).
    return {"extra_cflags": ["-O3"], "extra_cuda_cflags": ["-O3"]}


def _cpu_tag() -> str:
    """A short hash of this CPU's model and feature flags: CPU builds use ``-march=native``, so a
    build cache shared by different machines must not hand one CPU's build to another."""
    ident = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            ident += "".join(sorted({ln for ln in f if ln.startswith(("model name", "flags"))}))
    except OSError:
        pass
    return hashlib.sha1(ident.encode()).hexdigest()[:8]


def stage_sources() -> Path:
    """Copy the kernel sources into the build cache, in a folder named by their content hash.

    Builds read the copy, so nothing is ever written into the package (on ROCm, hipify writes its
    output beside its input), and an installed package may be read-only.
    """
    from torch.utils import cpp_extension

    src = kernels_dir()
    files = sorted(p for p in src.iterdir() if p.suffix in _SOURCE_SUFFIXES)
    digest = hashlib.sha1(b"".join(p.name.encode() + p.read_bytes() for p in files)).hexdigest()
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    staged = root / "squash_sources" / digest[:16]
    if not staged.is_dir():
        staged.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=staged.parent, prefix=".staging-"))
        for p in files:
            shutil.copy2(p, tmp / p.name)
        try:
            os.replace(tmp, staged)  # atomic; another process may have staged it first
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return staged


def _compile(device_type: str) -> None:
    from torch.utils import cpp_extension

    src = stage_sources()
    sources = [str(src / name) for name in _SOURCES[device_type]]
    tag = f"_{_cpu_tag()}" if device_type == "cpu" else ""
    cpp_extension.load(
        name=f"squash_ffi_{device_type}{tag}",
        sources=sources,
        extra_include_paths=[str(src)],
        is_python_module=False,
        verbose=os.environ.get("SQUASH_VERBOSE_BUILD", "0") == "1",
        **build_flags(device_type),
    )


def ensure_loaded(device_type: str) -> bool:
    """Load the native kernels for ``device_type`` once; True when they serve that device."""
    if device_type not in _SOURCES or mode() == "reference":
        return False
    with _lock:
        if device_type not in _state:
            try:
                _compile(device_type)
                _state[device_type] = None
            except Exception as err:  # no compiler, no CUDA toolkit, a build error, ...
                _state[device_type] = f"{type(err).__name__}: {err}"
                warnings.warn(
                    f"squash: could not build the {device_type} FFI kernels, using the slower "
                    f"pure-PyTorch reference instead. Reason: {_state[device_type][:2000]}",
                    stacklevel=3,
                )
    return _state[device_type] is None


def status() -> dict[str, str]:
    """What serves each device type so far: ``"native"``, ``"reference"`` or ``"not loaded"``."""
    out = {}
    for device_type in _SOURCES:
        if mode() == "reference":
            out[device_type] = "reference"
        elif device_type not in _state:
            out[device_type] = "not loaded"
        else:
            out[device_type] = "native" if _state[device_type] is None else "reference"
    return out
