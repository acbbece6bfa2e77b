"""Kernel loading: staged sources, SQUASH_KERNELS, and the fallback when no kernel builds."""

import os
import warnings
from pathlib import Path

import pytest
import torch

from squash.ops import _loader
from squash.sparsity import ffi_to_dense, random_ffi_indices


def test_stage_sources_copies_by_content(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    staged = _loader.stage_sources()
    assert staged.parent == tmp_path / "squash_sources"
    originals = sorted(p for p in _loader.kernels_dir().iterdir() if p.suffix in {".cpp", ".h", ".cu", ".cuh"})
    assert sorted(p.name for p in staged.iterdir()) == [p.name for p in originals]
    for p in originals:
        assert (staged / p.name).read_bytes() == p.read_bytes()
    assert _loader.stage_sources() == staged  # same content, same folder
    assert not [p for p in staged.parent.iterdir() if p.name.startswith(".staging-")]


@pytest.fixture
def fresh_loader(monkeypatch):
    """A loader that has read no variable and loaded nothing (the process's own state is put
    back afterwards)."""
    monkeypatch.setattr(_loader, "_env", {})
    monkeypatch.setattr(_loader, "_state", {})
    monkeypatch.setattr(_loader, "_built", {})
    return _loader


def test_bad_squash_kernels_value(fresh_loader, monkeypatch):
    monkeypatch.setenv("SQUASH_KERNELS", "fast")
    with pytest.raises(ValueError, match="SQUASH_KERNELS"):
        _loader.mode()


def test_reference_mode_skips_loading(fresh_loader, monkeypatch):
    monkeypatch.setenv("SQUASH_KERNELS", "reference")
    assert _loader.ensure_loaded("cpu") is False
    st = _loader.status()
    assert st["cpu"]["backend"] == st["cuda"]["backend"] == "reference"
    assert "SQUASH_KERNELS=reference" in st["cpu"]["reason"]


def test_failed_build_warns_once_and_falls_back(fresh_loader, monkeypatch):
    """With no usable compiler the op still gives the right answer, through the reference."""
    calls = []

    def no_compiler(device_type):
        calls.append(device_type)
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setenv("SQUASH_KERNELS", "native")
    monkeypatch.setattr(_loader, "_compile", no_compiler)
    with pytest.warns(UserWarning, match="could not build the cpu FFI kernels.*command not found"):
        assert _loader.ensure_loaded("cpu") is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _loader.ensure_loaded("cpu") is False  # tried once per process
    st = _loader.status()["cpu"]
    assert calls == ["cpu"] and st["backend"] == "reference"
    assert "command not found" in st["reason"]

    # The op's fallback path (the one a machine without a native CPU kernel takes), against the
    # dense masked product and a hand-computed case.
    from squash.ops.ffi_linear import _ffi_linear_fallback

    g = torch.Generator().manual_seed(0)
    x, values = torch.randn(5, 30, generator=g), torch.randn(7, 4, generator=g)
    indices = random_ffi_indices(7, 30, 4, generator=g)
    y = _ffi_linear_fallback(x, values, indices)
    want = x.double() @ ffi_to_dense(values.double(), indices, 30).T
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    v = torch.tensor([[10.0, 100.0], [1.0, -1.0]])
    i = torch.tensor([[0, 3], [1, 2]], dtype=torch.int16)
    assert _ffi_linear_fallback(x, v, i).tolist() == [[410.0, -1.0]]  # 10*1 + 100*4, 2 - 3


# ---- status and behaviour agree -------------------------------------------------------------
_FLIP = r"""
import json, os, sys, torch, squash
from squash.ops import reference
calls = []
for name in ("ffi_linear", "ffi_linear_grad_input", "ffi_linear_grad_values"):
    fn = getattr(reference, name)
    setattr(reference, name, lambda *a, _fn=fn, _n=name: (calls.append(_n), _fn(*a))[1])
x = torch.ones(3, 8, requires_grad=True)
v = torch.ones(2, 2, requires_grad=True)
i = torch.tensor([[0, 1], [2, 7]], dtype=torch.int16)
torch.ops.squash.ffi_linear(x, v, i).sum().backward()
before = squash.ops.status()["cpu"]["backend"]
os.environ["SQUASH_KERNELS"] = sys.argv[1]  # flipped after the first call
y = torch.ops.squash.ffi_linear(x, v, i)
y.sum().backward()
after = squash.ops.status()["cpu"]["backend"]
print(json.dumps({"before": before, "after": after, "calls": calls, "y": y.tolist()}))
"""


@pytest.mark.parametrize("start, flip", [
    pytest.param("native", "reference", marks=pytest.mark.slow), ("reference", "native")])
def test_status_and_behaviour_agree_after_flipping_the_variable(start, flip):
    """SQUASH_KERNELS is read once per process: flipping it after the first call changes neither
    what serves nor what status() says, and status() names what serves (the reference's
    functions are called exactly when it says "reference")."""
    import json
    import os
    import subprocess
    import sys

    if start == "native" and os.environ.get("SQUASH_KERNELS") == "reference":
        pytest.skip("SQUASH_KERNELS=reference: the native kernel is not loaded in this suite")
    env = {**os.environ, "SQUASH_KERNELS": start}
    r = subprocess.run([sys.executable, "-c", _FLIP, flip], env=env, capture_output=True,
                       text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["before"] == out["after"] == start
    assert out["y"] == [[2.0, 2.0]] * 3  # x[0] + x[1], x[2] + x[7] of ones
    if start == "native":
        assert out["calls"] == []
    else:
        assert set(out["calls"]) == {"ffi_linear", "ffi_linear_grad_input",
                                     "ffi_linear_grad_values"}  # fmt: skip


def test_status_names_device_backend_isa_and_build():
    import os

    if os.environ.get("SQUASH_KERNELS") == "reference":
        pytest.skip("SQUASH_KERNELS=reference: the native kernel is not loaded in this suite")
    assert _loader.ensure_loaded("cpu")
    st = _loader.status()["cpu"]
    assert st["backend"] == "native"
    assert st["isa"] in _loader.host_cpu_isas()
    assert st["device"] and os.path.isdir(st["build"])
    assert any(p.suffix == ".so" for p in Path(st["build"]).iterdir())
    want_bytes = {"avx512": 64, "avx2": 32, "generic": 16, "neon": 16}[st["isa"]]
    assert int(st["vector_bytes"]) == want_bytes


# ---- a build killed midway never makes a later process hang ---------------------------------
def _fake_load(seen):
    """Stands in for cpp_extension.load, with its locking: PyTorch waits on <build dir>/lock
    for as long as the file exists (forever, when its owner was killed)."""
    from torch.utils.file_baton import FileBaton

    def load(name, build_directory, **kwargs):
        baton = FileBaton(os.path.join(build_directory, "lock"))
        if not baton.try_acquire():
            raise AssertionError("cpp_extension.load would wait forever on a stale lock")
        baton.release()
        seen.append(name)
        return None

    return load


def test_stale_build_lock_is_removed(fresh_loader, monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("SQUASH_KERNELS", "native")
    build_dir = tmp_path / _loader.extension_name("cpu")
    build_dir.mkdir()
    (build_dir / "lock").write_text("")  # what a SIGKILLed build leaves behind
    seen = []
    monkeypatch.setattr(cpp_extension, "load", _fake_load(seen))
    with pytest.warns(UserWarning, match="stale build lock"):
        assert _loader.ensure_loaded("cpu")
    assert seen == [build_dir.name] and not (build_dir / "lock").exists()


def test_live_builder_is_waited_for_with_a_bound(fresh_loader, monkeypatch, tmp_path):
    import subprocess
    import sys
    import time

    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("SQUASH_KERNELS", "native")
    monkeypatch.setenv("SQUASH_BUILD_TIMEOUT", "1")
    build_dir = tmp_path / _loader.extension_name("cpu")
    build_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
        "print('held', flush=True); time.sleep(60)"), str(build_dir / ".squash-build.flock")],
        stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        seen = []
        monkeypatch.setattr(cpp_extension, "load", _fake_load(seen))
        start = time.monotonic()
        with pytest.warns(UserWarning, match="could not build the cpu.*SQUASH_BUILD_TIMEOUT"):
            assert _loader.ensure_loaded("cpu") is False
        assert time.monotonic() - start < 30 and seen == []
        assert _loader.status()["cpu"]["backend"] == "reference"
    finally:
        holder.kill()
        holder.wait()


def test_a_first_build_says_it_is_compiling_and_a_cached_one_is_silent(
    fresh_loader, monkeypatch, tmp_path, capsys
):
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("SQUASH_KERNELS", "native")
    built = []

    def load(name, sources, build_directory, **kwargs):
        # what a real build leaves: the library and a build.ninja naming the sources
        (Path(build_directory) / f"{name}.so").write_bytes(b"")
        (Path(build_directory) / "build.ninja").write_text("\n".join(sources))
        built.append(name)

    monkeypatch.setattr(cpp_extension, "load", load)
    assert _loader.ensure_loaded("cpu")
    err = capsys.readouterr().err
    build_dir = tmp_path / _loader.extension_name("cpu")
    assert f"compiling the cpu FFI kernels on first use ({_loader.BUILD_ESTIMATE['cpu']}" in err
    assert str(build_dir) in err and "cpu FFI kernels ready after" in err
    monkeypatch.setattr(_loader, "_state", {})  # a new process, same cache
    assert _loader.ensure_loaded("cpu") and len(built) == 2
    assert capsys.readouterr().err == ""
    # sources that changed since (newer than the library) are a rebuild, said as such
    staged = _loader.stage_sources() / "ffi_cpu.cpp"
    later = (build_dir / f"{build_dir.name}.so").stat().st_mtime + 10
    os.utime(staged, (later, later))
    assert _loader.build_needed(build_dir, [str(staged)])
