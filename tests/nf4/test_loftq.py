"""LoftQ factors against PEFT's ``loftq_init`` and against a hand-written loop on torchao's NF4.

PEFT's ``loftq_init`` refuses to start without bitsandbytes, then quantizes with it only when
its 4-bit build is available; otherwise it runs its own pure-torch ``NFQuantizer`` (one float32
absmax per block of 64, no double quantization, its own normal-float table, so its codes differ
from torchao's NF4). The first comparison stubs the bitsandbytes import so PEFT takes that path,
and runs :func:`loftq_factors` with the same quantizer: the factors must be equal bit for bit.
The second compares the torchao NF4 path with the published loop written out here.
"""

import sys
import types

import pytest
import torch

import squash  # noqa: F401
from squash.nf4.quantize import nf4_block_sizes, to_nf4
from squash.nf4 import loftq_factors

loftq_utils = pytest.importorskip("peft.utils.loftq_utils")


def _weight(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 0.02


@pytest.fixture
def peft_without_bitsandbytes(monkeypatch):
    """PEFT's loftq_init on its NFQuantizer path (bitsandbytes stubbed as installed without its
    4-bit support)."""
    monkeypatch.setitem(sys.modules, "bitsandbytes", types.ModuleType("bitsandbytes"))
    monkeypatch.setattr(loftq_utils, "is_bnb_available", lambda: True)
    monkeypatch.setattr(loftq_utils, "is_bnb_4bit_available", lambda: False)
    return loftq_utils.loftq_init


@pytest.mark.parametrize("iterations", [1, 2, 3])
def test_factors_equal_peft_loftq_init_with_its_quantizer(peft_without_bitsandbytes, iterations):
    w = _weight((192, 576))
    rank = 8
    q_dense, peft_a, peft_b = peft_without_bitsandbytes(w, num_bits=4, reduced_rank=rank,
                                                        num_iter=iterations)  # fmt: skip
    quantizer = loftq_utils.NFQuantizer(num_bits=4, device="cpu", method="normal", block_size=64)

    def quantize(res):
        return quantizer.dequantize_block(*quantizer.quantize_block(res))

    base, a, b = loftq_factors(w, rank, iterations, quantize=quantize)
    assert base is None
    assert a.shape == (rank, 576) and b.shape == (192, rank)
    assert torch.equal(a, peft_a) and torch.equal(b, peft_b)
    # PEFT's base is the quantization of W - B A from one iteration fewer (W itself at first)
    if iterations == 1:
        assert torch.equal(q_dense, quantize(w))
    else:
        _, a1, b1 = loftq_factors(w, rank, iterations - 1, quantize=quantize)
        assert torch.equal(q_dense, quantize(w - b1 @ a1))


def _reference_loftq(w, rank, iterations):
    """Li et al. (2023), Algorithm 1, on torchao's to_nf4 with squash's block sizes."""
    block, scaler = nf4_block_sizes("w", tuple(w.shape))
    res = w.clone()
    for _ in range(iterations):
        q = to_nf4(res, block, scaler)
        u, s, vh = torch.linalg.svd(w - q.get_original_weight(), full_matrices=False)
        b = u[:, :rank] @ torch.diag(s[:rank].sqrt())
        a = torch.diag(s[:rank].sqrt()) @ vh[:rank]
        res = w - b @ a
    return q, a, b


@pytest.mark.parametrize("iterations", [1, 2, 5])
@pytest.mark.parametrize("shape", [(192, 576), (576, 1536)])
def test_torchao_path_equals_the_published_loop(shape, iterations):
    w = _weight(shape)
    base, a, b = loftq_factors(w, 16, iterations)
    q, ra, rb = _reference_loftq(w, 16, iterations)
    assert torch.equal(base.get_original_weight(), q.get_original_weight())
    assert torch.allclose(a, ra, atol=1e-6) and torch.allclose(b, rb, atol=1e-6)
    # the product (what the model sees) is sign-convention free
    assert torch.allclose(b @ a, rb @ ra, atol=1e-6)


def test_error_falls_below_plain_nf4_and_with_iterations():
    w = _weight((576, 576))
    block, scaler = nf4_block_sizes("w", tuple(w.shape))
    plain = (w - to_nf4(w, block, scaler).get_original_weight()).norm()
    errors = []
    for t in (1, 3):
        base, a, b = loftq_factors(w, 16, t)
        errors.append(float((w - base.get_original_weight() - b @ a).norm()))
    assert errors[0] < plain
    assert errors[1] < errors[0]


def test_scale_divides_the_factors():
    w = _weight((192, 576))
    base1, a1, b1 = loftq_factors(w, 4, 2)
    base2, a2, b2 = loftq_factors(w, 4, 2, scale=2.0)
    assert torch.equal(base1.get_original_weight(), base2.get_original_weight())
    assert torch.allclose(2.0 * b2 @ a2, b1 @ a1, atol=1e-7)


def test_bad_arguments_name_them():
    w = _weight((64, 128))
    for kwargs, word in [(dict(rank=0), "rank"), (dict(rank=65), "rank"),
                         (dict(rank=4, iterations=0), "iterations"),
                         (dict(rank=4, scale=0.0), "scale")]:  # fmt: skip
        with pytest.raises(ValueError, match=word):
            loftq_factors(w, **kwargs)
    with pytest.raises(ValueError, match="weight"):
        loftq_factors(torch.randn(10), 2)
