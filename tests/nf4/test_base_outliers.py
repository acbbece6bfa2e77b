"""``model.base_outliers``: a corrected 4-bit base ``NF4(W - S) + S`` built by squash's builders
and the recipes' one assembly path, checked against dense float64 products of the module-level
functions (``tests/nf4/test_outliers.py`` tests those against torchao)."""

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torchtune.models.llama3_2._component_builders import llama3_2

import squash  # noqa: F401  (registers torch.ops.squash.*)
from squash.assembly.calibration import model_second_moments, second_moments
from squash.assembly.model_setup import assemble_adapter_model, setup_frozen_model
from squash.config.keys import ConfigKeyError
from squash.config.values import check_model_values
from squash.export.adapters import merged_weights
from squash.models.opt import squash_opt_tiny
from squash.modules import SparseLoRALinear
from squash.modules.adapter import adapter_layout
from squash.nf4 import NF4Linear, NF4LoRALinear, nf4_linear, split_outliers, to_nf4
from squash.nf4.base_outliers import module_outliers, outlier_modules, parse_base_outliers
from squash.nf4.ops import nf4_dequantize
from squash.nf4.quantize import nf4_block_sizes
from squash.sparsity.ffi import ffi_to_dense
from tests.models.test_one_pass import TINY

FRACTION = 0.05  # 3 of 64 columns, 6 of 128


class CharTokenizer:
    """A stand-in for a torchtune tokenizer: one id per character, inside the tiny vocab."""

    def encode(self, text, add_bos=True, add_eos=True):
        return [ord(c) % TINY["vocab_size"] for c in text]


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    return {k: v.clone() for k, v in llama3_2(**TINY).state_dict().items()}


def _cfg(sparsity=0.75, outliers=None, **extra):
    block = {"_component_": "tests.models.test_one_pass.tiny_squash_smollm2",
             "lora_attn_modules": ["q_proj", "v_proj"], "lora_rank": 4, "lora_alpha": 8,
             "sparsity": sparsity, **extra}  # fmt: skip
    if outliers is not None:
        block["base_outliers"] = outliers
    return OmegaConf.create(block)


def _assemble(base, cfg, tokenizer=None):
    return assemble_adapter_model(cfg, base, device=torch.device("cpu"), dtype=torch.float32,
                                  seed=1, tokenizer=tokenizer).model  # fmt: skip


def _dense_reference(w, criterion="magnitude", moment=None):
    """float64 ``dequant(NF4(W - S)) + S`` from the module-level functions, and ``S``."""
    nf4, out = split_outliers(w, FRACTION, criterion, moment)
    s = ffi_to_dense(out.values.double(), out.indices, w.shape[1])
    return nf4_dequantize(nf4).double() + s, out


MAGNITUDE = {"fraction": FRACTION, "criterion": "magnitude"}


@pytest.mark.parametrize("sparsity", [0.75, None], ids=["SparseLoRALinear", "NF4LoRALinear"])
def test_frozen_forward_and_input_gradient_equal_the_dense_float64_product(base, sparsity):
    model = _assemble(base, _cfg(sparsity, MAGNITUDE))
    kinds = {type(m) for m in outlier_modules(model).values()}
    adapter_cls = SparseLoRALinear if sparsity else NF4LoRALinear
    assert kinds == {adapter_cls, NF4Linear}  # adapted projections and frozen ones (k, o, mlp)
    for name in ("layers.0.attn.q_proj", "layers.1.mlp.w2"):
        module = dict(model.named_modules())[name]
        ref, out = _dense_reference(base[f"{name}.weight"])
        got = module_outliers(module)
        assert torch.equal(got.indices, out.indices) and torch.equal(got.values, out.values)
        module.disabled = True  # the frozen base alone (NF4Linear has no adapter)
        x = torch.randn(3, 5, ref.shape[1], dtype=torch.float32, requires_grad=True)
        y = module(x)
        g = torch.randn_like(y)
        y.backward(g)
        want = x.detach().double() @ ref.T
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad.double(), g.double() @ ref, rtol=1e-5, atol=1e-5)


def test_nf4_part_is_torchao_nf4_of_the_weight_without_outliers(base):
    model = _assemble(base, _cfg(outliers=MAGNITUDE))
    name = "layers.0.attn.v_proj"
    module = dict(model.named_modules())[name]
    w = base[f"{name}.weight"]
    out = module_outliers(module)
    rest = w.scatter(1, out.indices.long(), 0.0)
    block, scaler = nf4_block_sizes(name, tuple(w.shape))
    want = to_nf4(rest, block, scaler).get_original_weight()
    assert torch.equal(nf4_dequantize(module.weight), want)


def test_absent_key_builds_todays_plain_nf4(base):
    today = _assemble(base, _cfg())
    none = _assemble(base, _cfg(outliers=None, base_outliers=None))
    assert not outlier_modules(today) and not outlier_modules(none)
    tokens = torch.randint(0, TINY["vocab_size"], (2, 8))
    assert torch.equal(today(tokens), none(tokens))
    q = today.layers[0].attn.q_proj
    q.disabled = True
    x = torch.randn(4, q.in_dim)
    assert torch.equal(q(x), nf4_linear(x, q.weight))  # the plain NF4 kernel, bit for bit
    assert today.state_dict().keys() == none.state_dict().keys()


def test_state_dict_holds_the_corrected_base_and_no_outlier_tensors(base):
    model = _assemble(base, _cfg(outliers=MAGNITUDE))
    sd = model.state_dict()
    assert not any("outlier" in k for k in sd)
    ref, _ = _dense_reference(base["layers.1.attn.q_proj.weight"])
    torch.testing.assert_close(sd["layers.1.attn.q_proj.weight"].double(), ref, rtol=0,
                               atol=1e-6)  # fmt: skip


@pytest.mark.parametrize("sparsity", [0.75, None], ids=["SparseLoRALinear", "NF4LoRALinear"])
def test_merged_weight_is_dequant_plus_outliers_plus_adapter_delta(base, sparsity):
    model = _assemble(base, _cfg(sparsity, MAGNITUDE))
    torch.manual_seed(2)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p) * 0.1)  # B non-zero: a real delta
    name = "layers.0.attn.q_proj"
    module = dict(model.named_modules())[name]
    ref, _ = _dense_reference(base[f"{name}.weight"])
    if sparsity:
        a, b = (f.double() for f in module.dense_factors())
    else:
        a, b = module.lora_a.weight.double(), module.lora_b.weight.double()
    want = ref + (module.alpha / module.rank) * (b @ a)
    merged = merged_weights(model.state_dict(), adapter_layout(model), torch.float32)
    torch.testing.assert_close(merged[f"{name}.weight"].double(), want, rtol=0, atol=2e-6)
    if sparsity:
        torch.testing.assert_close(module.merged_weight(torch.float32).double(), want, rtol=0,
                                   atol=2e-6)  # fmt: skip


def test_rebuilding_gives_the_same_outliers(base):
    first, second = (_assemble(base, _cfg(outliers=MAGNITUDE)) for _ in range(2))
    for name, module in outlier_modules(first).items():
        other = dict(second.named_modules())[name]
        a, b = module_outliers(module), module_outliers(other)
        assert torch.equal(a.values, b.values) and torch.equal(a.indices, b.indices)
        assert torch.equal(module.weight.quantized_data, other.weight.quantized_data)


def test_frozen_model_splits_its_bases_as_the_assembly_does(base):
    cfg = _cfg(outliers=MAGNITUDE)
    trained = _assemble(base, cfg)
    frozen = setup_frozen_model(cfg, base, device=torch.device("cpu"), dtype=torch.float32)
    for name, module in outlier_modules(trained).items():
        other = dict(frozen.named_modules())[name]
        assert torch.equal(module_outliers(module).values, module_outliers(other).values)


BAD = [
    ({"fraction": 0}, "model.base_outliers.fraction"),
    ({"fraction": 0.6}, "model.base_outliers.fraction"),
    ({"fraction": True}, "model.base_outliers.fraction"),
    ({"criterion": "magnitude"}, "model.base_outliers.fraction"),
    ({"fraction": 0.01, "criterion": "hessian"}, "model.base_outliers.criterion"),
    ({"fraction": 0.01, "fractoin": 0.01}, "model.base_outliers.fractoin"),
    ({"fraction": 0.01, "calibration": {"samples": 0}}, "model.base_outliers.calibration.samples"),
    ({"fraction": 0.01, "calibration": {"seq_len": 8}}, "model.base_outliers.calibration.seq_len"),
    (0.01, "model.base_outliers"),
]


@pytest.mark.parametrize("value,key", BAD)
def test_bad_value_is_one_line_naming_the_key(value, key):
    with pytest.raises(ConfigKeyError) as e:
        check_model_values({"base_outliers": value})
    assert str(e.value).startswith(key + " ") and "\n" not in str(e.value)
    with pytest.raises(ValueError) as e:  # the builder, where a config value reaches it
        squash_opt_tiny(["q_proj"], base_outliers=value)
    assert key.replace("model.", "") in str(e.value) and "\n" not in str(e.value)


def test_base_outliers_without_quantize_base_is_refused_naming_the_key():
    with pytest.raises(ConfigKeyError, match=r"^model\.base_outliers needs quantize_base"):
        check_model_values({"quantize_base": False, "base_outliers": MAGNITUDE})
    with pytest.raises(ValueError, match="base_outliers needs quantize_base"):
        squash_opt_tiny(["q_proj"], quantize_base=False, base_outliers=MAGNITUDE)


def test_defaults_are_documented_values():
    assert parse_base_outliers({"fraction": 0.01}) == {
        "fraction": 0.01, "criterion": "sensitivity",
        "calibration": {"samples": 32, "max_seq_len": 256}}  # fmt: skip


def test_second_moment_hook_equals_a_hand_computation():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    batches = [torch.randn(2, 5, 3), torch.randn(1, 5, 3)]
    grad_enabled = []  # the calibration forward records no autograd graph
    model.register_forward_hook(lambda *_: grad_enabled.append(torch.is_grad_enabled()))
    got = second_moments(model, batches, ["0", "2"])
    assert grad_enabled == [False, False]
    with torch.no_grad():
        x = torch.cat([b.reshape(-1, 3) for b in batches])  # (15, 3)
        h = torch.relu(model[0](x))  # (15, 4)
    torch.testing.assert_close(got["0"], (x.double() ** 2).mean(0).float())
    torch.testing.assert_close(got["2"], (h.double() ** 2).mean(0).float())


def test_sensitivity_scores_with_the_calibration_moments(base):
    outliers = {"fraction": FRACTION, "criterion": "sensitivity",
                "calibration": {"samples": 2, "max_seq_len": 16}}  # fmt: skip
    cfg = _cfg(outliers=outliers)
    model = _assemble(base, cfg, CharTokenizer())
    names = list(outlier_modules(model))
    moments = model_second_moments(cfg, base, names, CharTokenizer(),
                                   device=torch.device("cpu"), dtype=torch.float32)  # fmt: skip
    name = "layers.0.attn.q_proj"
    ref, out = _dense_reference(base[f"{name}.weight"], "sensitivity", moments[name])
    got = module_outliers(dict(model.named_modules())[name])
    assert torch.equal(got.indices, out.indices) and torch.equal(got.values, out.values)
    plain = dict(_assemble(base, _cfg(outliers=MAGNITUDE)).named_modules())[name]
    magnitude = module_outliers(plain)
    assert not torch.equal(got.indices, magnitude.indices)  # the moments change the choice
    with pytest.raises(ConfigKeyError, match="sensitivity needs the run's tokenizer"):
        _assemble(base, cfg)


def test_a_resumed_adapter_on_the_rebuilt_base_gives_the_same_outputs(base):
    """What a resume rebuilds: the same config and base weights, the saved adapter loaded."""
    from squash.export.adapters import adapter_state

    cfg = _cfg(outliers=MAGNITUDE)
    model = _assemble(base, cfg)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)  # as if trained
    saved = {k: v.clone() for k, v in adapter_state(model).items()}
    resumed = assemble_adapter_model(cfg, base, device=torch.device("cpu"), dtype=torch.float32,
                                     seed=1, adapter=saved).model  # fmt: skip
    tokens = torch.randint(0, TINY["vocab_size"], (2, 8))
    assert torch.equal(model(tokens), resumed(tokens))


def test_svd_init_splits_the_residual_it_trains_on(base):
    from squash.assembly.adapter_init import svd_initial_state

    cfg = _cfg(outliers=MAGNITUDE, init="svd")
    model = _assemble(base, cfg)
    _, residual = svd_initial_state(model, base)
    name = "layers.0.attn.q_proj"
    module = dict(model.named_modules())[name]
    _, out = _dense_reference(residual[f"{name}.weight"])
    assert torch.equal(module_outliers(module).indices, out.indices)
    assert torch.equal(module_outliers(module).values, out.values)
    with pytest.raises(ValueError, match="use init: svd in the assembly"):
        module.initialize_from_pretrained(base[f"{name}.weight"])


def test_a_sharded_assembly_holds_the_corrected_base_and_exports_it_as_one_device(base, tmp_path):
    """FSDP2 (one gloo process, so every NF4 base is sharded): each corrected base is a DTensor
    over ``NF4(W - S)`` with ``S`` whole beside it, equal to the unsharded assembly's, and the
    full state dict the recipe gathers for its merged export holds ``dequant(NF4) + S`` as one
    device's state dict does. (The forward of FSDP2's NF4 all-gather needs 2 processes: the
    losses are checked against one device in tests/recipes/test_squash_finetune_distributed.py.)"""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from squash.assembly.fsdp import shard_model
    from squash.export.adapters import state_to_export

    cfg = _cfg(outliers=MAGNITUDE)
    plain = _assemble(base, cfg)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        sharded = assemble_adapter_model(
            cfg, base, device=torch.device("cpu"), dtype=torch.float32, seed=1,
            shard=lambda model: shard_model(model, cpu_offload=False),
        ).model  # fmt: skip
        names = list(outlier_modules(sharded))
        assert names == list(outlier_modules(plain)) and len(names) == 14  # 7 linears x 2 layers
        mine, theirs = dict(sharded.named_modules()), dict(plain.named_modules())
        for name in names:
            a, b = mine[name], theirs[name]
            assert isinstance(a.weight, DTensor) and not isinstance(b.weight, DTensor), name
            assert torch.equal(a.outlier_indices, b.outlier_indices), name
            assert torch.equal(a.outlier_values, b.outlier_values), name
            assert torch.equal(nf4_dequantize(a.weight.to_local()), nf4_dequantize(b.weight)), name
        full = state_to_export(sharded, adapter_only=False, device=torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    expected = plain.state_dict()
    for name in names:
        key = f"{name.replace('_checkpoint_wrapped_module.', '')}.weight"
        torch.testing.assert_close(full[key], expected[key], rtol=0, atol=0, msg=key)
        assert not torch.equal(full[key], nf4_dequantize(theirs[name].weight)), key  # S is in
