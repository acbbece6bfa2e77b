"""The hipified GPU device code, run on the host by a HIP runtime emulator, against the reference."""

import os
import re
import shutil
from pathlib import Path

import pytest
import torch

import squash  # noqa: F401  (registers torch.ops.squash.*)
from squash.ops import reference
from squash.sparsity import ffi_to_dense, random_ffi_indices

from ffi_inputs import bad_patterns, make_inputs
from gpu_common import (
    EMULATOR,
    HEADER,
    INDEX_CHECK,
    _assert_close_to,
    _hipify,
    _run,
)

# ================================================================================================
# 2. Emulator: the device code on the host, against the reference
# ================================================================================================
DT_NAME = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16", torch.float16: "f16"}
IT_NAME = {torch.int16: "i16", torch.int32: "i32"}


def validate_message(values, indices, in_features):
    from squash.sparsity import validate_ffi

    with pytest.raises(ValueError) as err:
        validate_ffi(values, indices, in_features)
    return str(err.value)


def _build_emulator(work: Path, sanitize: bool) -> Path:
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found")
    probe = work / "probe.cpp"
    probe.write_text("int main() { _Float16 h = 1.5f; return float(h) == 1.5f ? 0 : 1; }")
    if _run([gxx, "-std=c++20", str(probe), "-o", str(work / "probe")], work).returncode != 0:
        pytest.skip("g++ without _Float16 (GCC >= 12 on x86-64 needed for the fp16 shim)")
    (work / "hip").mkdir()
    shutil.copy(EMULATOR / "hip_runtime.h", work / "hip" / "hip_runtime.h")
    shutil.copy(EMULATOR / "hip_fp16.h", work / "hip" / "hip_fp16.h")
    (work / "src").mkdir()
    shutil.copy(EMULATOR / "driver.cu", work / "src" / "driver.cu")
    (work / "build").mkdir()
    shutil.copy(INDEX_CHECK, work / "build" / INDEX_CHECK.name)  # plain C++, as the glue reads it
    paths = _hipify([HEADER, work / "src" / "driver.cu"], work / "build")
    cmd = [gxx, "-std=c++20", "-O1", "-fno-strict-aliasing", "-DUSE_ROCM=1", f"-I{work}",
           f"-I{work / 'build'}", "-x", "c++", str(paths["driver.cu"]), "-o", str(work / "driver")]
    if sanitize:
        cmd[3:3] = ["-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
    r = _run(cmd, work)
    assert r.returncode == 0, r.stderr[-5000:]
    return work / "driver"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return _build_emulator(tmp_path_factory.mktemp("emu"), sanitize=False)


@pytest.fixture(scope="module")
def emulator_sanitized(tmp_path_factory):
    return _build_emulator(tmp_path_factory.mktemp("emu_asan"), sanitize=True)


def _save(d: Path, name: str, t: torch.Tensor) -> None:
    t = t.contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    (d / f"{name}.bin").write_bytes(t.numpy().tobytes())


def _load(d: Path, name: str, shape, dtype) -> torch.Tensor:
    raw = bytearray((d / f"{name}.bin").read_bytes())
    if dtype in (torch.bfloat16, torch.float16):
        return torch.frombuffer(raw, dtype=torch.int16).view(dtype).reshape(shape)
    return torch.frombuffer(raw, dtype=dtype).reshape(shape)


def _inputs(ntok, in_features, out_features, k, dtype, index_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    indices = random_ffi_indices(out_features, in_features, k, generator=g).to(index_dtype)
    values = torch.randn(out_features, k, generator=g).to(dtype)
    x = torch.randn(ntok, in_features, generator=g).to(dtype)
    grad_out = torch.randn(ntok, out_features, generator=g).to(dtype)
    return x, values, indices, grad_out


def _emulate(driver, d: Path, x, values, indices, grad_out, sms, env=None):
    """Forward, grad_input and grad_values on the emulator; also its log of blocks and splits."""
    for name, t in {"x": x, "values": values, "indices": indices, "g": grad_out}.items():
        _save(d, name, t)
    (ntok, in_features), (out_features, k) = x.shape, values.shape
    cmd = [str(driver), "ops", DT_NAME[x.dtype], IT_NAME[indices.dtype], str(d),
           *map(str, (ntok, in_features, out_features, k, sms))]  # fmt: skip
    r = _run(cmd, d, env=env)
    assert r.returncode == 0, r.stderr[-5000:]
    y = _load(d, "y", (ntok, out_features), x.dtype)
    gx = _load(d, "gx", (ntok, in_features), x.dtype)
    gv = _load(d, "gv", (out_features, k), x.dtype)
    return y, gx, gv, r.stderr


def _check_against_reference(x, values, indices, grad_out, y, gx, gv):
    in_features = x.shape[-1]
    for got, want in (
        (y, reference.ffi_linear(x, values, indices)),
        (gx, reference.ffi_linear_grad_input(grad_out, values, indices, in_features)),
        (gv, reference.ffi_linear_grad_values(grad_out, x, indices)),
    ):
        assert got.dtype == x.dtype and got.shape == want.shape
        _assert_close_to(got, want, x.dtype, roundings=2)  # both rounded to x.dtype
    # And the dense product in float64, independent of the reference's gather/scatter.
    w = ffi_to_dense(values.double(), indices, in_features)
    _assert_close_to(y, x.double() @ w.T, x.dtype)
    _assert_close_to(gx, grad_out.double() @ w, x.dtype)
    _assert_close_to(gv, torch.gather(grad_out.double().T @ x.double(), 1, indices.long()), x.dtype)


def _splits(log: str, kernel: str) -> list[int]:
    return [int(s) for s in re.findall(rf"{kernel}: \d+ blocks, (\d+) splits", log)]


EMU_CASES = [
    # (tokens, in, out, k, dtype, index dtype, SMs assumed); sizes off every tile and vector width
    (300, 130, 70, 13, torch.float32, torch.int16, 4),  # scalar staging/stores, split over chunks
    (513, 256, 72, 25, torch.bfloat16, torch.int16, 2),  # 16-byte vector paths, 3 token tiles
    (260, 64, 130, 1, torch.float16, torch.int32, 3),  # fan-in 1
    (7, 100, 33, 9, torch.bfloat16, torch.int16, 3),  # few tokens: the small-T forward kernel
    (300, 1000, 8, 100, torch.bfloat16, torch.int32, 64),  # few rows: many splits
]
EMU_CASES_SLOW = EMU_CASES + [
    (300, 128, 64, 13, torch.float32, torch.int32, 1),  # no splits at all
    (513, 256, 72, 25, torch.float16, torch.int32, 40),
    (260, 64, 130, 64, torch.bfloat16, torch.int16, 3),  # fan-in = in_features
    (16, 100, 33, 9, torch.float32, torch.int32, 3),  # largest small-T case
    (17, 96, 33, 9, torch.float64, torch.int32, 3),  # smallest tiled case
    (200, 96, 40, 30, torch.float64, torch.int16, 50),
]


@pytest.mark.parametrize("ntok, in_features, out_features, k, dtype, index_dtype, sms", EMU_CASES)
def test_emulated_kernels_match_reference(
    emulator, tmp_path, ntok, in_features, out_features, k, dtype, index_dtype, sms
):
    x, values, indices, grad_out = _inputs(ntok, in_features, out_features, k, dtype, index_dtype)
    y, gx, gv, _ = _emulate(emulator, tmp_path, x, values, indices, grad_out, sms)
    _check_against_reference(x, values, indices, grad_out, y, gx, gv)


def test_emulated_split_paths_are_exercised(emulator, tmp_path):
    """Few rows on many SMs: the forward splits its chunks and grad_values its tokens."""
    x, values, indices, grad_out = _inputs(600, 1000, 8, 100, torch.float32, torch.int16)
    y, gx, gv, log = _emulate(emulator, tmp_path, x, values, indices, grad_out, sms=64)
    assert _splits(log, "spmm")[0] > 1 and _splits(log, "sddmm")[0] > 1, log
    _check_against_reference(x, values, indices, grad_out, y, gx, gv)


def test_emulated_index_validation(emulator, tmp_path):
    """The validation kernel flags (1: out of range, 2: not strictly increasing) and the first
    bad flat position, on hand-made patterns."""
    good = torch.tensor([[0, 3, 7], [1, 2, 9], [4, 5, 6]], dtype=torch.int16)
    cases = [(good, 0, 2**31 - 1)]
    bad = good.clone()
    bad[1, 2] = 10  # == in_features
    cases.append((bad, 1, 5))
    bad = good.clone()
    bad[2, 0] = -1
    cases.append((bad, 1, 6))
    bad = good.clone()
    bad[1, 1] = 1  # duplicate of [1, 0]
    cases.append((bad, 2, 4))
    bad = good.clone().to(torch.int32)
    bad[0, 1] = 100000  # out of range, and [0, 2] = 7 after it is a decrease
    cases.append((bad, 3, 1))
    for idx, flags, pos in cases:
        _save(tmp_path, "indices", idx)
        r = _run([str(emulator), "validate", IT_NAME[idx.dtype], str(tmp_path), "3", "3", "10"],
                 tmp_path)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines()[0].split() == [str(flags), str(pos)], (idx, r.stdout)


@pytest.mark.parametrize("case", ["out of range", "negative", "duplicate", "unsorted"])
def test_emulated_index_errors_are_validate_ffis(emulator, tmp_path, case):
    """The GPU path's verdict and message (device validation kernel, then the glue's host-side
    wording) for the same bad patterns the reference and the CPU kernel are tested with
    (test_index_contract.py): validate_ffi's ValueError text. The dtype, shape and fan-in rules
    are checked on the host by the glue before any launch (test_gpu_kernels.py, on a GPU)."""
    x, values, indices, _ = make_inputs((4,), 40, 6, 5, index_dtype=torch.int32)
    for idx_dtype in (torch.int16, torch.int32):
        bad, in_features = bad_patterns(indices.to(idx_dtype), 40)[case]
        want = validate_message(values, bad, in_features)
        _save(tmp_path, "indices", bad)
        r = _run([str(emulator), "validate", IT_NAME[idx_dtype], str(tmp_path), "6", "5",
                  str(in_features)], tmp_path)  # fmt: skip
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert int(lines[0].split()[0]) != 0, f"{case}: the device check let it pass"
        assert lines[1] == want


@pytest.mark.slow
@pytest.mark.parametrize(
    "ntok, in_features, out_features, k, dtype, index_dtype, sms", EMU_CASES_SLOW
)
def test_emulated_kernels_sanitized(
    emulator_sanitized, tmp_path, ntok, in_features, out_features, k, dtype, index_dtype, sms
):
    """As above under AddressSanitizer and UBSan: no read outside a buffer, no misaligned vector
    access (the 16-byte paths), no undefined behaviour."""
    x, values, indices, grad_out = _inputs(ntok, in_features, out_features, k, dtype, index_dtype)
    env = {**os.environ, "ASAN_OPTIONS": "detect_stack_use_after_return=0"}
    y, gx, gv, _ = _emulate(emulator_sanitized, tmp_path, x, values, indices, grad_out, sms, env)
    _check_against_reference(x, values, indices, grad_out, y, gx, gv)


@pytest.mark.slow
@pytest.mark.parametrize("breakage", ["too_large", "negative", "unsorted", "duplicate"])
def test_emulated_kernels_stay_in_bounds_on_bad_indices(emulator_sanitized, tmp_path, breakage):
    """Indices that break the contract (normally rejected before any launch) still cause no
    out-of-bounds access, and rows that keep the contract are still right."""
    x, values, indices, grad_out = _inputs(300, 200, 70, 20, torch.bfloat16, torch.int32)
    bad_row = 7
    row = indices[bad_row].clone()
    if breakage == "too_large":
        row[3] = 100000
    elif breakage == "negative":
        row[0] = -100000
    elif breakage == "unsorted":
        row = row.flip(0)
    else:
        row[4] = row[3]
    indices[bad_row] = row
    env = {**os.environ, "ASAN_OPTIONS": "detect_stack_use_after_return=0"}
    y, _, _, _ = _emulate(emulator_sanitized, tmp_path, x, values, indices, grad_out, 4, env)
    keep = [r for r in range(70) if r != bad_row]
    want = reference.ffi_linear(x, values[keep], indices[keep])
    _assert_close_to(y[:, keep], want, torch.bfloat16, roundings=2)
