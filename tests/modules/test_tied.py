"""FlatTiedLinear against torchtune's TiedLinear and a float64 product, and the builders that
use it against the same models with torchtune's TiedLinear put back."""

import pytest
import torch
from torch import nn
from torchtune.modules import TiedLinear

from squash.modules import FlatTiedLinear, flatten_tied_output


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_flat_tied_linear_equals_tied_linear_on_chunked_slices(dtype, tol):
    torch.manual_seed(0)
    emb = nn.Embedding(300, 24, dtype=dtype)
    h = torch.randn(3, 16, 24, dtype=dtype)
    got_g, want_g = h.clone().requires_grad_(), h.clone().requires_grad_()
    flat, tied = FlatTiedLinear(emb), TiedLinear(emb)
    upstream = torch.randn(3, 4, 300)  # the same upstream gradient for every chunk
    got = [flat(c) for c in got_g.chunk(4, dim=1)]  # non-contiguous (3, 4, 24) views
    want = [tied(c) for c in want_g.chunk(4, dim=1)]
    exact = h.double() @ emb.weight.double().T  # the reference product in float64
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape == (3, 4, 300) and a.dtype == dtype
        torch.testing.assert_close(a.double(), exact[:, 4 * i : 4 * i + 4], rtol=tol, atol=tol)
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    sum((a.float() * upstream).sum() for a in got).backward()
    sum((b.float() * upstream).sum() for b in want).backward()
    torch.testing.assert_close(got_g.grad, want_g.grad, rtol=tol, atol=tol)
    # the input gradient by hand: each chunk's upstream gradient times E
    by_hand = torch.cat([upstream.double() @ emb.weight.double()] * 4, dim=1)
    torch.testing.assert_close(got_g.grad.double(), by_hand, rtol=tol, atol=tol * 10)


def test_flat_tied_linear_keeps_the_tie_and_the_weight_gradient():
    emb = nn.Embedding(50, 8)
    flat = FlatTiedLinear(emb)
    x = torch.randn(2, 5, 8)
    flat(x[:, ::2]).sum().backward()  # a strided slice
    # d/dE of sum(x E^T) = sum over tokens of x, for every vocabulary row
    want = x[:, ::2].reshape(-1, 8).sum(0).expand(50, 8)
    torch.testing.assert_close(emb.weight.grad, want)
    with torch.no_grad():
        emb.weight.zero_()
    assert flat(x).abs().max() == 0  # the tied module's weight, not a copy


def test_flatten_tied_output_replaces_only_a_tied_linear():
    class M(nn.Module):
        pass

    tied, untied = M(), M()
    tied.tok = nn.Embedding(10, 4)
    tied.output = TiedLinear(tied.tok)
    untied.output = nn.Linear(4, 10)
    assert type(flatten_tied_output(tied).output) is FlatTiedLinear
    assert tied.output.tied_module is tied.tok
    keep = untied.output
    assert flatten_tied_output(untied).output is keep


def test_opt_builder_logits_equal_torchtunes_tied_linear():
    """The tiny OPT built by squash (FlatTiedLinear) against the same model with torchtune's
    TiedLinear put back, chunked output as the recipes use it."""
    from squash.models.opt import lora_opt

    torch.manual_seed(0)
    model = lora_opt(["q_proj", "v_proj"], num_layers=2, vocab_size=300, embed_dim=32,
                     intermediate_dim=64, num_heads=4, max_seq_len=64, lora_rank=4,
                     lora_alpha=8)  # fmt: skip
    assert type(model.output) is FlatTiedLinear
    model.set_num_output_chunks(4)
    tokens = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        got = model(tokens)
        model.output = TiedLinear(model.tok_embeddings)
        want = model(tokens)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
