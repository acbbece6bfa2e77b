"""squash's NF4 quantization (:func:`squash.nf4.to_nf4_exact`, its nearest-level search
:func:`squash.nf4.nearest_nf4_level`, :func:`squash.nf4.copy_nf4_`) equals torchao's own
``to_nf4``, ``quantize_tensor_nearest`` and ``copy_``, element for element and bit for bit, on
random, adversarial and real-shaped data. torchao's functions are untouched (squash replaces
none of them), so they are the reference as torchao ships them."""

import pytest
import torch
from torchtune.modules.peft import LoRALinear

from squash.modules import NF4Linear, sparse_lora_linear
from squash.nf4 import (
    NF4LoRALinear,
    NF4Tensor,
    copy_nf4_,
    nearest_nf4_level,
    quantize_nf4,
    to_nf4,
    to_nf4_exact,
    use_squash_nf4_,
)

_PARTS = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")


def _levels(dtype):
    w = to_nf4(torch.randn(64 * 256), 64, 256)
    return w.nf4.to(dtype)


def _torchao(value, nf4):
    """torchao's definition: argmin over the distance to each of the 16 levels."""
    return (value.unsqueeze(-1) - nf4).abs().min(dim=-1).indices


def _same(a, b):
    assert (a.block_size, a.scaler_block_size, a.n_blocks) == (
        b.block_size, b.scaler_block_size, b.n_blocks)  # fmt: skip
    for part in _PARTS:
        x, y = getattr(a, part), getattr(b, part)
        assert x.dtype == y.dtype and torch.equal(x, y), part
    assert (a.shape, a.stride(), a.dtype, a.requires_grad) == (
        b.shape, b.stride(), b.dtype, b.requires_grad)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nearest_equals_torchao_on_random_and_adversarial_values(dtype):
    nf4 = _levels(dtype)
    torch.manual_seed(0)
    mids = (nf4[1:] + nf4[:-1]) / 2
    eps = torch.finfo(dtype).eps
    value = torch.cat([
        torch.rand(100_000, dtype=dtype) * 2 - 1,            # the scaled range
        nf4, -nf4, mids,                                     # on a level, on a midpoint
        mids * (1 + eps), mids * (1 - eps),                  # one ulp either side
        torch.tensor([-1.0, 1.0, 0.0, -0.0, 1.5, -1.5], dtype=dtype),
        torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype),
    ])
    assert torch.equal(nearest_nf4_level(value, nf4), _torchao(value, nf4))
    assert torch.equal(nearest_nf4_level(value, nf4), NF4Tensor.quantize_tensor_nearest(value, nf4))


@pytest.mark.parametrize("shape,block,scaler", [
    ((1536, 576), 64, 256), ((576, 576), 64, 216), ((192, 576), 64, 216), ((256, 128), 32, 8),
])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_to_nf4_exact_equals_torchao_bit_for_bit(shape, block, scaler, dtype):
    torch.manual_seed(1)
    w = (torch.randn(shape) * 0.02).to(dtype)
    w[0, :block] = 0.0  # an all-zero block: scaled 0/0
    _same(to_nf4_exact(w, block, scaler), to_nf4(w, block, scaler))
    p = torch.nn.Parameter(w)  # requires_grad carried as torchao carries it
    _same(to_nf4_exact(p, block, scaler), to_nf4(p, block, scaler))


def test_copy_nf4_equals_torchao_copy():
    """A plain source in another dtype (quantized in its own dtype, then cast), an NF4 source of
    other block sizes (dequantized and re-quantized) and one of the same sizes (copied)."""
    torch.manual_seed(2)
    w = torch.randn(256, 128) * 0.02
    sources = [w.double(), w.bfloat16(), to_nf4(w, 32, 8), to_nf4(w.bfloat16(), 64, 128)]
    for source in sources:
        ours = to_nf4(torch.randn(256, 128).bfloat16(), 64, 128)
        theirs = to_nf4(torch.randn(256, 128).bfloat16(), 64, 128)
        assert copy_nf4_(ours, source) is ours
        theirs.copy_(source)
        _same(ours, theirs)


def test_squash_quantizes_and_loads_without_torchaos_nearest_level_search(monkeypatch):
    """squash's quantization and every squash NF4 module's load (a built one, a torchtune module
    replaced by ``use_squash_nf4_``) run squash's search, never torchao's (made to fail here,
    after torchao computed the reference and torchtune's constructors quantized their
    placeholders), and give torchao's NF4 of the weight with the module's block sizes."""
    torch.manual_seed(3)
    w = torch.randn(192, 576) * 0.02
    want = to_nf4(w, 64, 216)
    sizes = dict(block_size=64, scaler_block_size=216)
    modules = [
        sparse_lora_linear(576, 192, 4, 8.0, quantize_base=True),
        NF4Linear(576, 192, bias=False, **sizes),
        NF4LoRALinear(576, 192, 4, 8.0, quantize_base=True, **sizes),
        use_squash_nf4_(LoRALinear(576, 192, 4, 8.0, quantize_base=True, **sizes)),
    ]

    def refuse(*args, **kwargs):
        raise AssertionError("torchao's quantize_tensor_nearest was called")

    monkeypatch.setattr(NF4Tensor, "quantize_tensor_nearest", staticmethod(refuse))
    _same(quantize_nf4(w, "w"), want)
    for module in modules:
        module.load_state_dict({**module.state_dict(), "weight": w})
        assert (module.weight.block_size, module.weight.scaler_block_size) == (64, 216)
        for part in _PARTS:
            assert torch.equal(getattr(module.weight, part), getattr(want, part)), part
    with pytest.raises(AssertionError, match="quantize_tensor_nearest was called"):
        to_nf4(w, 64, 216)  # the refusal does refuse: torchao's own path still calls it
