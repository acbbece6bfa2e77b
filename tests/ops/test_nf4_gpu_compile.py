"""The NF4 GPU source (kernels/nf4_cuda.cu, nf4_cuda_kernels.cuh) compiles without a GPU: nvcc
device code for sm_80 and sm_90 and the torch glue, Debian's hipcc for the hipified device code
(gfx1100), as test_gpu_compile.py checks the FFI kernels. The arithmetic is checked bit for bit on
the CPU (test_nf4_kernels.py) and, where a GPU is present, by test_nf4_gpu in this file."""

import re
import warnings

import pytest
import torch

from gpu_common import HAS_GPU, KERNELS, _hipify, _run
from test_gpu_compile import _hipcc_env, _nvcc, nvcc_glue_command

NF4_HEADER = KERNELS / "nf4_cuda_kernels.cuh"
NF4_GLUE = KERNELS / "nf4_cuda.cu"
FFI_HEADER = KERNELS / "ffi_cuda_kernels.cuh"

# Every launcher instantiated: 3 dtypes x 2 kernels (4-byte groups, single bytes).
INSTANTIATE = """#include "nf4_cuda_kernels.cuh"
using namespace squash_nf4;
template void squash_nf4::launch_nf4_dequantize<F32>(const uint8_t*, const int8_t*, const float*, const float*,
    const float*, int64_t, int64_t, int64_t, float*, cudaStream_t);
template void squash_nf4::launch_nf4_dequantize<BF16>(const uint8_t*, const int8_t*, const uint16_t*,
    const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, uint16_t*, cudaStream_t);
template void squash_nf4::launch_nf4_dequantize<F16>(const uint8_t*, const int8_t*, const uint16_t*,
    const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, uint16_t*, cudaStream_t);
"""
N_NF4_KERNELS = 6


@pytest.mark.slow
def test_nvcc_compiles_nf4_device_code_for_sm80_and_sm90(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    from torch.utils import cpp_extension

    (tmp_path / "inst.cu").write_text(INSTANTIATE)
    cmd = [nvcc, "-std=c++17", "-O3", *cpp_extension.COMMON_NVCC_FLAGS, f"-I{KERNELS}",
           "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
           "-Xptxas", "-v", "-c", "inst.cu", "-o", "inst.o"]  # fmt: skip
    r = _run(cmd, tmp_path)
    assert r.returncode == 0, r.stderr[-5000:]
    for arch in ("sm_80", "sm_90"):
        entries = [ln for ln in r.stderr.splitlines() if "nf4_dequantize_kernel" in ln
                   and "Compiling entry function" in ln and f"for '{arch}'" in ln]  # fmt: skip
        assert len(entries) == N_NF4_KERNELS, (arch, entries)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    assert len(spills) == 2 * N_NF4_KERNELS and all(s == ("0", "0") for s in spills), spills


@pytest.mark.slow
def test_nvcc_compiles_nf4_torch_glue(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    r = _run(nvcc_glue_command(nvcc, NF4_GLUE, "sm_90"), tmp_path)
    assert r.returncode == 0, r.stderr[-5000:]
    assert (tmp_path / "glue.o").stat().st_size > 0


@pytest.mark.slow
def test_hipcc_compiles_hipified_nf4_device_code(tmp_path):
    hipcc, env = _hipcc_env()
    from torch.utils import cpp_extension

    from test_gpu_compile import _amd_kernel_resources

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "inst_nf4.cu").write_text(INSTANTIATE)
    work = tmp_path / "hip"
    work.mkdir()
    paths = _hipify([FFI_HEADER, NF4_HEADER, tmp_path / "src" / "inst_nf4.cu"], work)
    assert "hipLaunchKernelGGL" in paths["nf4_cuda_kernels.cuh"].read_text()
    hip_src = paths["inst_nf4.cu"]
    flags = [*cpp_extension.COMMON_HIP_FLAGS, *cpp_extension.COMMON_HIPCC_FLAGS, "-std=c++17",
             "-O3", "-fno-gpu-rdc"]  # fmt: skip
    # gfx1030 (RDNA2): linked object, and ISA without scratch (the device library is there).
    r = _run([hipcc, *flags, "--offload-arch=gfx1030", "-c", str(hip_src), "-o", "gfx1030.o"],
             work, env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-5000:]
    r = _run([hipcc, *flags, "--offload-arch=gfx1030", "--cuda-device-only", "-S", str(hip_src),
              "-o", "gfx1030.s"], work, env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-5000:]
    res = _amd_kernel_resources((work / "gfx1030.s").read_text())
    nf4 = {n: v for n, v in res.items() if "nf4_dequantize_kernel" in n}
    assert len(nf4) == N_NF4_KERNELS and all(scratch == 0 for _, scratch in nf4.values()), nf4
    # gfx1100 (RDNA3, the W7900): linked where the device library knows it, else ISA only (calls
    # into the library stay unresolved there, so no scratch figure is meaningful).
    r = _run([hipcc, *flags, "--offload-arch=gfx1100", "-c", str(hip_src), "-o", "gfx1100.o"],
             work, env)  # fmt: skip
    if r.returncode != 0:
        assert "cannot find ROCm device library" in r.stderr, r.stderr[-5000:]
        warnings.warn("hipcc has no gfx1100 device library: checked gfx1100 ISA generation only")
        r = _run([hipcc, *flags, "--offload-arch=gfx1100", "-nogpulib", "--cuda-device-only",
                  "-S", str(hip_src), "-o", "gfx1100.s"], work, env)  # fmt: skip
        assert r.returncode == 0, r.stderr[-5000:]
        asm = (work / "gfx1100.s").read_text()
        assert '.amdgcn_target "amdgcn-amd-amdhsa--gfx1100"' in asm
        names = [n for n in _amd_kernel_resources(asm) if "nf4_dequantize_kernel" in n]
        assert len(names) == N_NF4_KERNELS


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA/ROCm device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape, block, scaler_block",
                         [((1024, 1024), 64, 256), ((576, 576), 64, 64), ((6, 4), 6, 4)])
def test_nf4_gpu_equals_torchao_bit_for_bit(shape, block, scaler_block, dtype):
    from torchao.dtypes.nf4tensor import to_nf4

    from squash.nf4 import nf4_dequantize

    w = to_nf4((torch.randn(shape) * 0.02).to(dtype).cuda(), block, scaler_block)
    want = w.get_original_weight()
    got = nf4_dequantize(w)
    view = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(view), want.view(view))
    assert torch._C._dispatch_has_kernel_for_dispatch_key("squash::nf4_dequantize", "CUDA")
