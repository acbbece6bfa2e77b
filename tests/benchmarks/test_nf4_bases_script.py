"""benchmarks/nf4_bases.py on a tiny random Llama: its perplexity equals transformers' own loss,
each base's weights equal an independent construction, bits are counted from the tensors, and the
model is restored after every arm; end to end (with SmolLM2's tokenizer) its JSON matches direct
computations."""

import json
import math

import nf4_bases as nb
import pytest
import torch

from squash.nf4.quantize import nf4_block_sizes, to_nf4


def _tiny(vocab=256):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=True)  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def _hf_perplexity(model, tokens):
    nll = n = 0.0
    for t in tokens:  # one window at a time: transformers' mean loss times its predictions
        loss = model(input_ids=t[None], labels=t[None]).loss
        nll += float(loss) * (len(t) - 1)
        n += len(t) - 1
    return math.exp(nll / n)


def _nf4_bits(numel: int, block: int, scaler: int) -> int:
    """NF4's bits by hand: 4-bit codes, an int8 scaler a block, a float32 factor a scaler block,
    the float32 mean and the 16 float32 levels."""
    return numel * 4 + numel // block * 8 + numel // block // scaler * 32 + 32 + 16 * 32


def test_perplexity_equals_transformers_loss():
    model = _tiny()
    tokens = torch.randint(0, 256, (5, 16))
    got = nb.perplexity(model, tokens, batch=2)
    assert got["tokens"] == 5 * 15
    assert math.isclose(got["perplexity"], _hf_perplexity(model, tokens), rel_tol=1e-5)


def test_arms_replace_the_projections_and_restore_them():
    model = _tiny()
    tokens = torch.randint(0, 256, (4, 16))
    originals = {k: m.weight.detach().clone() for k, m in nb.linears(model).items()}
    assert len(originals) == 2 * 7
    moments = nb.second_moments(model, tokens)
    # the second moment a hook saw equals the projection's input computed directly
    captured = {}
    h = model.model.layers[1].mlp.down_proj.register_forward_pre_hook(
        lambda m, a: captured.setdefault("x", a[0].detach().clone()))
    model(input_ids=tokens)
    h.remove()
    x = captured["x"].reshape(-1, 128).double()
    assert torch.allclose(moments["model.layers.1.mlp.down_proj"].double(), x.square().mean(0),
                          rtol=1e-5)  # fmt: skip

    evals = {"t": tokens}
    fp = nb.evaluate_arm(model, dict(name="fp32", kind="fp32"), evals, moments, originals)
    nf4 = nb.evaluate_arm(model, dict(name="nf4", kind="nf4"), evals, moments, originals)
    # independent: every projection replaced by torchao's dequantized NF4
    ref = _tiny()
    bits = numel = 0
    with torch.no_grad():
        for name, m in nb.linears(ref).items():
            block, scaler = nf4_block_sizes(name, tuple(m.weight.shape))
            q = to_nf4(m.weight, block, scaler)
            m.weight.copy_(q.get_original_weight())
            bits += _nf4_bits(m.weight.numel(), block, scaler)
            numel += m.weight.numel()
    assert math.isclose(nf4["scores"]["t"]["perplexity"], _hf_perplexity(ref, tokens), rel_tol=1e-5)
    assert math.isclose(nf4["bits_per_param"], bits / numel)
    assert math.isclose(fp["scores"]["t"]["perplexity"], _hf_perplexity(_tiny(), tokens),
                        rel_tol=1e-5)  # fmt: skip
    for name, m in nb.linears(model).items():  # restored
        assert torch.equal(m.weight, originals[name])

    arm = dict(name="o", kind="outliers", fraction=0.02, criterion="sensitivity")
    out = nb.evaluate_arm(model, arm, evals, moments, originals)
    # one outlier a row (round(0.02 * 64) = 1, round(0.02 * 128) = 3): 32 bits each on top
    extra = sum(w.shape[0] * max(1, round(0.02 * w.shape[1])) * 32 for w in originals.values())
    assert math.isclose(out["bits_per_param"], (bits + extra) / numel)
    lq = nb.evaluate_arm(model, dict(name="l", kind="loftq", rank=4, iterations=1), evals,
                         moments, originals)  # fmt: skip
    extra = sum(4 * sum(w.shape) * 16 for w in originals.values())
    assert math.isclose(lq["bits_per_param"], (bits + extra) / numel)
    res = dict(arms=[fp, nf4, out, lq], eval_windows={"t": 4})
    table = nb.table(res)
    assert "| nf4 | " in table and "0.0%" in table and "100.0%" in table


def test_squash_loftq_arm_by_hand():
    """The squash-rank LoftQ arm, one iteration, on one weight: ``dequant(NF4(W)) + B A`` with
    ``B`` and ``A`` the SVD factors of the NF4 error split as ``U sqrt(S)`` and ``sqrt(S) V^T``,
    each row cut to its fan-in largest magnitudes and rounded to bfloat16 (computed here from
    torch.linalg.svd); bits: NF4's plus 32 a kept entry (16-bit value, int16 index)."""
    torch.manual_seed(0)
    w = torch.randn(128, 64) * 0.05
    rank, sparsity = 8, 0.5
    got, bits = nb.squash_loftq_weight(w, rank, sparsity, 1, "layers.0.mlp.up_proj.weight")
    block, scaler = nf4_block_sizes("w", tuple(w.shape))
    q = to_nf4(w, block, scaler)
    deq = q.get_original_weight().float()
    u, sv, vh = torch.linalg.svd((w - deq).double(), full_matrices=False)
    b0, a0 = u[:, :rank] * sv[:rank].sqrt(), sv[:rank].sqrt()[:, None] * vh[:rank]

    def keep(m, k):  # the k largest magnitudes of each row, the rest zero
        idx = m.abs().topk(k, dim=1).indices
        return torch.zeros_like(m).scatter(1, idx, m.gather(1, idx)).bfloat16().double()

    a, b = keep(a0, 32), keep(b0, 4)  # fan-ins: round(0.5 * 64), round(0.5 * 8)
    torch.testing.assert_close(got.double(), deq.double() + b @ a, atol=1e-6, rtol=0)
    assert bits == _nf4_bits(w.numel(), block, scaler) + 32 * (rank * 32 + 128 * 4)
    # the correction lowers the error NF4 leaves
    assert (got - w).norm() < (deq - w).norm()


@pytest.mark.smollm2
def test_end_to_end_json(tmp_path, smollm2_checkpoint):
    """main() on a tiny random Llama saved with SmolLM2's tokenizer."""
    import shutil

    ckpt = tmp_path / "tiny"
    model = _tiny(vocab=49152)
    model.save_pretrained(ckpt)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_checkpoint / f, ckpt / f)
    out = tmp_path / "r.json"
    doc = tmp_path / "nf4.md"
    nb.main(["--checkpoint", str(ckpt), "--seq-len", "32", "--calibration-windows", "2",
             "--eval-windows", "2", "--ood-windows", "2", "--arms", "fp32", "nf4",
             "outliers_sensitivity_1%", "--json", str(out), "--doc", str(doc),
             "--plot", str(tmp_path / "p.png")])  # fmt: skip
    assert (tmp_path / "p.png").stat().st_size > 1000
    res = json.loads(out.read_text())
    assert [a["name"] for a in res["arms"]] == ["fp32", "nf4", "outliers_sensitivity_1%"]
    from transformers import AutoTokenizer

    from squash.datasets.pydoc_text import pydoc_text

    tok = AutoTokenizer.from_pretrained(ckpt)
    ids = tok(pydoc_text("test"), add_special_tokens=False)["input_ids"][:64]
    fp = _hf_perplexity(_tiny(vocab=49152), torch.tensor(ids).view(2, 32))
    assert math.isclose(res["arms"][0]["scores"]["pydoc_test"]["perplexity"], fp, rel_tol=1e-5)
    text = doc.read_text()
    assert "outliers_sensitivity_1%" in text and "bits/param" in text
    # --append keeps what is there and adds the rest
    nb.main(["--checkpoint", str(ckpt), "--seq-len", "32", "--calibration-windows", "2",
             "--eval-windows", "2", "--ood-windows", "2", "--arms", "nf4", "nf4_b32",
             "--json", str(out), "--doc", "", "--plot", "", "--append"])  # fmt: skip
    res2 = json.loads(out.read_text())
    assert [a["name"] for a in res2["arms"]] == ["fp32", "nf4", "outliers_sensitivity_1%",
                                                 "nf4_b32"]  # fmt: skip
    assert res2["arms"][1] == res["arms"][1]
