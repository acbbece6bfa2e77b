"""squash's NF4 nearest-level search equals torchao's own (the (numel, 16) distance table it
replaces), element for element and through to_nf4, on random, adversarial and real-shaped data."""

import pytest
import torch

from squash.nf4 import NF4Tensor, install_torchao_extensions, to_nf4
from squash.nf4 import extensions as ops

install_torchao_extensions()  # squash's nearest-level search in to_nf4


def _levels(dtype):
    w = to_nf4(torch.randn(64 * 256), 64, 256)
    return w.nf4.to(dtype)


def _torchao(value, nf4):
    """torchao's definition: argmin over the distance to each of the 16 levels."""
    return (value.unsqueeze(-1) - nf4).abs().min(dim=-1).indices


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
    assert torch.equal(ops.quantize_tensor_nearest(value, nf4), _torchao(value, nf4))


@pytest.mark.parametrize("shape,block,scaler", [
    ((1536, 576), 64, 256), ((576, 576), 64, 216), ((192, 576), 64, 216), ((256, 128), 32, 8),
])  # fmt: skip
def test_to_nf4_equals_torchao_bit_for_bit(monkeypatch, shape, block, scaler):
    torch.manual_seed(1)
    w = torch.randn(shape) * 0.02
    w[0, :block] = 0.0  # an all-zero block: scaled 0/0
    ours = to_nf4(w, block, scaler)
    monkeypatch.setattr(NF4Tensor, "quantize_tensor_nearest", staticmethod(_torchao))
    theirs = to_nf4(w, block, scaler)
    assert torch.equal(ours.quantized_data, theirs.quantized_data)
    assert torch.equal(ours.quantized_scalers, theirs.quantized_scalers)
    assert torch.equal(ours.get_original_weight(), theirs.get_original_weight())
