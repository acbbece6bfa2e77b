"""GPU kernels of the FFI ops: ``kernels/ffi_cuda.cu`` (torch glue) and
``kernels/ffi_cuda_kernels.cuh`` (device code and launchers). docs/gpu.md explains the checks.

Three layers, so that most of it runs on a machine without a GPU:

1. Compile checks (``slow``; skipped with the reason when the compiler is missing):
   nvcc builds the device code for sm_80 and sm_90 and the torch glue against this torch's
   headers; Debian's hipcc builds the hipified device code for gfx1030 (object) and gfx1100.
2. Emulator: the hipified device code, compiled for the host by g++ against a small HIP runtime
   shim (at the end of this file) in which each block's threads are fibers with real barrier and
   shuffle semantics. A driver runs the kernels in the steps of the glue; results are compared
   with ``squash.ops.reference`` and the dense product.
3. GPU tests (``gpu``; skipped without CUDA/ROCm): the real ops through the loader.
"""

# Shared by test_gpu_compile.py, test_gpu_emulated.py and test_gpu_kernels.py.

import shutil
import subprocess
from pathlib import Path

import torch

import squash  # noqa: F401  (registers torch.ops.squash.*)

from ffi_inputs import assert_close

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
HEADER = KERNELS / "ffi_cuda_kernels.cuh"
INDEX_CHECK = KERNELS / "ffi_index_check.h"
GLUE = KERNELS / "ffi_cuda.cu"
# The emulator (host HIP runtime shim, driver) and the all-instantiations TU for nvcc.
EMULATOR = Path(__file__).resolve().parent / "gpu_emulator"
HAS_GPU = torch.cuda.is_available()

# Every launcher instantiated for every dtype and index dtype: 32 kernels in all
# (validate 2, pack 8, chunk_ptr 2, spmm 4, sddmm 8, small_tokens 8).
N_KERNELS = 32


def _run(cmd, cwd, env=None, timeout=900):
    return subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def _hipify(src_files, work: Path) -> dict:
    """Copy files into ``work`` and hipify them as cpp_extension does on ROCm; new paths by name."""
    from torch.utils.hipify import hipify_python

    for f in src_files:
        shutil.copy(f, work / Path(f).name)
    extra = [str(work / Path(f).name) for f in src_files if str(f).endswith(".cu")]
    result = hipify_python.hipify(
        project_directory=str(work),
        output_directory=str(work),
        header_include_dirs=[str(work)],
        extra_files=extra,
        is_pytorch_extension=True,
        hipify_extra_files_only=True,
        show_progress=False,
    )
    return {Path(k).name: Path(v.hipified_path) for k, v in result.items() if v.hipified_path}


def _assert_close_to(got, want, dtype, roundings=1):
    """Per element, within ``roundings`` roundings of ``dtype`` plus fp32 accumulation (1 against
    an exact float64 value, 2 against another rounded result): see ffi_inputs.py."""
    assert_close(got, want, dtype, roundings)
