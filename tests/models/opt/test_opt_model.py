"""squash's OPT against transformers' OPTForCausalLM: logits, padding, packing, generation,
hidden states, chunked output and activation checkpointing."""

import copy
import json

import pytest
import torch
from torchtune.generation import (
    generate,
    get_causal_mask_from_padding_mask,
    get_position_ids_from_padding_mask,
)
from torchtune.modules import TransformerSelfAttentionLayer
from torchtune.training import set_activation_checkpointing

import transformers

ATOL = 1e-4
PAD = 1


def _tokens(b, s, vocab=96, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (b, s), generator=g)


def test_logits_match_transformers(hf_opt_dir, squash_loader, tmp_path):
    name, hf, path = hf_opt_dir
    model, _ = squash_loader(path, tmp_path / "out")
    if name == "350m_like":
        assert model.project_in is not None and isinstance(model.norm, torch.nn.Identity)
    else:
        assert model.project_in is None and isinstance(model.norm, torch.nn.LayerNorm)
    tokens = _tokens(3, 23)
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert ours.dtype == torch.float32 and ours.shape == theirs.shape
    assert (ours - theirs).abs().max() <= ATOL


def test_right_padding(hf_opt_dir, squash_loader, tmp_path):
    """Right padding needs neither a mask nor input_pos: real tokens sit at 0..n-1."""
    _, hf, path = hf_opt_dir
    model, _ = squash_loader(path, tmp_path / "out")
    tokens = _tokens(2, 16)
    lengths = torch.tensor([16, 9])
    real = torch.arange(16)[None] < lengths[:, None]  # (b, s)
    tokens[~real] = PAD
    with torch.no_grad():
        theirs = hf(tokens, attention_mask=real.long()).logits
        plain = model(tokens)
        masked = model(tokens, mask=get_causal_mask_from_padding_mask(real))
    assert (plain - theirs)[real].abs().max() <= ATOL
    assert (masked - theirs)[real].abs().max() <= ATOL


def test_left_padding_with_input_pos(hf_opt_dir, squash_loader, tmp_path):
    """Left padding: positions from the padding mask (as torchtune's generate computes them)."""
    _, hf, path = hf_opt_dir
    model, _ = squash_loader(path, tmp_path / "out")
    tokens = _tokens(2, 12)
    real = torch.ones_like(tokens, dtype=torch.bool)
    real[1, :5] = False
    tokens[~real] = PAD
    with torch.no_grad():
        theirs = hf(tokens, attention_mask=real.long()).logits
        ours = model(
            tokens,
            mask=get_causal_mask_from_padding_mask(real),
            input_pos=get_position_ids_from_padding_mask(real),
        )
    assert (ours - theirs)[real].abs().max() <= ATOL


def test_packed_samples_restart_positions(hf_opt_dir, squash_loader, tmp_path):
    """Two samples packed in one row (input_pos restarting at 0, block-causal mask) give each
    sample's own logits."""
    _, hf, path = hf_opt_dir
    model, _ = squash_loader(path, tmp_path / "out")
    a, b = _tokens(1, 7, seed=2), _tokens(1, 5, seed=3)
    packed = torch.cat([a, b], dim=1)
    input_pos = torch.cat([torch.arange(7), torch.arange(5)])[None]
    mask = torch.block_diag(torch.ones(7, 7), torch.ones(5, 5)).bool().tril()[None]
    with torch.no_grad():
        ours = model(packed, mask=mask, input_pos=input_pos)
        theirs = torch.cat([hf(a).logits, hf(b).logits], dim=1)
    assert (ours - theirs).abs().max() <= ATOL


def test_saved_checkpoint_loads_in_transformers(hf_opt_dir, squash_loader, tmp_path):
    _, hf, path = hf_opt_dir
    model, checkpointer = squash_loader(path, tmp_path / "out")
    checkpointer.save_checkpoint({"model": model.state_dict()}, epoch=0)
    out = tmp_path / "out" / "epoch_0"
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    reloaded = transformers.OPTForCausalLM.from_pretrained(out).eval()
    tokens = _tokens(2, 10)
    with torch.no_grad():
        assert (reloaded(tokens).logits - model(tokens)).abs().max() <= ATOL
        assert (reloaded(tokens).logits - hf(tokens).logits).abs().max() <= ATOL


def test_sharded_bin_checkpoint_with_index(make_hf, squash_loader, tmp_path):
    """Old-style HF checkpoints: pytorch_model-*.bin shards with an index, bare ``decoder.*`` keys
    (as facebook/opt-* files are saved from OPTModel) and a stored ``lm_head.weight``."""
    hf = make_hf("350m_like")
    path = tmp_path / "bin"
    hf.config.save_pretrained(path)
    state_dict = {k.removeprefix("model."): v.clone() for k, v in hf.state_dict().items()}
    keys = sorted(state_dict)
    shards = {
        "pytorch_model-00001-of-00002.bin": keys[::2],
        "pytorch_model-00002-of-00002.bin": keys[1::2],
    }
    weight_map = {}
    for name, shard_keys in shards.items():
        torch.save({k: state_dict[k] for k in shard_keys}, path / name)
        weight_map.update({k: name for k in shard_keys})
    (path / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    tokens = _tokens(2, 9)
    for files in (["pytorch_model.bin.index.json"], sorted(shards)):
        model, _ = squash_loader(path, tmp_path / "out", files=files)
        with torch.no_grad():
            assert (model(tokens) - hf(tokens).logits).abs().max() <= ATOL


def test_sharded_safetensors_save(make_hf, squash_loader, tmp_path):
    hf = make_hf("125m_like")
    hf.save_pretrained(tmp_path / "hf")
    model, checkpointer = squash_loader(tmp_path / "hf", tmp_path / "out")
    checkpointer._max_shard_size = 20_000
    checkpointer.save_checkpoint({"model": model.state_dict()}, epoch=3)
    out = tmp_path / "out" / "epoch_3"
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    reloaded = transformers.OPTForCausalLM.from_pretrained(out).eval()
    tokens = _tokens(1, 8)
    with torch.no_grad():
        assert (reloaded(tokens).logits - hf(tokens).logits).abs().max() <= ATOL


def test_greedy_generation_with_kv_cache(hf_opt_dir, squash_loader, tmp_path):
    """torchtune's generate (KV caches, left-padded prompts) picks transformers' greedy tokens."""
    _, hf, path = hf_opt_dir
    model, _ = squash_loader(path, tmp_path / "out")
    prompt = _tokens(2, 6, seed=4)
    prompt[1, :2] = PAD
    new = 8
    model.setup_caches(batch_size=2, dtype=torch.float32, decoder_max_seq_len=prompt.shape[1] + new)
    with torch.no_grad():
        ours, _ = generate(model, prompt, max_generated_tokens=new, pad_id=PAD, top_k=1)
        theirs = hf.generate(
            prompt,
            attention_mask=(prompt != PAD).long(),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=PAD,
        )
    assert torch.equal(ours, theirs)


def test_output_hidden_states_and_chunks(make_hf, squash_loader, tmp_path):
    hf = make_hf("350m_like")
    hf.save_pretrained(tmp_path / "hf")
    model, _ = squash_loader(tmp_path / "hf", tmp_path / "out")
    tokens = _tokens(2, 12)
    with torch.no_grad():
        full = model(tokens)
        hf_hidden = hf(tokens, output_hidden_states=True).hidden_states
        model.output_hidden_states = [0, 1]
        *hidden, logits = model(tokens)
        model.output_hidden_states = []
        model.set_num_output_chunks(4)
        chunks = model(tokens)
    assert torch.equal(logits, full)
    # Layer inputs: the embeddings, then the first layer's output.
    for ours, theirs in zip(hidden, hf_hidden[:2]):
        assert (ours - theirs).abs().max() <= ATOL
    assert isinstance(chunks, list) and len(chunks) == 4
    assert (torch.cat(chunks, dim=1).float() - full).abs().max() <= 1e-6


@pytest.mark.parametrize("name", ["350m_like", "125m_like"])
def test_activation_checkpointing_by_layer_class(make_hf, squash_loader, tmp_path, name):
    hf = make_hf(name)
    hf.save_pretrained(tmp_path / "hf")
    model, _ = squash_loader(tmp_path / "hf", tmp_path / "out")
    model.train()
    checkpointed = copy.deepcopy(model)
    set_activation_checkpointing(checkpointed, auto_wrap_policy={TransformerSelfAttentionLayer})
    assert all("Checkpoint" in type(layer).__name__ for layer in checkpointed.layers)
    tokens = _tokens(2, 10)
    grads = []
    for m in (model, checkpointed):
        m(tokens).logsumexp(-1).mean().backward()
        named = m.named_parameters()
        grads.append({n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in named})
    assert grads[0].keys() == grads[1].keys()
    for key, grad in grads[0].items():
        assert torch.allclose(grad, grads[1][key], atol=1e-6), key
