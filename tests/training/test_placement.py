"""``device: auto`` and ``dtype: auto``: each branch with the host's capabilities replaced, the
explicit values, the line the recipes log, what is written back into a config, and the real
answer on this host against its /proc/cpuinfo read here, independently."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from squash.training import placement

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9654 96-Core Processor
flags\t\t: fpu vme {extra} avx2 avx512f avx512bw
bugs\t\t: sysret_ss_attrs
processor\t: 1
flags\t\t: fpu
"""


def host(monkeypatch, gpu=None, gpu_bf16=True, cpu=()):
    """Replace the capability detection: ``gpu`` a name or None, the CPU's bf16 features."""
    monkeypatch.setattr(placement, "gpu_name", lambda: gpu)
    monkeypatch.setattr(placement, "gpu_has_bf16", lambda: gpu_bf16)
    monkeypatch.setattr(placement, "cpu_bf16_features", lambda: list(cpu))


@pytest.mark.parametrize("gpu, gpu_bf16, cpu, line", [
    ("CUDA GPU NVIDIA H100", True, (),
     "device: cuda (CUDA GPU NVIDIA H100 visible); dtype: bf16 (GPU has bf16)"),
    ("ROCm GPU AMD Radeon PRO W7900", True, ["AVX512_BF16"],
     "device: cuda (ROCm GPU AMD Radeon PRO W7900 visible); dtype: bf16 (GPU has bf16)"),
    ("CUDA GPU Tesla T4", False, ["AVX512_BF16"],
     "device: cuda (CUDA GPU Tesla T4 visible); dtype: fp32 (GPU has no bf16)"),
    (None, True, ["AVX512_BF16"], "device: cpu (no GPU visible); dtype: bf16 (CPU has AVX512_BF16)"),
    (None, True, ["AMX-BF16"], "device: cpu (no GPU visible); dtype: bf16 (CPU has AMX-BF16)"),
    (None, True, ["AVX512_BF16", "AMX-BF16"],
     "device: cpu (no GPU visible); dtype: bf16 (CPU has AVX512_BF16, AMX-BF16)"),
    (None, True, [],
     "device: cpu (no GPU visible); dtype: fp32 (CPU has no AVX512_BF16 or AMX-BF16)"),
])  # fmt: skip
def test_auto_picks_the_gpu_then_bf16_where_native(monkeypatch, gpu, gpu_bf16, cpu, line):
    host(monkeypatch, gpu, gpu_bf16, cpu)
    picked = placement.resolve("auto", "auto")
    assert picked.line() == line
    assert picked.device == line.split()[1]
    assert picked.dtype == line.split("dtype: ")[1].split()[0]
    # torchtune takes the picked strings as they are
    assert torch.device(picked.device).type == picked.device


def test_an_explicit_value_wins_and_says_so(monkeypatch):
    host(monkeypatch, gpu="CUDA GPU NVIDIA H100", cpu=["AMX-BF16"])
    assert placement.resolve("cpu", "fp32").line() == (
        "device: cpu (set in config); dtype: fp32 (set in config)"
    )
    # an explicit device, dtype auto: the rule of the device given, not of the GPU seen
    assert placement.resolve("cpu", "auto").line() == (
        "device: cpu (set in config); dtype: bf16 (CPU has AMX-BF16)"
    )
    host(monkeypatch, gpu=None, cpu=[])
    assert placement.resolve("auto", "bf16").line() == (
        "device: cpu (no GPU visible); dtype: bf16 (set in config)"
    )
    assert placement.resolve("cuda:1", "auto").line() == (
        "device: cuda:1 (set in config); dtype: bf16 (GPU has bf16)"
    )
    assert placement.resolve("xpu", "auto").line() == (
        "device: xpu (set in config); dtype: fp32 (no bf16 detection for xpu)"
    )


def test_absent_keys_keep_the_recipes_defaults(monkeypatch):
    """No ``device``: the GPU if any (torchtune's inference); no ``dtype``: fp32, as before."""
    host(monkeypatch, gpu=None, cpu=["AVX512_BF16"])
    assert placement.resolve(None, None).line() == (
        "device: cpu (no GPU visible); dtype: fp32 (not set; the default)"
    )


def test_auto_is_written_back_and_explicit_values_are_left(monkeypatch):
    host(monkeypatch, gpu=None, cpu=["AVX512_BF16"])
    cfg = OmegaConf.create({"device": "auto", "dtype": "auto"})
    picked = placement.resolve_config(cfg)
    assert (cfg.device, cfg.dtype) == ("cpu", "bf16") == (picked.device, picked.dtype)
    cfg = OmegaConf.create({"device": "cpu"})
    placement.resolve_config(cfg)
    assert OmegaConf.to_container(cfg) == {"device": "cpu"}  # no dtype key added


@pytest.mark.parametrize("extra, found", [
    ("avx512_bf16", ["AVX512_BF16"]),
    ("amx_bf16 amx_tile", ["AMX-BF16"]),
    ("avx512_bf16 amx_bf16", ["AVX512_BF16", "AMX-BF16"]),
    ("avx512_vnni", []),
    ("avx512_bf16x", []),  # whole flags only
])  # fmt: skip
def test_cpu_bf16_features_are_read_from_cpuinfo_flags(tmp_path, extra, found):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO.format(extra=extra))
    assert placement.cpu_bf16_features(path) == found


def test_without_cpuinfo_torch_s_cpuid_queries_answer(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert placement.cpu_bf16_features(tmp_path / "absent") == ["AVX512_BF16"]
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    assert placement.cpu_bf16_features(tmp_path / "absent") == []


def test_this_host_against_its_own_cpuinfo():
    """The real detection, no replacement: the dtype follows /proc/cpuinfo's flags as read here."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file() or torch.cuda.is_available():
        pytest.skip("needs Linux's /proc/cpuinfo and no GPU")
    flags = set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    native = bool(flags & {"avx512_bf16", "amx_bf16"})
    picked = placement.resolve("auto", "auto")
    assert picked.device == "cpu" and picked.device_reason == "no GPU visible"
    assert picked.dtype == ("bf16" if native else "fp32")
    names = [n for f, n in (("avx512_bf16", "AVX512_BF16"), ("amx_bf16", "AMX-BF16")) if f in flags]
    assert picked.dtype_reason == (
        f"CPU has {', '.join(names)}" if native else "CPU has no AVX512_BF16 or AMX-BF16"
    )
