"""Find, JIT-compile and load the FFI kernels in ``kernels/`` on first use.

Each device type (``"cpu"``, ``"cuda"``) has one source file that registers native kernels for the
``squash`` ops under its dispatch key (``TORCH_LIBRARY_IMPL(squash, CPU|CUDA, m)``). Loading is
tried once per process and device type; on failure squash warns once and the pure-PyTorch
reference serves that device.

Environment (each read once per process, at the first FFI call or ``status()``; changing it later
has no effect, because a loaded kernel stays registered with the dispatcher):

- ``SQUASH_KERNELS``: ``native`` (default) or ``reference`` (never load a kernel).
- ``SQUASH_CPU_ISA``: the CPU build's target. ``native`` (default): ``-march=native``, the widest
  vectors this CPU has. ``avx512``, ``avx2``, ``generic`` (x86-64; ``generic`` means 16-byte SSE
  vectors) or ``neon`` (aarch64) build that variant instead, a narrower one on a wider host, each
  in its own cache folder; asking for an ISA this CPU lacks raises ``ValueError``.
- ``SQUASH_NF4``: ``native`` (default) or ``torchao``: whether squash's adapted linears run their
  NF4 base through :func:`squash.nf4.nf4_linear` (squash's dequantize kernel) or torchao's
  ``linear_nf4`` (the results are equal bit for bit).
- ``SQUASH_BUILD_TIMEOUT``: seconds to wait for another process building the same kernel (default
  1200); then squash warns and the reference serves. A build killed midway leaves PyTorch's
  ``lock`` file behind: squash builds under its own ``flock`` (which the kernel drops when its
  owner dies), so holding that, it knows such a ``lock`` is stale and removes it.
"""

import ctypes
import hashlib
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Optional

try:
    import fcntl
except ImportError:  # not POSIX: no build lock, PyTorch's own baton only
    fcntl = None

_SOURCES = {"cpu": ["ffi_cpu.cpp", "nf4_cpu.cpp"], "cuda": ["ffi_cuda.cu", "nf4_cuda.cu"]}
_SOURCE_SUFFIXES = {".cpp", ".h", ".cu", ".cuh"}
_state: dict[str, Optional[str]] = {}  # device type -> None (loaded) or the failure message
_built: dict[str, dict[str, str]] = {}  # device type -> what the loaded build reports
_env: dict[str, str] = {}  # variables read once per process
_lock = threading.Lock()

# x86-64 variants: flags added to -march=native, and the /proc/cpuinfo flags each needs.
_X86_ISAS = {
    "avx512": ([], {"avx512f", "avx2", "fma", "f16c"}),
    "avx2": (["-mno-avx512f"], {"avx2", "fma", "f16c"}),
    "generic": (["-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c", "-mno-avx"], set()),
}
_ARM_ISAS = {"neon": ([], set())}
# What a first build takes, said while it runs (measured: the CPU kernel 60-95 s on 2 cores of an
# AVX-512 host; the GPU kernel, several template instantiations, some minutes).
BUILD_ESTIMATE = {"cpu": "about 1-2 minutes on 2 CPU cores", "cuda": "a few minutes"}


def kernels_dir() -> Path:
    """Directory holding the kernel sources: ``squash/_kernels`` in an installed package,
    ``kernels/`` beside the package in a checkout (an editable install). A folder counts only
    if it holds every source squash compiles: in an installed package ``kernels/`` beside
    ``squash`` is site-packages' own (PyPI's ``kernels`` package, which transformers brings)."""
    here = Path(__file__).resolve().parent
    names = [name for files in _SOURCES.values() for name in files]
    for candidate in (here.parent / "_kernels", here.parents[1] / "kernels"):
        if all((candidate / name).is_file() for name in names):
            return candidate
    raise FileNotFoundError(f"squash kernel sources ({', '.join(names)}) not found near {here}")


def _read_env(name: str, default: str) -> str:
    if name not in _env:
        _env[name] = os.environ.get(name, default).strip().lower()
    return _env[name]


def mode() -> str:
    """``"native"`` (default) or ``"reference"``, from ``SQUASH_KERNELS`` (read once)."""
    value = _read_env("SQUASH_KERNELS", "native")
    if value not in ("native", "reference"):
        raise ValueError(f"SQUASH_KERNELS must be 'native' or 'reference', got {value!r}")
    return value


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def host_cpu_isas() -> list[str]:
    """The CPU variants this host can run, widest first (``native`` builds the first)."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        return ["neon"]
    flags = _cpu_flags()
    return [isa for isa, (_, need) in _X86_ISAS.items() if need <= flags]


def cpu_isa() -> str:
    """The CPU variant to build, from ``SQUASH_CPU_ISA`` (read once): ``native`` resolves to the
    widest this host runs.

    Raises:
        ValueError: an unknown name, or an ISA this CPU cannot run.
    """
    value = _read_env("SQUASH_CPU_ISA", "native")
    runnable = host_cpu_isas()
    if value == "native":
        return runnable[0]
    known = sorted({*_X86_ISAS, *_ARM_ISAS})
    if value not in known:
        raise ValueError(f"SQUASH_CPU_ISA must be 'native' or one of {known}, got {value!r}")
    if value not in runnable:
        raise ValueError(f"SQUASH_CPU_ISA={value!r}: this CPU runs only {runnable}")
    return value


def build_flags(device_type: str, isa: Optional[str] = None) -> dict:
    """Compiler flags for ``torch.utils.cpp_extension.load`` for one device type (and CPU ISA)."""
    if device_type == "cpu":
        extra = {**_X86_ISAS, **_ARM_ISAS}[isa or cpu_isa()][0]
        return {
            # No -std: cpp_extension passes the standard this torch's headers need.
            "extra_cflags": ["-O3", "-march=native", *extra, "-fopenmp"],
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


def extension_name(device_type: str) -> str:
    """The build's name, and so its cache folder: the CPU's tag and ISA variant are part of it,
    and the sources' content hash, so that processes running different versions of squash (two
    checkouts, an upgrade) never rebuild, or load mid-rebuild, one another's build."""
    digest = _source_digest()[:8]
    if device_type == "cpu":
        return f"squash_ffi_cpu_{cpu_isa()}_{_cpu_tag()}_{digest}"
    return f"squash_ffi_{device_type}_{digest}"


def _build_root() -> Path:
    from torch.utils import cpp_extension

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())


def _source_digest() -> str:
    """SHA-1 of the kernel sources' names and contents."""
    files = sorted(p for p in kernels_dir().iterdir() if p.suffix in _SOURCE_SUFFIXES)
    return hashlib.sha1(b"".join(p.name.encode() + p.read_bytes() for p in files)).hexdigest()


def stage_sources() -> Path:
    """Copy the kernel sources into the build cache, in a folder named by their content hash.

    Builds read the copy, so nothing is ever written into the package (on ROCm, hipify writes its
    output beside its input), and an installed package may be read-only.
    """
    src = kernels_dir()
    files = sorted(p for p in src.iterdir() if p.suffix in _SOURCE_SUFFIXES)
    digest = _source_digest()
    staged = _build_root() / "squash_sources" / digest[:16]
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


def build_timeout() -> float:
    """Seconds to wait for another process's build of the same kernel (``SQUASH_BUILD_TIMEOUT``)."""
    value = _read_env("SQUASH_BUILD_TIMEOUT", "1200")
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"SQUASH_BUILD_TIMEOUT must be a number of seconds, got {value!r}")


class _BuildLock:
    """An exclusive ``flock`` on ``<build dir>/.squash-build.flock``, waited for at most
    ``timeout`` seconds (``TimeoutError``). The kernel releases it when its holder dies, so while
    it is held no other squash process is building here: a PyTorch ``lock`` file found then was
    left by a build that was killed, and is removed."""

    def __init__(self, build_dir: Path, timeout: float):
        self.build_dir, self.timeout, self.file = build_dir, timeout, None

    def __enter__(self):
        if fcntl is None:
            return self
        self.build_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(self.build_dir / ".squash-build.flock", "a")
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    self.file.close()
                    raise TimeoutError(
                        f"another process has been building {self.build_dir} for more than "
                        f"{self.timeout:.0f} s (SQUASH_BUILD_TIMEOUT)"
                    ) from None
                time.sleep(0.1)
        stale = self.build_dir / "lock"
        if stale.exists():
            warnings.warn(f"squash: removing a stale build lock left by a killed build: {stale}")
            stale.unlink(missing_ok=True)
        return self

    def __exit__(self, *exc):
        if self.file is not None:
            self.file.close()  # releases the flock


def build_needed(build_dir: Path, sources: list) -> bool:
    """Whether loading will compile: no library in ``build_dir`` yet, or one built from other
    sources (ninja rebuilds when ``build.ninja`` names other files or a source is newer)."""
    lib, ninja = build_dir / f"{build_dir.name}.so", build_dir / "build.ninja"
    if not lib.is_file() or not ninja.is_file():
        return True
    text = ninja.read_text(errors="replace")
    built = lib.stat().st_mtime
    return any(s not in text or os.path.getmtime(s) > built for s in sources)


def _compile(device_type: str) -> None:
    from torch.utils import cpp_extension

    src = stage_sources()
    sources = [str(src / name) for name in _SOURCES[device_type]]
    name = extension_name(device_type)
    flags = build_flags(device_type)
    build_dir = _build_root() / name
    compiling = build_needed(build_dir, sources)
    if compiling:  # a silent first step of a minute or more reads as a hang
        print(
            f"squash: compiling the {device_type} FFI kernels on first use "
            f"({BUILD_ESTIMATE.get(device_type, 'some minutes')}; once, then cached in "
            f"{build_dir}) ...",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    start = time.monotonic()
    with _BuildLock(build_dir, build_timeout()):
        path = cpp_extension.load(
            name=name,
            sources=sources,
            extra_include_paths=[str(src)],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=os.environ.get("SQUASH_VERBOSE_BUILD", "0") == "1",
            **flags,
        )
    if compiling:
        print(
            f"squash: {device_type} FFI kernels ready after {time.monotonic() - start:.0f} s",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    info = {"build": str(build_dir)}
    if device_type == "cpu" and isinstance(path, str):
        info["library"] = path
        lib = ctypes.CDLL(path)
        lib.squash_ffi_cpu_isa.restype = ctypes.c_char_p
        info["isa"] = lib.squash_ffi_cpu_isa().decode()
        info["vector_bytes"] = str(lib.squash_ffi_cpu_vector_bytes())
    _built[device_type] = info


def cpu_library() -> Optional[ctypes.CDLL]:
    """The loaded CPU build as a ``ctypes`` library (for its C entry points, e.g. the phase
    timers benchmarks/ffi_kernels.py reads), or None when no native CPU kernel is loaded."""
    if not ensure_loaded("cpu") or "library" not in _built.get("cpu", {}):
        return None
    return ctypes.CDLL(_built["cpu"]["library"])


def ensure_loaded(device_type: str) -> bool:
    """Load the native kernels for ``device_type`` once; True when they serve that device."""
    if device_type not in _SOURCES or mode() == "reference":
        return False
    with _lock:
        if device_type not in _state:
            try:
                _compile(device_type)
                _state[device_type] = None
            except Exception as err:  # no compiler, no CUDA toolkit, a build error, a timeout...
                _state[device_type] = f"{type(err).__name__}: {err}"
                warnings.warn(
                    f"squash: could not build the {device_type} FFI kernels, using the slower "
                    f"pure-PyTorch reference instead. Reason: {_state[device_type][:2000]}",
                    stacklevel=3,
                )
    return _state[device_type] is None


def _device_name(device_type: str) -> str:
    if device_type == "cpu":
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        return line.split(":", 1)[1].strip()
        except OSError:
            pass
        return platform.processor() or platform.machine()
    import torch

    if not torch.cuda.is_available():
        return "none"
    return torch.cuda.get_device_name()


def status() -> dict[str, dict[str, str]]:
    """What serves each device type, as the ops will run it now.

    Returns:
        dict[str, dict[str, str]]: for ``"cpu"`` and ``"cuda"``: ``backend`` (``"native"``,
        ``"reference"``, or ``"not loaded"`` before the first call on that device, which loads the
        native kernel unless ``SQUASH_KERNELS=reference``), ``device`` (CPU model or GPU name),
        ``isa`` (CPU: the vector ISA the build targets, or would target) or ``arch`` (GPU),
        ``build`` (the build folder, once built) and ``reason`` (why the reference serves).
    """
    import torch

    out = {}
    for device_type in _SOURCES:
        info = {"device": _device_name(device_type)}
        if mode() == "reference":
            info.update(backend="reference", reason="SQUASH_KERNELS=reference")
        elif device_type not in _state:
            info["backend"] = "not loaded"
        elif _state[device_type] is None:
            info["backend"] = "native"
        else:
            info.update(backend="reference", reason=_state[device_type])
        if device_type == "cpu":
            built = _built.get("cpu", {})
            info["isa"] = built.get("isa") or cpu_isa()
            if "vector_bytes" in built:
                info["vector_bytes"] = built["vector_bytes"]
        elif torch.cuda.is_available():
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            info["arch"] = getattr(props, "gcnArchName", None) or f"sm_{props.major}{props.minor}"
        if device_type in _built:
            info["build"] = _built[device_type]["build"]
        out[device_type] = info
    return out
