"""The initial adapter of a run: the same whatever device the model was built on, and the same
SVD initialisation as the modules' own."""

import pytest
import torch
from torchtune.modules.peft import LoRALinear

from squash.assembly.adapter_init import initial_adapter_state_dict, svd_initial_state
from squash.models.opt import qlora_opt_tiny, squash_opt_tiny
from squash.modules import FFILinear, SparseLoRALinear, svd_initialize
from squash.sparsity.ffi import validate_ffi

ATTN = ["q_proj", "k_proj", "v_proj", "output_proj"]


def _squash(device, sparse_factor="a", quantize_base=True):
    with torch.device(device):
        return squash_opt_tiny(ATTN, True, lora_rank=8, lora_alpha=16,
                               quantize_base=quantize_base, sparsity=0.9,
                               sparse_factor=sparse_factor)  # fmt: skip


@pytest.mark.parametrize("sparse_factor", ["a", "b", "both"])
def test_the_initial_adapter_does_not_depend_on_how_the_model_was_built(sparse_factor):
    on_meta = initial_adapter_state_dict(_squash("meta", sparse_factor), seed=5)
    torch.manual_seed(0)  # the global RNG, which building on a device draws from, is not used
    on_cpu = initial_adapter_state_dict(_squash("cpu", sparse_factor), seed=5)
    model = _squash("cpu", sparse_factor)
    assert sorted(on_meta) == sorted(on_cpu) == sorted(
        k for k in model.state_dict() if ".lora_a." in k or ".lora_b." in k
    )
    for key in on_meta:
        assert torch.equal(on_meta[key], on_cpu[key]), key
    other = initial_adapter_state_dict(_squash("meta", sparse_factor), seed=6)
    assert any(not torch.equal(on_meta[k], other[k]) for k in on_meta)


def test_the_initial_adapter_is_lora_initialisation_with_valid_ffi_patterns():
    model = _squash("cpu", "both")
    state = initial_adapter_state_dict(model, seed=1)
    for name, module in model.named_modules():
        if not isinstance(module, SparseLoRALinear):
            continue
        a_vals, b_vals = state[f"{name}.lora_a.values"], state[f"{name}.lora_b.values"]
        k = module.lora_a.fan_in
        assert a_vals.abs().max() <= 1 / k**0.5 and a_vals.abs().min() > 0
        assert torch.count_nonzero(b_vals) == 0  # the adapter adds nothing at step 0
        validate_ffi(a_vals, state[f"{name}.lora_a.indices"], module.in_dim, where="test")
        validate_ffi(b_vals, state[f"{name}.lora_b.indices"], module.rank, where="test")
    # patterns differ between modules (each has its own generator)
    assert not torch.equal(state["layers.0.attn.q_proj.lora_a.indices"],
                           state["layers.0.attn.k_proj.lora_a.indices"])  # fmt: skip
    model.load_state_dict(state, strict=False)  # and it loads through FFILinear's checks


def test_torchtunes_lora_linear_gets_kaiming_a_and_zero_b():
    with torch.device("meta"):
        model = qlora_opt_tiny(ATTN, True, lora_rank=8)
    state = initial_adapter_state_dict(model, seed=3)
    modules = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    assert len(state) == 2 * len(modules) == 24
    a = state["layers.1.mlp.w1.lora_a.weight"]
    assert a.shape == (8, 128) and a.abs().max() <= 1 / 128**0.5 and a.std() > 0.02
    assert torch.count_nonzero(state["layers.1.mlp.w1.lora_b.weight"]) == 0


@pytest.mark.parametrize("sparse_factor", ["a", "b"])
@pytest.mark.slow
def test_svd_initial_state_equals_the_modules_svd_initialisation(sparse_factor):
    """Computed on full tensors for a sharded model; compared with svd_initialize on a built
    (dense-base) model, the path squash_finetune takes."""
    base = {k: v.clone() for k, v in _squash("cpu", quantize_base=False).state_dict().items()
            if not (".lora_a." in k or ".lora_b." in k)}  # fmt: skip
    model = _squash("cpu", sparse_factor, quantize_base=False)
    model.load_state_dict(base, strict=False)
    done = svd_initialize(model, base)
    adapter, residual = svd_initial_state(_squash("meta", sparse_factor), base)
    assert sorted(residual) == sorted(f"{n}.weight" for n in done)
    own = model.state_dict()
    for key, value in {**adapter, **residual}.items():
        torch.testing.assert_close(value.to(own[key].dtype), own[key], rtol=0, atol=1e-6)
    assert any(isinstance(m, FFILinear) for m in model.modules())
