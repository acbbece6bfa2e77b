"""squash_opt builders: OPT with SparseLoRALinear adapters, checked against the QLoRA OPT."""

from pathlib import Path

import pytest
import torch

from squash.models import opt as opt_models
from squash.models.opt import OPTCheckpointer, qlora_opt_tiny, squash_opt, squash_opt_tiny
from squash.modules import FFILinear, SparseLoRALinear

TINY_OPT_DIR = Path(__file__).resolve().parents[3] / "assets" / "tiny_opt"

ATTN = ["q_proj", "k_proj", "v_proj", "output_proj"]


def _tiny_state_dict(tmp_path):
    checkpointer = OPTCheckpointer(str(TINY_OPT_DIR), ["model.safetensors"], str(tmp_path))
    return {k: v.float() for k, v in checkpointer.load_checkpoint()["model"].items()}


@pytest.mark.parametrize("sparse_factor", ["a", "b", "both"])
def test_squash_opt_tiny_equals_qlora_at_step_zero(tmp_path, sparse_factor):
    """Zero-initialised B (or zero FFI values): the sparse model's logits are the QLoRA model's,
    whose NF4 base is quantized from the same weights."""
    sd = _tiny_state_dict(tmp_path)
    torch.manual_seed(0)
    qlora = qlora_opt_tiny(ATTN, apply_lora_to_mlp=True, lora_rank=8).eval()
    qlora.load_state_dict(sd, strict=False)
    ours = squash_opt_tiny(ATTN, apply_lora_to_mlp=True, lora_rank=32, sparsity=0.75,
                           sparse_factor=sparse_factor).eval()
    ours.load_state_dict(sd, strict=False)

    layer = ours.layers[0]
    adapted = [m for m in ours.modules() if isinstance(m, SparseLoRALinear)]
    assert len(adapted) == 6 * len(ours.layers)  # q, k, v, output, fc1, fc2
    assert type(layer.attn.q_proj.weight).__name__ == "NF4Tensor"
    assert isinstance(layer.attn.q_proj.lora_a, FFILinear) == (sparse_factor in ("a", "both"))
    assert isinstance(layer.attn.q_proj.lora_b, FFILinear) == (sparse_factor in ("b", "both"))
    assert layer.attn.q_proj.lora_a.out_features == 32

    tokens = torch.randint(4, 1024, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(ours(tokens), qlora(tokens))


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
