"""The CPU kernel's ISA variants: each one this host can run, built apart (SQUASH_CPU_ISA, its own
cache folder) and compared with the float64 dense product and the reference; and a compile of the
kernel for aarch64 (NEON, 16-byte vectors) with Debian's cross compiler.

The default build (``native``: the widest vectors this CPU has) is what the rest of the suite
tests in-process. A process loads one variant (all register the same dispatch keys), so each
narrower one runs in a subprocess of its own.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from squash.ops import _loader

HERE = Path(__file__).resolve().parent
NARROWER = _loader.host_cpu_isas()[1:]

_CHECK = r"""
import json, sys
import torch, squash
from squash.ops import reference
sys.path.insert(0, sys.argv[1])
from ffi_inputs import assert_close, dense_ops, make_inputs, run_ops
shapes = [((1,), 64, 16, 7), ((13,), 100, 24, 10), ((3, 47), 257, 70, 26), ((300,), 96, 65, 96),
          ((150,), 300, 140, 120), ((20,), 1000, 63, 500)]
for threads in (1, 2):
    torch.set_num_threads(threads)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for lead, i, o, k in shapes:
            x, v, idx, g = make_inputs(lead, i, o, k, dtype)
            got = run_ops(x, v, idx, g)
            refs = (reference.ffi_linear(x, v, idx), reference.ffi_linear_grad_input(g, v, idx, i),
                    reference.ffi_linear_grad_values(g, x, idx))
            for r, want, ref in zip(got, dense_ops(x, v, idx, g), refs):
                assert_close(r, want, dtype)
                assert_close(r, ref, dtype, roundings=2)
# The NF4 dequantize kernel of this variant: torchao's get_original_weight() bit for bit.
from torchao.dtypes.nf4tensor import to_nf4
for dtype, view in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16),
                    (torch.float16, torch.int16)):
    for shape, block, scaler_block in (((256, 64), 64, 256), ((576, 576), 64, 64),
                                       ((10, 36), 10, 12), ((2, 1000), 250, 8)):
        w = to_nf4((torch.randn(shape) * 0.02).to(dtype), block, scaler_block)
        got = squash.nf4.nf4_dequantize(w)
        assert torch.equal(got.view(view), w.get_original_weight().view(view)), (dtype, shape)
print(json.dumps(squash.ops.status()["cpu"]))
"""


@pytest.mark.skipif(os.environ.get("SQUASH_KERNELS") == "reference", reason="SQUASH_KERNELS=reference")
@pytest.mark.parametrize("isa", NARROWER or [pytest.param("-", marks=pytest.mark.skip(
    reason="this CPU runs one variant only"))])  # fmt: skip
@pytest.mark.slow
def test_narrower_variant_matches_dense_and_reference(isa):
    env = {**os.environ, "SQUASH_CPU_ISA": isa}
    r = subprocess.run([sys.executable, "-c", _CHECK, str(HERE)], env=env, capture_output=True,
                       text=True, timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stderr[-5000:]
    st = json.loads(r.stdout.strip().splitlines()[-1])
    assert st["backend"] == "native" and st["isa"] == isa
    assert int(st["vector_bytes"]) == {"avx2": 32, "generic": 16}[isa]
    assert Path(st["build"]).name.startswith(f"squash_ffi_cpu_{isa}_")


def test_unknown_or_unrunnable_isa_is_refused(monkeypatch):
    monkeypatch.setattr(_loader, "_env", {})
    monkeypatch.setenv("SQUASH_CPU_ISA", "avx1024")
    with pytest.raises(ValueError, match="SQUASH_CPU_ISA must be 'native' or one of"):
        _loader.cpu_isa()
    other = "neon" if "neon" not in _loader.host_cpu_isas() else "avx2"
    monkeypatch.setattr(_loader, "_env", {})
    monkeypatch.setenv("SQUASH_CPU_ISA", other)
    with pytest.raises(ValueError, match="this CPU runs only"):
        _loader.cpu_isa()


CROSS = shutil.which("aarch64-linux-gnu-g++")


@pytest.mark.slow
@pytest.mark.skipif(CROSS is None, reason="aarch64-linux-gnu-g++ not found (Debian: apt-get "
                    "install g++-aarch64-linux-gnu; .ci/run installs it)")  # fmt: skip
def test_cpu_kernel_compiles_for_aarch64(tmp_path):
    """The CPU kernels (FFI and NF4, with their NEON code) compile for aarch64 against this torch's
    headers, to an aarch64 object that reports the NEON ISA."""
    from torch.utils import cpp_extension

    objs = {}
    for source in _loader._SOURCES["cpu"]:  # the FFI kernels and the NF4 dequantize kernel
        obj = objs[source] = tmp_path / Path(source).with_suffix(".o").name
        cmd = [CROSS, "-std=c++20", "-O2", "-march=armv8-a", "-fPIC", "-fopenmp",
               *[f"-I{p}" for p in cpp_extension.include_paths()], f"-I{_loader.kernels_dir()}",
               "-c", str(_loader.kernels_dir() / source), "-o", str(obj)]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        assert r.returncode == 0, r.stderr[-5000:]
        head = obj.read_bytes()[:20]
        assert head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == 183
    data = objs["ffi_cpu.cpp"].read_bytes()
    assert data[:4] == b"\x7fELF" and int.from_bytes(data[18:20], "little") == 183  # EM_AARCH64
    assert b"\x00neon\x00" in data
