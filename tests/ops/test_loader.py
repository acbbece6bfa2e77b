"""Kernel loading: staged sources, SQUASH_KERNELS, and the fallback when no kernel builds."""

import warnings

import pytest
import torch

from squash.ops import _loader, reference
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


def test_bad_squash_kernels_value(monkeypatch):
    monkeypatch.setenv("SQUASH_KERNELS", "fast")
    with pytest.raises(ValueError, match="SQUASH_KERNELS"):
        _loader.mode()


def test_reference_mode_skips_loading(monkeypatch):
    monkeypatch.setenv("SQUASH_KERNELS", "reference")
    monkeypatch.setattr(_loader, "_state", {})
    assert _loader.ensure_loaded("cpu") is False
    assert _loader.status() == {"cpu": "reference", "cuda": "reference"}


def test_failed_build_warns_once_and_falls_back(monkeypatch):
    """With no usable compiler the op still gives the right answer, through the reference."""
    calls = []

    def no_compiler(device_type):
        calls.append(device_type)
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setattr(_loader, "_state", {})
    monkeypatch.setattr(_loader, "_compile", no_compiler)
    with pytest.warns(UserWarning, match="could not build the cpu FFI kernels.*command not found"):
        assert _loader.ensure_loaded("cpu") is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _loader.ensure_loaded("cpu") is False  # tried once per process
    assert calls == ["cpu"] and _loader.status()["cpu"] == "reference"

    # The op's fallback path (the one a machine without a native CPU kernel takes).
    from squash.ops.ffi_linear import _ffi_linear_fallback

    g = torch.Generator().manual_seed(0)
    x, values = torch.randn(5, 30, generator=g), torch.randn(7, 4, generator=g)
    indices = random_ffi_indices(7, 30, 4, generator=g)
    y = _ffi_linear_fallback(x, values, indices)
    torch.testing.assert_close(y, x @ ffi_to_dense(values, indices, 30).T)
    torch.testing.assert_close(y, reference.ffi_linear(x, values, indices))
