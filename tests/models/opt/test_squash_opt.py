"""squash_opt builders: OPT with SparseLoRALinear adapters, checked against the QLoRA OPT."""

from pathlib import Path

import pytest
import torch
from torchtune.modules.peft import disable_adapter

from squash.models import opt as opt_models
from squash.models.opt import (
    OPTCheckpointer,
    opt_tiny,
    qlora_opt_tiny,
    squash_opt,
    squash_opt_tiny,
)
from squash.modules import FFILinear, SparseLoRALinear

TINY_OPT_DIR = Path(__file__).resolve().parents[3] / "assets" / "tiny_opt"

ATTN = ["q_proj", "k_proj", "v_proj", "output_proj"]


def _tiny_state_dict(tmp_path):
    checkpointer = OPTCheckpointer(str(TINY_OPT_DIR), ["model.safetensors"], str(tmp_path))
    return {k: v.float() for k, v in checkpointer.load_checkpoint()["model"].items()}


def dense_factor(factor):
    """A factor's dense weight in float64, scattered with a Python loop for FFI factors."""
    if not isinstance(factor, FFILinear):
        return factor.weight.detach().double()
    w = torch.zeros(factor.out_features, factor.in_features, dtype=torch.float64)
    for o, (row_idx, row_val) in enumerate(zip(factor.indices.tolist(), factor.values.tolist())):
        for c, v in zip(row_idx, row_val, strict=True):
            w[o, c] = v
    return w


def randomize_factors(model, seed):
    """Non-zero values in every adapter factor, so the adapters show in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


@pytest.mark.parametrize("sparse_factor", ["a", "b", "both"])
def test_squash_opt_tiny_with_trained_factors_equals_dense_computation(tmp_path, sparse_factor):
    """Non-zero factors on the NF4 base. References: (1) a plain OPT holding, for every adapted
    linear, ``dequant(NF4 base) + scaling * B @ A`` computed in float64 from the module's own
    tensors; (2) torchtune's QLoRA OPT with ``LoRALinear`` factors set to the same dense A, B."""
    sd = _tiny_state_dict(tmp_path)
    ours = squash_opt_tiny(ATTN, apply_lora_to_mlp=True, lora_rank=8, sparsity=0.75,
                           sparse_factor=sparse_factor).eval()  # fmt: skip
    ours.load_state_dict(sd, strict=False)
    randomize_factors(ours, seed=3)
    adapted = {n: m for n, m in ours.named_modules() if isinstance(m, SparseLoRALinear)}
    assert len(adapted) == 6 * len(ours.layers)  # q, k, v, output, fc1, fc2
    layer = ours.layers[0]
    assert type(layer.attn.q_proj.weight).__name__ == "NF4Tensor"
    assert isinstance(layer.attn.q_proj.lora_a, FFILinear) == (sparse_factor in ("a", "both"))
    assert isinstance(layer.attn.q_proj.lora_b, FFILinear) == (sparse_factor in ("b", "both"))

    merged = dict(sd)
    qlora = qlora_opt_tiny(ATTN, apply_lora_to_mlp=True, lora_rank=8).eval()
    qlora.load_state_dict(sd, strict=False)
    qlora_modules = dict(qlora.named_modules())
    for name, m in adapted.items():
        a, b = dense_factor(m.lora_a), dense_factor(m.lora_b)
        base = m.weight.get_original_weight().double()
        merged[f"{name}.weight"] = (base + m.scaling * b @ a).float()
        with torch.no_grad():
            qlora_modules[name].lora_a.weight.copy_(a)
            qlora_modules[name].lora_b.weight.copy_(b)
    plain = opt_tiny().eval()
    plain.load_state_dict(merged, strict=True)

    tokens = torch.randint(4, 1024, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = ours(tokens)
        with disable_adapter(ours):
            assert (logits - ours(tokens)).abs().max() > 1e-2  # the adapters do show
        torch.testing.assert_close(logits, plain(tokens), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits, qlora(tokens), atol=1e-5, rtol=1e-5)


def test_squash_opt_trains_adapters_only(tmp_path):
    """One AdamW step on a fixed batch lowers the loss and moves only adapter tensors."""
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    model = squash_opt_tiny(["q_proj", "v_proj"], lora_rank=16, sparse_factor="both")
    model.load_state_dict(_tiny_state_dict(tmp_path), strict=False)
    set_trainable_params(model, get_adapter_params(model))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    tokens = torch.randint(4, 1024, (2, 16), generator=torch.Generator().manual_seed(2))

    def loss_fn():
        logits = model(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    losses = []
    for _ in range(3):
        loss = loss_fn()
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[2] < losses[0]
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".lora_" in k and k.endswith(".values") for k in changed)


@pytest.mark.parametrize("size", ["125m", "350m", "1_3b", "2_7b", "6_7b"])
def test_squash_opt_sizes_keep_base_keys(size):
    """Built on the meta device: the base keys are OPT's, every projection is swapped, and the
    sparse factor's fan-in follows the sparsity."""
    with torch.device("meta"):
        base = getattr(opt_models, f"opt_{size}")()
        model = getattr(opt_models, f"squash_opt_{size}")(
            ["q_proj", "v_proj"], lora_rank=64, quantize_base=False, sparsity=0.9
        )
    assert {k for k in model.state_dict() if ".lora_" not in k} == set(base.state_dict())
    q = model.layers[0].attn.q_proj
    assert isinstance(q, SparseLoRALinear) and isinstance(q.lora_a, FFILinear)
    embed_dim = base.layers[0].attn.q_proj.in_features
    assert q.lora_a.values.shape == (64, max(1, round(0.1 * embed_dim)))


def test_squash_opt_component_builder_passes_sizes():
    model = squash_opt(["q_proj"], vocab_size=64, num_layers=1, num_heads=2, embed_dim=16,
                       intermediate_dim=32, max_seq_len=32, lora_rank=4, lora_alpha=8,
                       sparsity=0.5, sparse_factor="b")
    q = model.layers[0].attn.q_proj
    assert isinstance(q.lora_b, FFILinear) and q.lora_b.values.shape == (16, 2)  # k = 0.5 * 4
    with pytest.raises(ValueError):
        squash_opt(["q_proj"], vocab_size=64, num_layers=1, num_heads=2, embed_dim=16,
                   intermediate_dim=32, max_seq_len=32, lora_rank=4, lora_alpha=8,
                   sparse_factor="c")


def test_builders_are_one_plain_function_a_kind_that_passes_every_argument():
    """Each sized builder is its kind's one plain function (``lora_opt_sized``,
    ``squash_opt_sized``) with only the size bound: the same parameters after ``size``, and a
    model of the size's published dimensions."""
    import inspect

    from squash.models.opt._model_builders import _OPT_SIZES, lora_opt_sized
    from squash.models.opt._squash_builders import squash_opt_sized

    for size in ("125m", "350m", "1_3b", "2_7b", "6_7b", "tiny"):
        for prefix, template in (("lora_opt", lora_opt_sized), ("squash_opt", squash_opt_sized)):
            builder = getattr(opt_models, f"{prefix}_{size}")
            assert inspect.isfunction(template) and builder.func is template
            assert builder.args == (size,) and not builder.keywords
            assert list(inspect.signature(builder).parameters) == list(
                inspect.signature(template).parameters)[1:]  # fmt: skip
            assert size.replace("_", ".") in builder.__doc__.lower()  # its own size named
    with torch.device("meta"):
        m = opt_models.lora_opt_350m(["q_proj"])
    assert (len(m.layers), m.layers[0].attn.q_proj.in_dim) == (24, 1024) == (
        _OPT_SIZES["350m"]["num_layers"], _OPT_SIZES["350m"]["embed_dim"])  # fmt: skip
    assert "init" in inspect.signature(squash_opt_tiny).parameters
    model = squash_opt_tiny(["k_proj"], apply_lora_to_mlp=True, lora_rank=4, lora_alpha=3.0,
                            lora_dropout=0.25, quantize_base=False, sparsity=0.5,
                            sparse_factor="b", init="svd")  # fmt: skip
    for m in (model.layers[1].attn.k_proj, model.layers[1].mlp.w2):
        assert isinstance(m, SparseLoRALinear)
        assert (m.rank, m.alpha, m.dropout.p, m.sparse_factor) == (4, 3.0, 0.25, "b")
        assert m.lora_b.fan_in == 2  # half of rank 4 (sparsity 0.5; the default 0.9 keeps 1)
        assert not m._quantize_base and isinstance(m.lora_b, FFILinear)
        assert m.lora_a.weight.abs().max() > 0 and m.lora_b.values.abs().max() > 0  # factored
    assert not isinstance(model.layers[0].attn.q_proj, SparseLoRALinear)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(lora_rank=0), "lora_rank"),
        (dict(sparsity=1.0), "sparsity"),
        (dict(sparse_factor="A"), "sparse_factor"),
        (dict(init="pissa"), "init"),
        (dict(lora_dropout=-0.1), "lora_dropout"),
        (dict(lora_alpha=float("nan")), "lora_alpha"),
    ],
)
def test_squash_builder_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        squash_opt_tiny(["q_proj"], **kwargs)


def test_sizes_and_lora_arguments_of_the_component_builder_are_named():
    args = dict(vocab_size=64, num_layers=1, num_heads=2, embed_dim=16, intermediate_dim=32,
                max_seq_len=32, lora_rank=4, lora_alpha=8.0)  # fmt: skip
    for bad, name in [(dict(vocab_size=0), "vocab_size"), (dict(num_layers=1.5), "num_layers"),
                      (dict(init_std=-1.0), "init_std"), (dict(word_embed_proj_dim=0),
                      "word_embed_proj_dim")]:  # fmt: skip
        with pytest.raises(ValueError, match=name):
            squash_opt(["q_proj"], **(args | bad))
    with pytest.raises(ValueError, match="init='svd' needs sparse adapters"):
        opt_models.lora_opt(["q_proj"], **args, init="svd")


def test_nf4_sizes_torchao_cannot_quantize_are_named():
    """embed_dim 96: a 96 x 96 projection is not a multiple of torchao's 64 * 256 NF4 blocks."""
    args = dict(vocab_size=64, num_layers=1, num_heads=2, embed_dim=96, intermediate_dim=512,
                max_seq_len=32, lora_rank=4, lora_alpha=8.0, quantize_base=True)  # fmt: skip
    for sparsity in (None, 0.9):
        with pytest.raises(ValueError, match=r"layers\.\*\.attn\.v_proj.*\(96, 96\).*"
                                             r"block_size=64.*scaler_block_size=256"):  # fmt: skip
            opt_models.lora_opt(["v_proj"], sparsity=sparsity, **args)
