"""``model.init: loftq``: each adapter on an NF4 base starts from LoftQ's alternation, and the
model the assembly builds holds the NF4 base and factors of that alternation.

The reference is LoftQ's published loop written out here on torchao's ``to_nf4`` and a float32
SVD (``tests/nf4/test_loftq.py`` checks the same loop against PEFT's ``loftq_init``)."""

import pytest
import torch
from omegaconf import OmegaConf

import squash  # noqa: F401
from squash.assembly.model_setup import assemble_adapter_model
from squash.config.keys import ConfigKeyError
from squash.config.values import check_model_values
from squash.models.opt import lora_opt_tiny
from squash.modules import SparseLoRALinear, get_adapter_modules
from squash.nf4 import NF4Tensor, nf4_dequantize, to_nf4

ATTN = ["q_proj", "v_proj"]


def _base_state_dict(seed=0):
    """Unquantized tiny-OPT weights with real spread (not the zero-init adapters)."""
    torch.manual_seed(seed)
    model = lora_opt_tiny(ATTN, True, lora_rank=4)
    return {k: v.detach().clone() for k, v in model.state_dict().items() if ".lora_" not in k}


def _assemble(component, base, **model):
    cfg = OmegaConf.create(dict(_component_=component, lora_attn_modules=ATTN,
                                apply_lora_to_mlp=True, lora_rank=8, lora_alpha=16, **model))
    return assemble_adapter_model(cfg, base, device=torch.device("cpu"), dtype=torch.float32)


def _reference(w, rank, scale, iterations, block, scaler):
    """LoftQ on torchao NF4: Q = NF4(res); U S V = svd(W - Q); res = W - B A."""
    res = w.float()
    for _ in range(iterations):
        q = to_nf4(res, block, scaler)
        u, s, vh = torch.linalg.svd(w - q.get_original_weight(), full_matrices=False)
        b = u[:, :rank] @ torch.diag(s[:rank].sqrt())
        a = torch.diag(s[:rank].sqrt()) @ vh[:rank]
        res = w - b @ a
    return q, a / scale**0.5, b / scale**0.5


@pytest.mark.parametrize("iterations", [1, 3])
def test_qlora_adapters_start_from_the_published_loftq_loop(iterations):
    base = _base_state_dict()
    model, start = _assemble("squash.models.opt.qlora_opt_tiny", base, init="loftq",
                             loftq_iterations=iterations)  # fmt: skip
    adapters = get_adapter_modules(model)
    assert len(adapters) == 8
    for name, m in adapters.items():
        w = base[f"{name}.weight"]
        q, a, b = _reference(w, 8, 2.0, iterations, m.weight.block_size,
                             m.weight.scaler_block_size)  # fmt: skip
        assert isinstance(m.weight, NF4Tensor)
        assert torch.equal(m.weight.quantized_data, q.quantized_data), name
        assert torch.equal(m.weight.quantized_scalers, q.quantized_scalers), name
        torch.testing.assert_close(m.lora_a.weight, a, atol=2e-6, rtol=1e-4, msg=name)
        torch.testing.assert_close(m.lora_b.weight, b, atol=2e-6, rtol=1e-4, msg=name)
        # the PEFT export's reference: the factors the run started from
        assert torch.equal(start[f"{name}.lora_a.weight"], m.lora_a.weight.detach())
        # Eckart-Young: W - Q - s B A is what the best rank-8 approximation of W - Q leaves
        deq = nf4_dequantize(m.weight).float()
        left = torch.linalg.svdvals((w - deq).double())[8:].square().sum().sqrt()
        err = (w - deq - 2.0 * m.lora_b.weight @ m.lora_a.weight).detach().double().norm()
        assert err.item() == pytest.approx(left.item(), rel=1e-5), name


def _product(module):
    a, b = module.dense_factors()
    return b @ a


@pytest.mark.parametrize("sparse_factor", ["a", "b", "both"])
def test_squash_adapters_pair_each_nf4_base_with_the_sparse_factors_of_its_error(sparse_factor):
    """Two iterations: the NF4 base is ``NF4(W - s B1 A1)`` of the first iteration's factors
    (read off a one-iteration model), and the factors are the SVD initialisation
    (``svd_factors``: Eckart-Young, then FFI pruning and a refit, tested on its own) of
    ``W - dequant(base)``; a sparse A with a refitted dense B never does worse than NF4."""
    from squash.modules import svd_factors

    base = _base_state_dict(1)
    comp = "squash.models.opt.squash_opt_tiny"
    one, _ = _assemble(comp, base, init="loftq", sparsity=0.5, sparse_factor=sparse_factor)
    two, _ = _assemble(comp, base, init="loftq", loftq_iterations=2, sparsity=0.5,
                       sparse_factor=sparse_factor)  # fmt: skip
    for name, m in get_adapter_modules(two).items():
        assert isinstance(m, SparseLoRALinear)
        w = base[f"{name}.weight"]
        first = get_adapter_modules(one)[name]
        q1 = to_nf4(w - first.scaling * _product(first), m.weight.block_size,
                    m.weight.scaler_block_size)  # fmt: skip
        assert torch.equal(m.weight.quantized_data, q1.quantized_data), name
        deq = nf4_dequantize(m.weight).float()
        state, _ = svd_factors(w - deq, rank=8, scaling=m.scaling,
                               fan_in_a=getattr(m.lora_a, "fan_in", None),
                               fan_in_b=getattr(m.lora_b, "fan_in", None))  # fmt: skip
        held = dict(m.named_parameters(), **dict(m.named_buffers()))
        for key, value in state.items():
            torch.testing.assert_close(held[key].to(value.dtype), value.to(held[key].dtype).to(
                value.dtype), atol=1e-6, rtol=1e-5, msg=f"{name}.{key}")  # fmt: skip
        if sparse_factor == "a":
            err = (w - deq - m.scaling * _product(m)).norm()
            assert err <= (w - deq).norm()


def test_config_errors_name_the_key():
    with pytest.raises(ConfigKeyError, match="model.init must be one of lora, svd, loftq"):
        check_model_values({"init": "pissa"})
    with pytest.raises(ConfigKeyError, match="model.loftq_iterations must be an integer >= 1"):
        check_model_values({"init": "loftq", "loftq_iterations": 0})
    with pytest.raises(ConfigKeyError, match="model.loftq_iterations is set but model.init"):
        check_model_values({"loftq_iterations": 2})
    with pytest.raises(ConfigKeyError, match="remove model.base_outliers"):
        check_model_values({"init": "loftq", "base_outliers": {"fraction": 0.01}})
    check_model_values({"init": "loftq", "loftq_iterations": 2})


def test_loftq_on_an_unquantized_base_is_refused_naming_the_module():
    with pytest.raises(ConfigKeyError, match=r"init: loftq: layers\.0\.attn\.q_proj: .*NF4 base"):
        _assemble("squash.models.opt.lora_opt_tiny", _base_state_dict(), init="loftq")
